"""A pipelined step priced: stage costs from per-segment costs, the schedule replayed, memory per rank.

The planner (``passes/search/pipeline_split.py``) cuts the model into *segments*: what runs before
the repeated layers (embedding), each layer instance, and what runs after them (final norm, head,
loss), each priced once per micro-batch by the intra-op plan of the other mesh axes. A virtual stage
is a contiguous run of segments (the first stage also holds the segment before the layers, the last
the one after); its costs are the sums of its segments'. ``price_pipeline`` then

- replays the schedule's action order (``cost_model/schedules.py``) with each stage's forward,
  input-gradient and weight-gradient seconds per micro-batch and the point-to-point time of one
  boundary activation on the pipeline axis's link: the makespan, the bubble and each stage's peak
  number of micro-batches in flight;
- adds, per pipeline rank, the parameter gathers and gradient reductions, once per step (the
  gathered parameters are kept for the whole step, ZeRO-2 style, as torchtitan's graph pipeline
  and FSDP2 under pipelining do): the gathers hide under the rank's first forward, the reductions
  under its last backward, and what does not hide is exposed; the step time is the makespan plus
  the largest rank's exposed synchronisation plus its optimizer step (once per step, under nothing,
  as the unpipelined plans price it);
- memory per rank: the state (parameters, gradients, optimizer) of its stages, their gradients as
  the unreduced accumulators every micro-batch adds into (reduced once per step), the gathered copy
  it keeps, each stage's saved activations per micro-batch times its micro-batches in flight, two
  boundary buffers per stage (one received activation, one received gradient), and what the one
  micro-batch it computes at a time holds between ops. The peak memory is the largest rank's.
- recomputation per stage: given a memory budget, a rank over it recomputes layer instances of its
  stages (``choose_recompute``): under 1F1B the first stages hold more micro-batches in flight, so
  they recompute more (an instance recomputed there saves ``in_flight`` times its bytes); each
  re-run is added to its stage's backward and the schedule replayed again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from autopar.cost_model.hardware import Link
from autopar.cost_model.schedules import Replay, StageTimes, price_schedule, stage_ranks


#: ``Segment.memory``'s key for the gradients held once the step's reductions are done (the reduced
#: gradients in place of the accumulators its ``grads`` count: ``pipeline_split.segments``)
AFTER_STEP = "grads_reduced"


@dataclass(frozen=True)
class Segment:
    """One piece of the model priced per micro-batch (seconds, bytes per device): ``forward``,
    ``input_grad`` (the backward ops whose results flow to the previous piece) and ``weight_grad``
    (the backward ops that only feed parameter gradients); ``state`` (parameters, gradients and
    optimizer state), ``activations`` (saved for the backward, per micro-batch); ``gathers`` and
    ``reductions`` (seconds of its parameter gathers and gradient reductions, once per step) and
    ``kept`` (bytes of the gathered parameters kept for the step); ``optimizer`` (seconds of the
    optimizer step on its parameters, once per step, under nothing); ``paths``: its module paths."""

    forward: float = 0.0
    input_grad: float = 0.0
    weight_grad: float = 0.0
    state: float = 0.0
    activations: float = 0.0
    gathers: float = 0.0
    reductions: float = 0.0
    kept: float = 0.0
    #: bytes by kind (params, grads, optimizer, activations; ``AFTER_STEP``)
    memory: dict = field(default_factory=dict, compare=False)
    paths: tuple[str, ...] = ()
    optimizer: float = 0.0
    #: per layer instance it holds that may recompute: ``(path, {mode: Recompute})``
    recompute: tuple = field(default=(), compare=False)
    #: how fast (forward, input_grad, weight_grad) at least grow with a micro-batch ``f >= 1`` times
    #: as large: seconds per unit of ``f`` (``compute.row_growth``; ``pipeline_split.scaled`` reads it)
    growth: tuple = field(default=(0.0, 0.0, 0.0), compare=False)
    #: bytes the largest of its ops holds beside the persistent memory while it runs, per micro-batch
    #: (``PNode.transient``: its unsaved outputs and reads); a stage's is its segments' largest
    transient: float = 0.0

    @property
    def backward(self) -> float:
        """A full backward: input and weight gradients."""
        return self.input_grad + self.weight_grad


@dataclass(frozen=True)
class Recompute:
    """Recomputing one layer instance in one mode, per micro-batch: ``saving`` (bytes of saved
    activations it no longer holds: what it saves less what a recomputed instance keeps),
    ``seconds`` (the re-run forward, in its backward) and ``transient`` (bytes of re-run values
    alive at once in its backward: held once per rank, not per micro-batch in flight)."""

    saving: float
    seconds: float
    transient: float


def combine(parts: Sequence[Segment]) -> Segment:
    """The segments run one after the other as one stage: every figure summed."""
    mem: dict[str, float] = {}
    for p in parts:
        for k, v in p.memory.items():
            mem[k] = mem.get(k, 0.0) + v
    return Segment(*(sum(getattr(p, f) for p in parts) for f in ("forward", "input_grad", "weight_grad", "state",
                                                               "activations", "gathers", "reductions", "kept")),
                   memory=mem, paths=tuple(x for p in parts for x in p.paths),
                   optimizer=sum(p.optimizer for p in parts), recompute=tuple(x for p in parts for x in p.recompute),
                   transient=max((p.transient for p in parts), default=0.0))


def p2p_time(nbytes: float, link: Link) -> float:
    """Seconds of one point-to-point transfer of ``nbytes`` on ``link`` (0 for nothing)."""
    return 0.0 if nbytes <= 0 else link.latency + nbytes / link.bandwidth


@dataclass(frozen=True)
class PipelinePrice:
    """One priced candidate: the schedule's shape, the replay, the exposed per-step synchronisation
    (seconds, the largest rank's), ``step_time`` (makespan + sync), memory per pipeline rank (bytes,
    by kind and in all) and ``peak_memory`` (the largest rank's)."""

    schedule: str
    pp: int
    microbatches: int
    virtual: int
    stages: tuple[Segment, ...]
    replay: Replay
    p2p: float
    sync: float
    step_time: float
    rank_memory: tuple[float, ...]
    rank_memory_kinds: tuple[dict, ...]
    peak_memory: float
    #: per virtual stage, the layer instances it recomputes: ``(mode, paths)`` (``("none", ())``: none)
    recomputed: tuple = ()


def price_pipeline(stages: Sequence[Segment], schedule: str, pp: int, microbatches: int, virtual: int,
                   p2p: float, boundary_bytes: float, budget: Optional[float] = None,
                   overlap_slowdown: float = 0.0, temporaries: float = 0.0) -> PipelinePrice:
    """Price ``stages`` (``pp * virtual`` virtual stages, in pipeline order) under ``schedule`` with
    ``microbatches``; ``p2p`` is one boundary transfer's seconds, ``boundary_bytes`` its size (the
    receive buffers). With a ``budget`` (bytes per device), a rank over it recomputes layer
    instances of its stages (``choose_recompute``) and the schedule is replayed again with their
    re-runs in the backward. See the module docstring. Raises ``ValueError`` for a shape torch refuses."""
    ranks = stage_ranks(schedule, pp, virtual)
    rep = _replay(stages, schedule, pp, microbatches, virtual, p2p, ())
    chosen: tuple = tuple(("none", ()) for _ in stages)
    if budget is not None:
        over = _memory(stages, rep.in_flight, ranks, pp, boundary_bytes, chosen, temporaries)
        if max(sum(k.values()) for k in over) > budget:
            chosen = choose_recompute(stages, rep.in_flight, ranks, pp, boundary_bytes, budget, temporaries)
            if any(c[1] for c in chosen):
                rep = _replay(stages, schedule, pp, microbatches, virtual, p2p, chosen)
    kinds = _memory(stages, rep.in_flight, ranks, pp, boundary_bytes, chosen, temporaries)
    sync = 0.0
    for r in range(pp):
        mine = [s for s, rr in enumerate(ranks) if rr == r]
        fwd = sum(stages[s].forward for s in mine)
        bwd = sum(stages[s].backward for s in mine)
        gathers = sum(stages[s].gathers for s in mine)
        reductions = sum(stages[s].reductions for s in mine)
        optimizer = sum(stages[s].optimizer for s in mine)
        sync = max(sync, max(0.0, gathers - fwd) + max(0.0, reductions - bwd) + optimizer  # hidden traffic slows
                   + overlap_slowdown * (min(gathers, fwd) + min(reductions, bwd)))  # compute (search/problem.py)
    memory = [sum(k.values()) for k in kinds]
    return PipelinePrice(schedule, pp, microbatches, virtual, tuple(stages), rep, p2p, sync, rep.makespan + sync,
                         tuple(memory), tuple(kinds), max(memory), chosen)


def _recompute_of(stage: Segment, choice: tuple) -> tuple[float, float, float]:
    """``(saving per micro-batch, seconds per micro-batch, transient bytes)`` of a stage's choice."""
    mode, paths = choice
    if not paths:
        return 0.0, 0.0, 0.0
    opts = {path: o for path, o in stage.recompute}
    picked = [opts[p][mode] for p in paths]
    return (sum(o.saving for o in picked), sum(o.seconds for o in picked), max(o.transient for o in picked))


def _replay(stages: Sequence[Segment], schedule: str, pp: int, microbatches: int, virtual: int, p2p: float,
            chosen: tuple) -> Replay:
    """The schedule replayed, each stage's recomputation (``chosen``; () for none) in its input-gradient time."""
    extra = [_recompute_of(st, c)[1] for st, c in zip(stages, chosen)] if chosen else [0.0] * len(stages)
    times = StageTimes([s.forward for s in stages], [s.input_grad + e for s, e in zip(stages, extra)],
                       [s.weight_grad for s in stages], p2p)
    return price_schedule(schedule, pp, microbatches, virtual, times)


def _memory(stages: Sequence[Segment], in_flight: Sequence[int], ranks: Sequence[int], pp: int, boundary_bytes: float,
            chosen: tuple, temporaries: float = 0.0) -> list[dict]:
    """Bytes per rank by kind: its stages' state (their gradients with the unreduced accumulators the
    step's micro-batches add into), the kept gathered copy, saved activations times the micro-batches
    in flight (less what recomputation saves, plus its transient re-run values once), two boundary
    buffers per stage, and the temporaries of the one micro-batch it computes at a time: the larger of
    ``temporaries`` (the most the layer plan's walk holds between ops at any moment besides saved
    values, state and gradients: ``pipeline_split.between_ops``; every rank is charged it, an upper
    bound: the loss's buffers are the last stage's alone) and its stages' largest op (``Segment.transient``). Or,
    when more, what it holds at the step's end: its state with the reduced gradients (``AFTER_STEP``)."""
    out = []
    for r in range(pp):
        kind = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0, "temporaries": temporaries}
        after = 0.0
        transient = 0.0
        for s, rr in enumerate(ranks):
            if rr != r:
                continue
            st = stages[s]
            kind["temporaries"] = max(kind["temporaries"], st.transient)
            for k in ("params", "grads", "optimizer"):
                kind[k] += st.memory.get(k, 0.0)
            kind["params"] += st.kept
            after += st.memory.get(AFTER_STEP, st.memory.get("grads", 0.0))
            saving, _, trans = _recompute_of(st, chosen[s])
            transient = max(transient, trans)
            kind["activations"] += in_flight[s] * (st.activations - saving) + 2 * boundary_bytes
        kind["activations"] += transient
        if after > kind["grads"] + kind["activations"] + kind["temporaries"]:
            kind = dict(kind, grads=after, activations=0.0, temporaries=0.0)
        out.append(kind)
    return out


