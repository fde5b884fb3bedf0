"""Deprecated: the plan's HTML page now lives in ``autopar.plans.html``.

This module only re-exports its old names (``from autopar.plans.html import render_html, write_html``)
so that code written against ``autopar.plan_html`` keeps working.
"""

from autopar.plans.html import MAX_COMM_BARS, MAX_RESHARDINGS, MEMORY_PARTS, render_html, write_html

__all__ = ["MAX_COMM_BARS", "MAX_RESHARDINGS", "MEMORY_PARTS", "render_html", "write_html"]
