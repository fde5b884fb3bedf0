"""A Plan as one self-contained HTML page: ``render_html(plan)`` and ``write_html(plan, path)``.

The page needs nothing but a browser: CSS and a small script are inline, charts are inline SVG or
CSS bars, and a Content-Security-Policy forbids every network fetch. It shows

* the header: model (graph summary), mesh, device, precision, step time split into compute and
  communication, peak memory against the budget, where the plan came from (search or a recipe);
* the modules in graph order with their parameters' placement on each mesh axis (S/B/P
  color-coded), compute time, communication time, bytes moved and memory, plus the alternatives;
* where communication happens: bytes moved per module, the collectives (kind, axis, bytes,
  count) and the reshardings with their steps;
* the memory per device (params, grads, optimizer, activations stacked against the budget);
* the plan against the hand-written recipes (step time bars; recipes that don't fit are marked,
  recipes that could not be applied are listed with their error).

Tables sort by clicking their headers; ``#sort=TABLE:COLUMN:asc|desc`` in the address sorts one on
load. Every text from the plan is escaped (module paths are user-controlled). The output is
deterministic: the plan is rendered from its canonical JSON form (the bytes ``Plan.save`` writes,
without wall-clock timings), so the same plan, or the same plan saved and loaded again, gives the
same bytes.

Modules: ``page`` (the whole page, and the CSS/JS from ``assets/``), ``sections`` (header, modules,
communication), ``charts`` (memory, recipes), ``cells`` (escaping, formats, chips, table cells).
"""

from autopar.plans.html.charts import MEMORY_PARTS
from autopar.plans.html.page import render_html, write_html
from autopar.plans.html.sections import MAX_COMM_BARS, MAX_RESHARDINGS

__all__ = ["MAX_COMM_BARS", "MAX_RESHARDINGS", "MEMORY_PARTS", "render_html", "write_html"]
