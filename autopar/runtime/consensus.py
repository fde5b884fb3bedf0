"""What every rank agrees on before it builds its module (``autopar.compile``): one plan, made or read
on rank 0 and shared; the same captured program everywhere; the mesh the plan was made for; and
where the job's ranks run against the node size the plan priced."""

from __future__ import annotations

import json
import warnings
from typing import Callable

import torch.distributed as dist

from autopar.cost_model.mesh import Mesh
from autopar.errors import CompileError, MeshError, PlanError
from autopar.ir.fingerprint import graph_fingerprint
from autopar.ir.graph import Graph
from autopar.plans import Plan, load_plan
from autopar.runtime.nodes import check_node_layout


def share_plan(plan, make: Callable[[], Plan]) -> Plan:
    """Rank 0's plan (made by ``make``, given, or read from the file ``plan`` names) on every rank; a
    plan file rank 0 cannot load is the same PlanError on every rank, and a plan rank 0 fails to make
    raises there and a CompileError saying so on the others (none waits for the others)."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            got = make() if plan is None else plan if isinstance(plan, Plan) else load_plan(plan)
            box[0] = ("plan", got.to_json(timing=False))
        except PlanError as e:
            box[0] = ("error", str(e))
        except Exception as e:  # noqa: BLE001 - planning failed: every rank raises it, none waits
            box[0] = ("failed", f"planning on rank 0 failed: {type(e).__name__}: {e}")
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    kind, text = box[0]
    if kind == "error":
        raise PlanError(text)
    if kind == "failed":
        raise CompileError(text)
    return Plan.from_dict(json.loads(text))


def check_plan_mesh(plan: Plan, mesh: Mesh) -> None:
    """A CompileError naming both meshes unless the plan's mesh axes are ``mesh``'s: names, sizes and order."""
    try:
        plan.check_mesh(mesh.axes)
    except PlanError as e:
        raise CompileError(str(e)) from None


def chosen_mesh(plan: Plan, mesh: Mesh) -> Mesh:
    """A ``Mesh.devices(n)`` mesh as the factorization ``plan`` chose (a CompileError if not for n devices)."""
    try:
        return mesh.factorized(plan.run_axes)
    except MeshError as e:
        raise CompileError(str(e)) from None


def check_same_capture(graph: Graph) -> None:
    """A CompileError on every rank unless every rank captured the same program (its fingerprint)."""
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, graph_fingerprint(graph))
    bad = [r for r, f in enumerate(got) if f != got[0]]
    if bad:
        raise CompileError(
            f"ranks captured different programs (rank 0 {got[0][:12]}, rank(s) {bad} differ): every rank must "
            "call autopar.compile with the same model and example input shapes")


def warn_node_layout(plan: Plan) -> None:
    """Warn (rank 0) when the job's nodes hold other groups of ranks than the plan priced as a node's."""
    per_node = int(plan.mesh.get("hardware", {}).get("devices_per_node", 1))
    why = check_node_layout(per_node, dict(zip(plan.axis_names, plan.mesh_shape)))
    if why is not None and dist.get_rank() == 0:
        warnings.warn(f"autopar.compile: {why}; the program is correct, but its plan's prices are not this job's",
                      RuntimeWarning, stacklevel=3)


__all__ = ["check_plan_mesh", "check_same_capture", "chosen_mesh", "share_plan", "warn_node_layout"]
