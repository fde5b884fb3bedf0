"""``autopar.simulate``: run a plan's lowered program for every device of the mesh in one process.

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

from autopar.errors import AutoparError
from autopar.ir.placement import local_block
from autopar.passes.cast import CASTING, check_supported
from autopar.passes.lower import Program, Resolved, lower
from autopar.runtime import collectives as C
from autopar.runtime.simulate import collect, device_coords


class SimulationError(AutoparError):
    """A simulated rank failed."""


@dataclass
class RankResult:
    outputs: list
    grads: list = field(default_factory=list)
    executed: list = field(default_factory=list)


#: Precisions a lowered program runs in as captured (every tensor in its own dtype).
NATIVE_PRECISIONS = ("model", "fp32", "fp64")
#: Every precision a program can run at: the native ones, and those the lowering casts for.
EXECUTABLE_PRECISIONS = NATIVE_PRECISIONS + tuple(CASTING)


def execution_precision(name: str, planned: str, device: Optional[torch.device] = None) -> str:
    """The precision a program runs at: ``name`` ("plan": the plan's). Mixed and 16-bit precisions
    are executed by the casts the lowering inserts (``passes.cast``); one this machine cannot
    compute in on ``device`` is a clear error."""
    chosen = planned if name == "plan" else name
    if chosen not in EXECUTABLE_PRECISIONS:
        raise AutoparError(f"cannot run a program at precision {chosen!r}: choose one of {list(EXECUTABLE_PRECISIONS)}")
    check_supported(chosen, device)
    return chosen


def precision_context(name: str, device_type: str = "cpu"):
    """The context a program runs in at precision ``name``: none, since the lowered program itself
    casts (autocast does not cover the captured low-level ops)."""
    if name not in EXECUTABLE_PRECISIONS:
        raise AutoparError(f"cannot run a program at precision {name!r}: choose one of {list(EXECUTABLE_PRECISIONS)}")
    return contextlib.nullcontext()


def run_step(prog: Program, local_inputs: Sequence[torch.Tensor], tangent: Optional[torch.Tensor] = None,
             precision: str = "model") -> tuple[list, list]:
    """Forward (and, for training programs, backward with seed ``tangent``) on this thread's backend."""
    with torch.no_grad(), precision_context(precision):
        outputs, saved = prog.run_forward(*local_inputs)
        grads: list = []
        if prog.backward is not None:
            seed = tangent if tangent is not None else torch.ones((), dtype=outputs[0].dtype)
            grads = [C.wait(g) for g in prog.backward(*saved, seed)]
    return outputs, grads


def run_threads(fn: Callable[[tuple[int, ...]], Any], mesh_shape: Sequence[int], axis_names: Sequence[str],
                timeout: float = 300.0) -> tuple[dict, dict]:
    """``fn(coords)`` on one thread per device, each with its ``ThreadComm``; returns per-device
    results and executed collectives. The first failure stops the others and is re-raised."""
    tm = C.ThreadMesh(mesh_shape, axis_names, timeout=timeout)
    coords_all = device_coords(mesh_shape)
    results: dict = {}
    errors: dict = {}

    def body(coords):
        try:
            with C.use_backend(C.ThreadComm(tm, coords)):
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
        first = min(errors, key=lambda c: (isinstance(errors[c], C.CollectiveError), c))
        e = errors[first]
        raise SimulationError(f"simulated device {first} failed: {type(e).__name__}: {e}") from e
    return results, tm.executed


def simulate_programs(res: Resolved, placeholders: Sequence[torch.Tensor], precision: str = "model",
                      tangent: Optional[torch.Tensor] = None, programs: Optional[dict] = None):
    """Run every device's program (lowered at ``precision`` unless given) on blocks of the whole
    tensors ``placeholders`` (in the programs' input order). Returns ``(programs, results, executed)``."""
    mesh_shape, names = res.mesh.shape, res.mesh.names
    if programs is None:
        programs = {c: lower(res, c, precision=precision) for c in device_coords(mesh_shape)}

    def one(coords):
        prog = programs[coords]
        local = [local_block(t, slot.placements, mesh_shape, coords, slot.spec.blocks)
                 for t, slot in zip(placeholders, prog.inputs)]
        outs, grads = run_step(prog, local, tangent, precision)
        return RankResult(outs, grads)

    results, executed = run_threads(one, mesh_shape, names)
    return programs, results, executed


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


def placeholder_values(res: Resolved, slots, model: torch.nn.Module, args: Sequence, kwargs: dict) -> list:
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


def simulate(model: torch.nn.Module, plan, example_inputs=(), example_kwargs: Optional[dict] = None, *,
             precision: str = "model", trace: Optional[dict] = None):
    """Run ``plan``'s lowered program for every device of its mesh in this process.

    Returns ``(outputs, grads)``: for a training plan ``outputs`` is the loss and ``grads`` maps each
    parameter's FQN to its whole gradient; for an inference plan ``outputs`` is the tuple of the
    model's tensor outputs and ``grads`` is empty. Computes in the model's own dtypes unless
    ``precision="plan"``: the plan's precision, e.g. "bf16-mixed" (bf16 compute, parameters gathered
    in bf16, gradients reduced and returned in fp32, the loss in fp32; see ``passes.cast``). Pass a
    dict as ``trace`` to receive the collectives every device executed (``{coords: [Executed, ...]}``).
    """
    from autopar.ir.capture import capture
    from autopar.passes.lower import resolve
    from autopar.plans import Plan, load_plan

    if not isinstance(plan, Plan):
        plan = load_plan(plan)
    if precision not in ("model", "plan"):
        raise ValueError(f"precision must be 'model' or 'plan', got {precision!r}")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    graph = capture(model, args, kwargs, training=plan.training)
    res = resolve(graph, plan)
    run_prec = execution_precision(precision, plan.precision.get("name", "model"))
    programs = {c: lower(res, c, precision=run_prec) for c in device_coords(res.mesh.shape)}
    first = programs[(0,) * len(res.mesh.shape)]
    values = placeholder_values(res, first.inputs, model, args, kwargs)
    programs, results, executed = simulate_programs(res, values, run_prec, programs=programs)
    if trace is not None:
        trace.update(executed)
    shape = res.mesh.shape
    outs = gather_slots(first.outputs, {c: r.outputs for c, r in results.items()}, shape)
    kept = [o for o, s in zip(outs, first.outputs) if s.kind in ("loss", "output")]
    grads = {}
    if plan.training:
        whole = gather_slots(first.grads, {c: r.grads for c, r in results.items()}, shape)
        grads = {s.key: g for s, g in zip(first.grads, whole)}
        for alias, canon in graph.aliases.items():
            if canon in grads:
                grads[alias] = grads[canon]
        return kept[0], grads
    return tuple(kept), grads


__all__ = ["EXECUTABLE_PRECISIONS", "NATIVE_PRECISIONS", "SimulationError", "execution_precision", "gather_slots", "precision_context", "run_step", "run_threads", "simulate",
           "simulate_programs"]
