"""Deprecated: the Plan now lives in ``autopar.plans`` (``autopar.plans.schema``, ``autopar.plans.format``).

This module only re-exports its old names so that ``from autopar.plan import Plan, PlanError, ...``
keeps working. Note that ``autopar.plan`` (the attribute of the package) is the planning function,
not this module: ``autopar/__init__.py`` binds it after importing its submodules.
"""

from autopar.errors import PlanError
from autopar.plans.format import SOLVER_TIMING_KEYS, human_bytes, human_time
from autopar.plans.schema import SCHEMA_VERSION, Plan, graph_differences, load_plan

__all__ = ["SCHEMA_VERSION", "SOLVER_TIMING_KEYS", "Plan", "PlanError", "graph_differences", "human_bytes",
           "human_time", "load_plan"]
