"""autopar: automatic parallelization of PyTorch models.

    mesh = autopar.Mesh({"dp": 2, "tp": 4}, device="h100")
    plan = autopar.plan(model, mesh, example_inputs)
    print(plan.summary())
    model = autopar.compile(model, mesh, example_inputs)   # on every rank of a process group
"""

from autopar import recipes
from autopar.cost_model.mesh import Mesh
from autopar.errors import AutoparError, CaptureError
from autopar.ir.hint import hint
from autopar.ir.outputs import StepOutput
from autopar.plans import Plan, PlanError, load_plan
from autopar.runtime.launch import LaunchError, launch

# The deprecated submodule ``autopar.plan`` (now ``autopar.plans``) is loaded before the function of the
# same name is bound: loaded later, by ``from autopar.plan import ...``, it would rebind ``autopar.plan``.
import autopar.plan as _plan_module  # noqa: E402  isort: skip

del _plan_module

# Imported last: the submodule ``autopar.plan`` would otherwise shadow the function.
from autopar.api import plan, simulate  # noqa: E402  isort: skip
from autopar.parallel import ParallelModule, compile  # noqa: E402,A004  isort: skip

__all__ = ["AutoparError", "CaptureError", "LaunchError", "Mesh", "ParallelModule", "Plan", "PlanError", "StepOutput",
           "compile", "hint", "launch", "load_plan", "plan", "recipes", "simulate"]
