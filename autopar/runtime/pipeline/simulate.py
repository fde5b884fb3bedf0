"""``autopar.simulate`` of a pipelined plan: every stage-mesh device a thread, its stages run in turn.

Each device of the stage mesh (the mesh without ``pp``) runs its staged program (the driver,
``autopar.simulate``, lowers the plan for its coordinates and cuts the program into stages exactly as
``autopar.compile`` does for the pipelined runtime), the whole step in one thread: the static part
once, every micro-batch's forward through the stages in order (boundary values handed over in memory), every micro-batch's
backward through the stages in reverse, the unreduced gradients summed, and the per-step reductions
once. Each micro-batch's loss enters the step's loss (and its backward) with the runtime's weight
(``pipeline.loss.loss_weights``: the whole batch's mean, also when micro-batches count different
numbers of targets). The order is GPipe's; every schedule computes the same sums (only their order differs), so this
checks the cut, the accumulation and the reductions of any schedule against the single-device model.
For ZBVZeroBubble the backwards run split as the runtime runs them: every input-gradient part first,
then every weight-gradient part (the latest first) on what the input parts handed over.

Each device is every pipeline rank of its stage-mesh coordinates at once, so what it executes is what
the plan predicts for a rank that holds every stage (``accounting.pipelined_predicted`` with all the
stages its own): the collectives, recorded as they run, and the point-to-point transfers, one send and
one receive of each value handed to a stage on another pipeline rank (forward boundary values and their
gradients back), at the size of the tensor handed over.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from autopar.ir.placement import local_block
from autopar.ir.rules.random_ops import draw_seed
from autopar.ir.stages import forward_readers
from autopar.program import collectives as C
from autopar.program.collectives import Executed
from autopar.program.staged import StagedProgram, boundary_pairs
from autopar.runtime.accounting import pipelined_predicted, static_values
from autopar.runtime.pipeline.loss import loss_weights
from autopar.runtime.pipeline.memory import RankMeters, state_stages
from autopar.runtime.pipeline.schedule import micro_slices
from autopar.runtime.random_state import pipelined_random
from autopar.runtime.threads import gather_slots, placeholder_values, run_threads


def simulate_staged(model: torch.nn.Module, plan, staged: dict[tuple, StagedProgram], args: tuple, kwargs: dict,
                    trace: Optional[dict] = None, predicted: Optional[dict] = None, memory: Optional[dict] = None,
                    optimizer_bytes: int = 0):
    """``(loss, grads)`` of one step of pipelined ``plan`` (see the module docstring); ``staged``: each
    stage-mesh device's staged program (coordinates -> ``StagedProgram``, every stage of it cut);
    ``trace`` receives each device's executed collectives and transfers, ``predicted`` what the plan
    predicts for it (``Counter`` per (kind, axis, bytes)). With ``memory`` (a dict), each pipeline rank
    of each device is measured apart (``pipeline.memory``: its stages' ops, state and stashes, its
    parameters' ``optimizer_bytes`` per element as optimizer state) into ``memory[coords]``, the
    whole mesh's coordinates (the pipeline axis's among them)."""
    pl = plan.pipeline
    m, n_stages = pl.microbatches, len(pl.stage_ranks)
    first_staged = next(iter(staged.values()))
    graph, stage_of, batch = first_staged.graph, first_staged.stage_of, first_staged.batch
    parts = micro_slices(args, kwargs, batch, m)
    shape, names = plan.mesh_shape, plan.axis_names
    programs = {c: st.program for c, st in staged.items()}
    cuts = {c: st.cut for c, st in staged.items()}
    split = pl.schedule == "ZBVZeroBubble"  # the backward in its input- and weight-gradient parts
    for c in programs:
        for s in range(n_stages - 1):  # what the runtime's stages can carry back (refused as it refuses)
            boundary_pairs(cuts[c].stages[s].f_out, cuts[c].stages[s].g_in, f"stages {s} -> {s + 1}")
    first = programs[(0,) * len(shape)]
    if first.random is not None:  # one seed for every device, from torch's generator; step 0
        seed = draw_seed()
        for prog in programs.values():
            prog.random.seed = seed  # type: ignore[union-attr]
            pipelined_random(prog, graph, m, batch // m)
    values = {name: model.get_parameter(fqn) for fqn, name in graph.params.items()}
    values.update({name: model.get_buffer(fqn) for fqn, name in graph.buffers.items()})
    weights = loss_weights(graph, parts, values)  # each micro-batch loss's factor in the step's loss
    ranks, axis = list(pl.stage_ranks), pl.axis
    owners = state_stages(graph, pl.stages, stage_of) if memory is not None else {}

    def handed(moved: list, outs: list, here: int, there: int) -> None:
        """Record ``outs`` handed from stage ``here`` to ``there`` when another pipeline rank holds it."""
        if ranks[here] != ranks[there]:
            for t in outs:
                nbytes = t.numel() * t.element_size()
                moved += [Executed("send", axis, nbytes), Executed("recv", axis, nbytes)]

    def one(coords):
        prog, ct = programs[coords], cuts[coords]
        blocks = []
        for i in range(m):
            mb_args = tuple(parts[i][f"input:{k}"] for k in range(len(args)))
            whole = placeholder_values(prog.inputs, model, mb_args, {k: parts[i][k] for k in kwargs})
            blocks.append([local_block(t, s.placements, shape, coords, s.spec.blocks) for t, s in zip(whole, prog.inputs)])
        meters = None
        if memory is not None:  # blocks of their own, not views of the whole tensors; the state once
            own = {k: t.clone() for k, (t, s) in enumerate(zip(blocks[0], prog.inputs)) if s.kind in ("param", "buffer")}
            blocks = [[own[k] if k in own else t.clone() for k, t in enumerate(b)] for b in blocks]
            meters = RankMeters(ranks, prog.inputs, blocks, owners, ct, optimizer_bytes)
        with torch.no_grad():
            statics = [C.wait(v) for v in ct.static(*[blocks[0][k] for k in ct.state_slots])]
            acc = [torch.zeros(s, dtype=d) for s, d in ct.frontier_shapes]
            if meters is not None:
                meters.state(statics, acc)
            stash, losses, moved = {}, [], []
            for i in range(m):
                carry: list = []
                at_micro(prog, i)
                for st in ct.stages:
                    ins = [statics[k] for k in st.f_statics] + [blocks[i][k] for k in st.f_given] + carry
                    with _watched(meters, st.index, carry, st.index - 1):
                        outs = [C.wait(o) for o in st.forward(*ins)]
                    carry, stash[(st.index, i)] = outs[:len(st.f_out)], outs[len(st.f_out):]
                    if meters is not None:
                        meters.saved(st.index, stash[(st.index, i)])
                    if st.index + 1 < n_stages:
                        handed(moved, carry, st.index, st.index + 1)
                losses.append(carry[0])
            deferred = []  # zero bubble: every weight part after all input parts, latest first
            for i in range(m):
                back: list = []
                at_micro(prog, i)
                for st in reversed(ct.stages):
                    tangent = [torch.full((), weights[i], dtype=losses[i].dtype)] if st.tangent else []
                    ins = list(stash.pop((st.index, i))) + [statics[k] for k in st.b_statics] + back + tangent
                    if split:
                        with _watched(meters, st.index, back, st.index + 1):
                            outs = [C.wait(o) for o in st.backward_input(*ins)]
                        deferred.append((st, i, ins + outs[len(st.g_out):]))
                        back = outs[:len(st.g_out)]
                        if st.index > 0:
                            handed(moved, back, st.index, st.index - 1)
                        continue
                    with _watched(meters, st.index, back, st.index + 1):
                        outs = [C.wait(o) for o in st.backward(*ins)]
                    back = outs[:len(st.g_out)]
                    if st.index > 0:
                        handed(moved, back, st.index, st.index - 1)
                    for fid, v in zip(st.frontier, outs[len(st.g_out):]):
                        acc[fid] += v
            for st, i, ins in reversed(deferred):
                at_micro(prog, i)
                with _watched(meters, st.index):
                    made = [C.wait(o) for o in st.backward_weight(*ins)]
                for fid, v in zip(st.frontier, made):
                    acc[fid] += v
            grads = [C.wait(g) for g in ct.reduce(*acc)]
        measured = meters.finish() if meters is not None else {}
        return sum(loss * w for loss, w in zip(losses, weights)), grads, moved, measured

    results, executed = run_threads(one, shape, names)
    if trace is not None:
        trace.update({c: list(executed.get(c, [])) + r[2] for c, r in results.items()})
    if predicted is not None:
        readers, statics = forward_readers(graph, stage_of), static_values(graph)
        for c in programs:
            every = _EveryStage(graph, stage_of, m, list(range(n_stages)), plan, readers, statics, cuts[c])
            predicted[c] = pipelined_predicted(every)
    if memory is not None:  # the pipeline rank's coordinate in its place on the whole mesh
        at = list(pl.mesh_names).index(axis)
        memory.update({c[:at] + (r,) + c[at:]: m for c, res in results.items() for r, m in res[3].items()})
    loss = results[(0,) * len(shape)][0]
    whole = gather_slots(first.grads, {c: r[1] for c, r in results.items()}, shape)
    grads = {s.key: g for s, g in zip(first.grads, whole)}
    for alias, canon in graph.aliases.items():
        if canon in grads:
            grads[alias] = grads[canon]
    return loss, grads


@dataclass
class _EveryStage:
    """What ``accounting.pipelined_predicted`` reads of a pipelined rank, for a device holding every stage."""

    graph: object
    stage_of: Callable[[str], int]
    m: int
    my_stages: list
    plan: object
    param_stages: dict
    static_refs: set
    cutting: object


def _watched(meters: Optional[RankMeters], index: int, handed=(), source: int = -1):
    """``meters.stage`` when measuring, else nothing."""
    return meters.stage(index, handed, source) if meters is not None else contextlib.nullcontext()


def at_micro(program, mb: int) -> None:
    """Random ops of what runs next draw micro-batch ``mb``'s block of the whole batch's draw."""
    if program.random is not None:
        program.random.micro = mb


__all__ = ["simulate_staged"]
