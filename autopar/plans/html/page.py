"""The plan's HTML page put together: ``render_html(plan)`` and ``write_html(plan, path)``.

The page's style and scripts are package resource files (``assets/plan.css``; ``assets/error.js``,
installed first in <head> so any script error shows in ``#errors``, which the browser test reads;
``assets/sort.js``, the sortable tables), inlined into the page, which a Content-Security-Policy
keeps from fetching anything. The sections come from ``sections`` and ``charts``.
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from typing import Optional, Union

from autopar.errors import PlanError
from autopar.plans.html.cells import escape
from autopar.plans.html.charts import baselines_section, memory_section
from autopar.plans.html.pipeline_section import mesh_search_section, pipeline_section
from autopar.plans.html.sections import communication_section, header_section, layer_groups_section, modules_section
from autopar.plans.schema import Plan

_CSP = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:; "
        "base-uri 'none'; form-action 'none'")


@functools.lru_cache(maxsize=None)
def asset(name: str) -> str:
    """The text of ``assets/<name>`` shipped with this package (read once)."""
    return resources.files(__package__).joinpath("assets").joinpath(name).read_text(encoding="utf-8")


def _canonical(plan: "Plan") -> "Plan":
    """The plan as ``Plan.save`` would write and ``load_plan`` read it back: floats rounded to 12
    significant digits, dict keys sorted (mesh axis order kept), wall-clock timings left out."""
    try:
        return Plan.from_dict(json.loads(plan.to_json(timing=False)))
    except (PlanError, TypeError, ValueError):  # a hand-made plan that cannot be saved: show it as it is
        return plan


def render_html(plan: "Plan", title: Optional[str] = None) -> str:
    """The plan as one self-contained HTML page (inline CSS, script and SVG; nothing fetched).

    ``title`` (the model's name, say) heads the page; the default names the mesh. Deterministic:
    equal plans, or a plan and the same plan saved and loaded, give identical text."""
    p = _canonical(plan)
    axes = p.mesh.get("axes") or {}
    mesh_txt = " \u00d7 ".join(f"{k}={v}" for k, v in axes.items()) or "no mesh axes"
    heading = title if title else f"autopar plan: {mesh_txt} ({p.mesh.get('device', '?')})"
    body = "".join([
        '<div id="errors" role="alert" hidden></div>',
        header_section(p, heading),
        "<nav>",
        " \u00b7 ".join(f'<a href="#{a}">{t}</a>' for a, t in (
            ("modules-section", "modules"), ("communication", "communication"), ("memory", "memory"),
            ("baselines", "recipes")) + ((("layer-groups", "checkpointing"),) if p.layer_groups else ())
            + ((("pipeline", "pipeline"),) if p.pipeline else ()) + ((("mesh-search", "mesh search"),) if p.mesh_search else ())),
        "</nav>",
        "<main>",
        modules_section(p),
        communication_section(p),
        memory_section(p),
        layer_groups_section(p),
        pipeline_section(p),
        mesh_search_section(p),
        baselines_section(p),
        "</main>",
        f'<footer>autopar plan, schema version {escape(p.schema_version)}; graph {escape((p.fingerprint or {}).get("graph", ""))}'
        "</footer>",
    ])
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{escape(_CSP)}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="generator" content="autopar">'
        '<link rel="icon" href="data:,">'
        f"<title>{escape(heading)}</title>"
        f"<style>\n{asset('plan.css')}</style>"
        f"<script>\n{asset('error.js')}</script>"
        "</head>\n<body>"
        f"{body}"
        f"<script>\n{asset('sort.js')}</script>"
        "</body></html>\n"
    )


def write_html(plan: "Plan", path: Union[str, os.PathLike], title: Optional[str] = None) -> None:
    """Write ``render_html(plan, title)`` to ``path`` as UTF-8 (through a temporary file, so a
    reader never sees half a page)."""
    text = render_html(plan, title=title)
    target = os.fspath(path)
    tmp = f"{target}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(text)
    os.replace(tmp, target)


__all__ = ["asset", "render_html", "write_html"]
