"""Plans: what ``autopar.plan(...)`` decided, as plain data, and its views.

* ``schema``: the ``Plan`` dataclass, its entry shapes, its canonical JSON file format and ``load_plan``;
* ``format``: human-readable figures (``human_bytes``, ``human_time``) and the helpers the views share;
* ``view``: the terminal views (``Plan.summary``, ``explain``, ``diff``);
* ``html``: the plan as one self-contained HTML page (``render_html``, ``write_html``).
"""

from autopar.errors import PlanError
from autopar.plans.format import human_bytes, human_time
from autopar.plans.schema import SCHEMA_VERSION, Plan, load_plan

__all__ = ["SCHEMA_VERSION", "Plan", "PlanError", "human_bytes", "human_time", "load_plan"]
