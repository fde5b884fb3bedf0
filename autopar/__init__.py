"""autopar: automatic parallelization of PyTorch models.

    mesh = autopar.Mesh({"dp": 2, "tp": 4}, device="h100")
    plan = autopar.plan(model, mesh, example_inputs)
    print(plan.summary())
"""

from autopar import recipes
from autopar.errors import AutoparError, CaptureError
from autopar.ir.hint import hint
from autopar.mesh import Mesh
from autopar.plan import Plan, PlanError, load_plan

# Imported last: the submodule ``autopar.plan`` would otherwise shadow the function.
from autopar.api import plan  # noqa: E402  isort: skip

__all__ = ["AutoparError", "CaptureError", "Mesh", "Plan", "PlanError", "hint", "load_plan", "plan", "recipes"]
