"""Proving strategies whose local code moves data between devices inside the op: ring attention's
block swaps (``LocalCtx.permute``) and the experts strategy's row exchanges (``LocalCtx.exchange``,
``rules.expert``). Every device of the mesh runs the rule's local implementation in a thread of its
own; an exchange meets its axis group's members in shared slots at a barrier, as the lowered
program's ``permute`` / ``all_to_all_v`` meet them through a process group."""

from __future__ import annotations

import itertools
import threading
from typing import Callable, Sequence

import torch

from autopar.ir.rules.base import LocalCtx, OpCall, Strategy, run_local

Coords = tuple[int, ...]


class _Groups:
    """One set of slots and one barrier per (axis, coordinates on the other axes)."""

    def __init__(self, mesh_shape: Sequence[int], timeout: float = 60.0):
        self.mesh_shape = tuple(mesh_shape)
        self.slots: dict[tuple, list] = {}
        self.barriers: dict[tuple, threading.Barrier] = {}
        for axis, n in enumerate(self.mesh_shape):
            others = [range(m) for i, m in enumerate(self.mesh_shape) if i != axis]
            for key in itertools.product(*others):
                self.slots[(axis, key)] = [None] * n
                self.barriers[(axis, key)] = threading.Barrier(n, timeout=timeout)

    def _meet(self, coords: Coords, axis: int, mine, read: Callable[[list], torch.Tensor]) -> torch.Tensor:
        """``read`` of every member's ``mine`` on ``coords``' group of ``axis`` (in member order),
        taken while no member can go on to change what it shared."""
        key = (axis, tuple(c for i, c in enumerate(coords) if i != axis))
        slots, barrier = self.slots[key], self.barriers[key]
        slots[coords[axis]] = mine
        barrier.wait()
        try:
            got, failed = read(list(slots)), None
        except Exception as e:  # noqa: BLE001 - raised once the group has met again
            got, failed = None, e
        barrier.wait()  # every member has read every slot before any is reused
        if failed is not None:
            raise failed
        return got

    def permute_for(self, coords: Coords) -> Callable:
        def permute(x: torch.Tensor, axis: int, dest: Sequence[int]) -> torch.Tensor:
            return self._meet(coords, axis, x, lambda got: got[list(dest).index(coords[axis])].clone())
        return permute

    def exchange_for(self, coords: Coords) -> Callable:
        def exchange(x: torch.Tensor, axis: int, send: list[int], recv: list[int]) -> torch.Tensor:
            me = coords[axis]

            def read(got: list) -> torch.Tensor:
                pieces = []
                for r, (peer, sizes) in enumerate(got):
                    if sizes[me] != recv[r]:
                        raise AssertionError(f"device {coords}: {recv[r]} rows expected from member {r}, "
                                             f"it sends {sizes[me]}")
                    pieces.append(peer.narrow(0, sum(sizes[:me]), sizes[me]))
                return torch.cat(pieces)

            return self._meet(coords, axis, (x, list(send)), read)
        return exchange

    def abort(self) -> None:
        """Release every waiting device (one failed)."""
        for b in self.barriers.values():
            b.abort()


def run_exchanging(call: OpCall, strategy: Strategy, mesh_shape: Sequence[int],
                   local_inputs: dict[Coords, list[torch.Tensor]], coords: Sequence[Coords],
                   offset_scale: int = 1) -> dict[Coords, list]:
    """Every device's outputs of one op under ``strategy``, the devices running together; the
    first failure that is not another device's released barrier is re-raised."""
    groups = _Groups(mesh_shape)
    out: dict[Coords, list] = {}
    errors: dict[Coords, BaseException] = {}

    def device(c: Coords) -> None:
        ctx = LocalCtx(call, strategy, tuple(mesh_shape), c, offset_scale, permute=groups.permute_for(c),
                       exchange=groups.exchange_for(c))
        try:
            out[c] = run_local(ctx, local_inputs[c])
        except BaseException as e:  # noqa: BLE001 - reported below, the others released
            errors[c] = e
            groups.abort()

    threads = [threading.Thread(target=device, args=(c,), daemon=True) for c in coords]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = min(errors, key=lambda c: (isinstance(errors[c], threading.BrokenBarrierError), c))
        raise errors[first]
    return out


__all__ = ["run_exchanging"]
