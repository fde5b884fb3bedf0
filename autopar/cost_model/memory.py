"""Memory per device: parameter state (weights, gradients, optimizer) and activation blocks.

Sizes are those of the device that holds the most: with DTensor's uneven ``Shard`` the first
pieces are the ceil-sized ones, so coordinates 0 give the largest block. A memory budget must hold
on every device, so the largest is what counts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence, Union

import torch

from autopar.cost_model.precision import Precision, element_bytes
from autopar.ir.placement import Placement, local_shape

if TYPE_CHECKING:
    from autopar.cost_model.mesh import Mesh

MeshLike = Union["Mesh", Sequence[int]]


def _mesh_shape(mesh: MeshLike) -> tuple[int, ...]:
    return tuple(mesh.shape) if hasattr(mesh, "shape") else tuple(mesh)


def local_numel(shape: Sequence[int], placements: Sequence[Placement], mesh: MeshLike) -> int:
    """Elements of the largest local block (the device at coordinates 0). ``mesh`` may be a Mesh or
    its shape."""
    ms = _mesh_shape(mesh)
    if len(placements) != len(ms):
        raise ValueError(f"placements {tuple(placements)} need one entry per mesh axis ({len(ms)})")
    return math.prod(local_shape(tuple(shape), tuple(placements), ms, (0,) * len(ms)))


def param_state_bytes(
    shape: Sequence[int],
    placements: Sequence[Placement],
    mesh: MeshLike,
    precision: Precision,
    dtype: torch.dtype = torch.float32,
) -> dict[str, int]:
    """Training state of one parameter on one device: ``{"params", "grads", "optimizer"}`` bytes.

    The gradient lies like its parameter (the planner constrains it so), so all three scale with the
    same local block. bf16-mixed AdamW: 4 (fp32 master) + 4 (fp32 grad) + 8 (two fp32 moments) = 16
    bytes per element. An integer parameter (rare) keeps its own size and has no gradient or state.
    """
    n = local_numel(shape, placements, mesh)
    if not dtype.is_floating_point:
        return {"params": n * dtype.itemsize, "grads": 0, "optimizer": 0}
    return {
        "params": n * element_bytes(dtype, "param", precision),
        "grads": n * element_bytes(dtype, "grad", precision),
        "optimizer": n * precision.optimizer_bytes,
    }


def activation_bytes(
    shape: Sequence[int], dtype: torch.dtype, placements: Sequence[Placement], mesh: MeshLike, precision: Precision
) -> int:
    """Bytes of the largest local block of an activation (compute precision for float tensors)."""
    return local_numel(shape, placements, mesh) * element_bytes(dtype, "activation", precision)


__all__ = ["activation_bytes", "local_numel", "param_state_bytes"]
