"""Running lowered programs for every device of a mesh in one process (``autopar.simulate``).

Each device is a thread running its own lowered program on its own blocks; collectives meet in
shared slots (``collectives.ThreadComm``). The result is reassembled as one device would hold it,
so a 64-device plan of a small model can be checked against the model itself on a laptop.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from autopar.errors import CollectiveError, SimulationError
from autopar.ir.placement import local_block
from autopar.ir.rules.proof.interp import collect, device_coords
from autopar.program import collectives as C
from autopar.program.program import Program
from autopar.runtime.collectives import ThreadComm, ThreadMesh
from autopar.runtime.memory import MemoryTracker


@dataclass
class RankResult:
    """What one simulated device's program returned: its outputs, gradients and collectives."""

    outputs: list
    grads: list = field(default_factory=list)
    executed: list = field(default_factory=list)


def run_step(prog: Program, local_inputs: Sequence[torch.Tensor], tangent: Optional[torch.Tensor] = None,
             precision: str = "model", memory: Optional[MemoryTracker] = None,
             optimizer: Sequence[torch.Tensor] = ()) -> tuple[list, list]:
    """Forward (and, for training programs, backward with seed ``tangent``) on this thread's backend.
    With ``memory``, the step is measured there (``optimizer``: the state held through it)."""
    watch = memory.watching if memory is not None else contextlib.nullcontext
    if memory is not None:
        state = [t for t, s in zip(local_inputs, prog.inputs) if s.kind in ("param", "buffer")]
        rest = [t for t, s in zip(local_inputs, prog.inputs) if s.kind not in ("param", "buffer")]
        memory.begin(params=state, optimizer=optimizer, inputs=rest)
    with torch.no_grad():
        with watch():
            outputs, saved = prog.run_forward(*local_inputs)
        if memory is not None:
            memory.mark(saved, "activations")
        grads: list = []
        if prog.backward is not None:
            seed = tangent if tangent is not None else torch.ones((), dtype=outputs[0].dtype, device=outputs[0].device)
            with watch():
                grads = prog.run_backward(*saved, seed)
            if memory is not None:
                memory.mark(grads, "grads")
    if memory is not None:
        memory.finish()
    return outputs, grads


def run_threads(fn: Callable[[tuple[int, ...]], Any], mesh_shape: Sequence[int], axis_names: Sequence[str],
                timeout: float = 300.0) -> tuple[dict, dict]:
    """``fn(coords)`` on one thread per device, each with its ``ThreadComm``; returns per-device
    results and executed collectives. The first failure stops the others and is re-raised."""
    tm = ThreadMesh(mesh_shape, axis_names, timeout=timeout)
    coords_all = device_coords(mesh_shape)
    results: dict = {}
    errors: dict = {}

    def body(coords):
        try:
            with C.use_backend(ThreadComm(tm, coords)):
                results[coords] = fn(coords)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[coords] = e
            tm.abort()

    threads = [threading.Thread(target=body, args=(c,), daemon=True) for c in coords_all]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        tm.abort()
        raise SimulationError(f"simulated ranks did not finish within {timeout:.0f} s")
    if errors:
        first = min(errors, key=lambda c: (isinstance(errors[c], CollectiveError), c))
        e = errors[first]
        raise SimulationError(f"simulated device {first} failed: {type(e).__name__}: {e}") from e
    return results, tm.executed


def simulate_programs(programs: dict[tuple[int, ...], Program], placeholders: Sequence[torch.Tensor],
                      precision: str = "model", tangent: Optional[torch.Tensor] = None,
                      memory: Optional[dict] = None, optimizer_bytes: int = 0,
                      device: Optional[torch.device] = None):
    """Run every device's lowered program (``programs``: coords -> Program, one per device of the
    mesh) on blocks of the whole tensors ``placeholders`` (in the programs' input order).
    Returns ``(results, executed)``: per-device outputs and gradients, and the collectives each ran.

    With ``memory`` (a dict), each device's step is measured (``runtime.memory``) into
    ``memory[coords]``: its blocks are copies of their own (not views of the whole tensors), and
    it holds ``optimizer_bytes`` per element of each floating-point parameter block as optimizer
    state, as a training step after the first does. ``device``: where the blocks are moved (None: where
    ``placeholders`` are)."""
    first = next(iter(programs.values()))
    mesh_shape, names = first.mesh_shape, first.axis_names

    def one(coords):
        prog = programs[coords]
        local = [local_block(t, slot.placements, mesh_shape, coords, slot.spec.blocks)
                 for t, slot in zip(placeholders, prog.inputs)]
        if device is not None:
            local = [t.to(device) for t in local]
        tracker, state = None, []
        if memory is not None:
            local = [t.clone() for t in local]
            tracker = MemoryTracker()
            state = [torch.zeros(t.numel() * optimizer_bytes, dtype=torch.uint8, device=t.device)
                     for t, s in zip(local, prog.inputs) if s.kind == "param" and t.is_floating_point()]
        outs, grads = run_step(prog, local, tangent, precision, tracker, state)
        if tracker is not None:
            memory[coords] = tracker.last
        return RankResult(outs, grads)

    return run_threads(one, mesh_shape, names)


def gather_slots(slots, per_device: dict, mesh_shape) -> list[torch.Tensor]:
    """Whole tensors from every device's blocks of ``slots`` (B blocks must agree)."""
    out = []
    for j, slot in enumerate(slots):
        blocks = {c: per_device[c][j] for c in per_device}
        out.append(collect(blocks, slot.placements, mesh_shape, rtol=_rtol(blocks), blocks_of=slot.spec.blocks,
                           shape=slot.spec.shape))
    return out


def _rtol(blocks: dict) -> float:
    t = next(iter(blocks.values()))
    return 1e-9 if t.dtype == torch.float64 else 1e-3 if t.dtype in (torch.float16, torch.bfloat16) else 1e-5


def placeholder_values(slots, model: torch.nn.Module, args: Sequence, kwargs: dict) -> list:
    """The whole tensors behind a program's inputs: the model's parameters and buffers, the inputs."""
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    out = []
    for slot in slots:
        if slot.kind in ("param", "buffer"):
            t = state[slot.key].detach()
        elif slot.key.startswith("input:"):
            t = args[int(slot.key.split(":")[1])]
        else:
            t = kwargs[slot.key]
        if not isinstance(t, torch.Tensor) or t.is_meta:
            raise SimulationError(f"{slot.kind} {slot.key!r} has no values (a meta tensor?): simulation runs real tensors")
        if tuple(t.shape) != tuple(slot.spec.shape):
            raise SimulationError(f"{slot.kind} {slot.key!r} has shape {tuple(t.shape)}, the plan expects {slot.spec}")
        out.append(t)
    return out


__all__ = ["RankResult", "gather_slots", "placeholder_values", "run_step", "run_threads", "simulate_programs"]