def choose_recompute(stages: Sequence[Segment], in_flight: Sequence[int], ranks: Sequence[int], pp: int,
                     boundary_bytes: float, budget: float, temporaries: float = 0.0) -> tuple:
    """Per virtual stage, which of its layer instances recompute, so that every rank fits ``budget``
    at the least added time: per rank, in one mode (the cheaper of those that fit), its stages'
    instances in the order of seconds per byte saved (a stage with more micro-batches in flight saves
    that many times more per instance), the first instances of each stage first among equals
    (Megatron's block order), until the rank fits. A rank that cannot fit recomputes everything in
    the mode that saves most (the price then says it does not fit). ``temporaries``: as ``_memory``'s."""
    base = _memory(stages, in_flight, ranks, pp, boundary_bytes, tuple(("none", ()) for _ in stages), temporaries)
    chosen: list = [("none", ()) for _ in stages]
    for r in range(pp):
        excess = sum(base[r].values()) - budget
        if excess <= 0:
            continue
        mine = [s for s, rr in enumerate(ranks) if rr == r]
        modes = sorted({m for s in mine for _, o in stages[s].recompute for m in o})
        best = None  # (fits, seconds added, mode, {stage: paths})
        for mode in modes:
            items = []
            for s in mine:
                for pos, (path, opts) in enumerate(stages[s].recompute):
                    o = opts.get(mode)
                    if o is None or o.saving <= 0:
                        continue
                    gain = in_flight[s] * o.saving
                    items.append((o.seconds / gain, pos, s, path, gain, o))
            items.sort(key=lambda t: (t[0], t[1], t[2]))
            saved, seconds, transient, picked = 0.0, 0.0, 0.0, {}
            fits = False
            for _, _, s, path, gain, o in items:
                saved += gain
                seconds += o.seconds
                transient = max(transient, o.transient)
                picked.setdefault(s, []).append(path)
                if saved - transient >= excess:
                    fits = True
                    break
            key = (not fits, seconds if fits else -(saved - transient), mode)
            if picked and (best is None or key < best[0]):
                best = (key, mode, picked)
        if best is not None:
            _, mode, picked = best
            for s, paths in picked.items():
                order = [p for p, _ in stages[s].recompute]
                chosen[s] = (mode, tuple(sorted(paths, key=order.index)))
    return tuple(chosen)


__all__ = ["AFTER_STEP", "PipelinePrice", "Recompute", "Segment", "choose_recompute", "combine", "p2p_time",
           "price_pipeline"]
