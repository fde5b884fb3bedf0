"""autopar: automatic parallelization of PyTorch models.

    mesh = autopar.Mesh({"dp": 2, "tp": 4}, device="h100")
    plan = autopar.plan(model, mesh, example_inputs)
    print(plan.summary())
    model = autopar.compile(model, mesh, example_inputs)   # on every rank of a process group

The names below are loaded on first use (``__getattr__``): ``import autopar`` does not import torch,
so the ``autopar`` command answers ``--help`` and argument errors at once.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it
_WHERE = {
    "AutoparError": "autopar.errors", "CaptureError": "autopar.errors", "LaunchError": "autopar.errors",
    "PlanError": "autopar.errors", "Mesh": "autopar.cost_model.mesh", "hint": "autopar.ir.hint",
    "Plan": "autopar.plans.schema", "load_plan": "autopar.plans.schema", "launch": "autopar.runtime.launch",
    "plan": "autopar.api", "simulate": "autopar.api", "ParallelModule": "autopar.parallel",
    "compile": "autopar.parallel", "StepOutput": "autopar.ir.outputs", "replan": "autopar.replan",
}

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from autopar import recipes
    from autopar.api import plan, simulate
    from autopar.cost_model.mesh import Mesh
    from autopar.errors import AutoparError, CaptureError, LaunchError, PlanError
    from autopar.ir.hint import hint
    from autopar.ir.outputs import StepOutput
    from autopar.parallel import ParallelModule, compile  # noqa: A004
    from autopar.plans.schema import Plan, load_plan
    from autopar.replan import replan
    from autopar.runtime.launch import launch


def __getattr__(name: str) -> Any:
    """Load a public name, or a submodule (``autopar.recipes``, ``autopar.models``, ...), on first use and keep it."""
    if name in _WHERE:
        value: Any = getattr(importlib.import_module(_WHERE[name]), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"autopar.{name}") is not None:
        value = importlib.import_module(f"autopar.{name}")
    else:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package's module type: importing the deprecated submodule ``autopar.plan`` (now
    ``autopar.plans``) binds it as an attribute of the package, which would hide the planning
    function ``autopar.plan``; that one binding is skipped, and so is the submodule ``autopar.replan``'s,
    which would hide its function ``autopar.replan``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("plan", "replan") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = ["AutoparError", "CaptureError", "LaunchError", "Mesh", "ParallelModule", "Plan", "PlanError", "StepOutput",
           "compile", "hint", "launch", "load_plan", "plan", "recipes", "replan", "simulate"]
