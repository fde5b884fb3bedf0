"""Row exchanges between the devices of a proof, for local code that moves rows across an axis
(``LocalCtx.exchange``, as the experts strategy of ``rules.expert`` calls it): each device runs on
its own thread, and an exchange meets its axis group's members in shared slots, as the lowered
program's ``all_to_all_v`` meets them through a process group."""

from __future__ import annotations

import itertools
import threading
from typing import Callable, Sequence

import torch

Coords = tuple[int, ...]


class Exchanges:
    """One meeting point per axis group of a mesh; ``for_device(coords)`` is that device's
    ``exchange(x, axis, send, recv)``."""

    def __init__(self, mesh_shape: Sequence[int], timeout: float = 60.0):
        self.mesh_shape = tuple(mesh_shape)
        self.slots: dict[tuple, list] = {}
        self.barriers: dict[tuple, threading.Barrier] = {}
        for axis, n in enumerate(self.mesh_shape):
            others = [range(m) for i, m in enumerate(self.mesh_shape) if i != axis]
            for key in itertools.product(*others):
                self.slots[(axis, key)] = [None] * n
                self.barriers[(axis, key)] = threading.Barrier(n, timeout=timeout)

    def abort(self) -> None:
        """Release every waiting device (one failed)."""
        for b in self.barriers.values():
            b.abort()

    def for_device(self, coords: Coords) -> Callable:
        def exchange(x: torch.Tensor, axis: int, send: list[int], recv: list[int]) -> torch.Tensor:
            key = (axis, tuple(c for i, c in enumerate(coords) if i != axis))
            me, slots, barrier = coords[axis], self.slots[key], self.barriers[key]
            slots[me] = (x, list(send))
            barrier.wait()
            got = list(slots)
            barrier.wait()  # every member has read every slot before any is reused
            pieces = []
            for r, (peer, sizes) in enumerate(got):
                if sizes[me] != recv[r]:
                    raise AssertionError(f"device {coords}: {recv[r]} rows expected from member {r}, it sends {sizes[me]}")
                pieces.append(peer.narrow(0, sum(sizes[:me]), sizes[me]))
            return torch.cat(pieces)

        return exchange


def run_devices(fn: Callable[[Coords, Callable], object], coords_all: Sequence[Coords],
                mesh_shape: Sequence[int]) -> dict[Coords, object]:
    """``fn(coords, exchange)`` for every device, each on its own thread; the first failure is re-raised."""
    ex = Exchanges(mesh_shape)
    out: dict[Coords, object] = {}
    errors: dict[Coords, BaseException] = {}

    def body(c: Coords) -> None:
        try:
            out[c] = fn(c, ex.for_device(c))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[c] = e
            ex.abort()

    threads = [threading.Thread(target=body, args=(c,), daemon=True) for c in coords_all]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = min(errors, key=lambda c: (isinstance(errors[c], threading.BrokenBarrierError), c))
        raise errors[first]
    return out
