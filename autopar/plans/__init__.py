"""Plans: what ``autopar.plan(...)`` decided, as plain data, and its views.

* ``schema``: the ``Plan`` dataclass, its entry shapes, its canonical JSON file format and ``load_plan``;
* ``format``: human-readable figures (``human_bytes``, ``human_time``) and the helpers the views share;
* ``view``: the terminal views (``Plan.summary``, ``explain``, ``diff``);
* ``html``: the plan as one self-contained HTML page (``render_html``, ``write_html``).

Light on purpose: ``schema`` (pydantic, torch's dtypes) loads on first use of its names, so that a module
needing only ``plans.format`` (the command line's argument checks) does not load it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autopar.errors import PlanError
from autopar.plans.format import human_bytes, human_time

if TYPE_CHECKING:
    from autopar.plans.schema import SCHEMA_VERSION, Plan, load_plan


def __getattr__(name: str) -> Any:
    """``SCHEMA_VERSION``, ``Plan`` and ``load_plan``, from ``schema`` on first use."""
    if name in ("SCHEMA_VERSION", "Plan", "load_plan"):
        value = getattr(importlib.import_module("autopar.plans.schema"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopar.plans' has no attribute {name!r}")

__all__ = ["SCHEMA_VERSION", "Plan", "PlanError", "human_bytes", "human_time", "load_plan"]
