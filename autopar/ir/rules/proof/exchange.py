"""Proving strategies that exchange blocks inside the op (ring attention): every device of the mesh
runs the rule's local implementation in a thread of its own, and ``LocalCtx.permute`` is a swap
through shared slots, the devices of each axis group meeting at a barrier per exchange."""

from __future__ import annotations

import itertools
import threading
from typing import Sequence

import torch

from autopar.ir.rules.base import LocalCtx, OpCall, Strategy, run_local

Coords = tuple[int, ...]


class _Groups:
    """One set of slots and one barrier per (axis, coordinates on the other axes)."""

    def __init__(self, mesh_shape: Sequence[int]):
        self.mesh_shape = tuple(mesh_shape)
        self.slots: dict = {}
        self.barriers: dict = {}
        for axis, n in enumerate(self.mesh_shape):
            others = [range(m) for i, m in enumerate(self.mesh_shape) if i != axis]
            for key in itertools.product(*others):
                self.slots[(axis, key)] = [None] * n
                self.barriers[(axis, key)] = threading.Barrier(n, timeout=60)

    def permute_for(self, coords: Coords):
        def permute(x: torch.Tensor, axis: int, dest: Sequence[int]) -> torch.Tensor:
            key = (axis, tuple(c for i, c in enumerate(coords) if i != axis))
            slots, barrier, me = self.slots[key], self.barriers[key], coords[axis]
            slots[me] = x
            barrier.wait()
            got = slots[list(dest).index(me)].clone()
            barrier.wait()  # every member has read before any writes its next block
            return got
        return permute

    def abort(self) -> None:
        for b in self.barriers.values():
            b.abort()


def run_exchanging(call: OpCall, strategy: Strategy, mesh_shape: Sequence[int],
                   local_inputs: dict[Coords, list[torch.Tensor]], coords: list[Coords],
                   offset_scale: int = 1) -> dict[Coords, list]:
    """Every device's outputs of one op under ``strategy``, the devices running together."""
    groups = _Groups(mesh_shape)
    out: dict[Coords, list] = {}
    errors: list[BaseException] = []

    def device(c: Coords) -> None:
        ctx = LocalCtx(call, strategy, tuple(mesh_shape), c, offset_scale, permute=groups.permute_for(c))
        try:
            out[c] = run_local(ctx, local_inputs[c])
        except BaseException as e:  # noqa: BLE001 - reported below, the others released
            errors.append(e)
            groups.abort()

    threads = [threading.Thread(target=device, args=(c,)) for c in coords]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return out


__all__ = ["run_exchanging"]
