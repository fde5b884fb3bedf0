"""Model state on a rank: parameters and buffers become DTensors holding this rank's blocks.

``autopar.compile`` replaces each of the model's parameters and buffers by a DTensor placed as the
plan says. A block is a tensor of its own: a slice of the whole tensor would keep the whole
tensor's storage alive (every rank would hold the whole model on CPU).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from autopar import _torch_compat as tc
from autopar.errors import CompileError
from autopar.ir.graph import Graph
from autopar.ir.placement import local_block, to_dtensor
from autopar.program.program import Program, Slot


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def dtensor_block(local: torch.Tensor, dmesh, slot: Slot):
    """A DTensor of ``slot``'s whole shape and placements whose local block on this rank is ``local``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, dmesh, to_dtensor(slot.placements, slot.spec.blocks), run_check=False,
                              shape=torch.Size(slot.spec.shape), stride=_contiguous_stride(slot.spec.shape))


def distribute_state(model: torch.nn.Module, graph: Graph, program: Program, dmesh, device,
                     materializer=None) -> None:
    """Replace every parameter and buffer by a DTensor holding this rank's block (tied weights stay
    tied); meta tensors are rebuilt by ``materializer`` (``runtime.materialize``). Entries already
    None (parameters a pipeline rank does not hold) stay None. With ``_StridedShard`` parameters it
    teaches DCP their pieces (``_torch_compat.install_strided_checkpointing``)."""
    from autopar.runtime.materialize import full_value

    if any(slot.spec.blocks for slot in program.inputs):
        tc.install_strided_checkpointing()

    coords = tuple(dmesh.get_coordinate())
    done: dict[str, torch.Tensor] = {}
    for slot in program.inputs:
        if slot.kind not in ("param", "buffer"):
            continue
        owner, _, name = slot.key.rpartition(".")
        mod = model.get_submodule(owner)
        old = getattr(mod, name)
        if old is None:  # a parameter this rank does not hold (other pipeline stages': runtime.pipeline.state)
            continue
        whole = full_value(model, slot.key, old, materializer)
        block = local_block(whole, slot.placements, program.mesh_shape, coords, slot.spec.blocks)
        if device is not None:
            block = block.to(device)
        if block.untyped_storage().nbytes() > block.numel() * block.element_size():  # a view of the whole
            block = block.clone()
        dt = dtensor_block(block, dmesh, slot)
        if slot.kind == "param":
            new = torch.nn.Parameter(dt, requires_grad=old.requires_grad)
            tc.parameter_table(mod)[name] = new
        else:
            tc.buffer_table(mod)[name] = dt
            new = dt
        done[slot.key] = new
    for alias, canon in graph.aliases.items():
        if canon in done:
            owner, _, name = alias.rpartition(".")
            mod = model.get_submodule(owner)
            if name in tc.parameter_table(mod):
                tc.parameter_table(mod)[name] = done[canon]
            else:
                tc.buffer_table(mod)[name] = done[canon]


def state_slots(graph: Graph, program: Program) -> dict[str, Slot]:
    """Every name of a parameter or buffer (tied names included) -> its program slot."""
    slots = {s.key: s for s in program.inputs if s.kind in ("param", "buffer")}
    slots.update({a: slots[c] for a, c in graph.aliases.items() if c in slots})
    return slots


def as_blocks(state_dict: Mapping, slots: Mapping[str, Slot], program: Program, dmesh,
              current: Callable[[Slot], torch.Tensor]) -> dict:
    """``state_dict`` with each plain tensor of a parameter or buffer name (a single-device state
    dict's, whole on every rank) cut into this rank's block of the DTensor the plan makes of it, on
    the device of ``current(slot)`` (the DTensor held now), without communication; DTensors and
    other entries as they are. A whole tensor of another shape than the model's is an error."""
    from torch.distributed.tensor import DTensor

    coords = tuple(program.coords)
    values = {}
    for key, value in state_dict.items():
        slot = slots.get(key)
        if slot is not None and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            if tuple(value.shape) != tuple(slot.spec.shape):
                raise CompileError(f"state_dict[{key!r}] has shape {tuple(value.shape)}, but the model's "
                                   f"{key} has {tuple(slot.spec.shape)}")
            block = local_block(value, slot.placements, program.mesh_shape, coords, slot.spec.blocks)
            value = dtensor_block(block.to(tc.local_tensor(current(slot)).device), dmesh, slot)
        values[key] = value
    return tc.with_metadata(values, state_dict)


__all__ = ["as_blocks", "distribute_state", "dtensor_block", "state_slots"]
