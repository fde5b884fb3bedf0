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
- memory per rank: the state (parameters, gradients, optimizer) of its stages, the gathered copy it
  keeps, each stage's saved activations per micro-batch times its micro-batches in flight, and two
  boundary buffers per stage (one received activation, one received gradient). The peak memory is
  the largest rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from autopar.cost_model.hardware import Link
from autopar.cost_model.schedules import Replay, StageTimes, price_schedule, stage_ranks


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
    memory: dict = field(default_factory=dict, compare=False)  # bytes by kind (params, grads, optimizer, activations)
    paths: tuple[str, ...] = ()
    optimizer: float = 0.0

    @property
    def backward(self) -> float:
        """A full backward: input and weight gradients."""
        return self.input_grad + self.weight_grad


def combine(parts: Sequence[Segment]) -> Segment:
    """The segments run one after the other as one stage: every figure summed."""
    mem: dict[str, float] = {}
    for p in parts:
        for k, v in p.memory.items():
            mem[k] = mem.get(k, 0.0) + v
    return Segment(*(sum(getattr(p, f) for p in parts) for f in ("forward", "input_grad", "weight_grad", "state",
                                                               "activations", "gathers", "reductions", "kept")),
                   memory=mem, paths=tuple(x for p in parts for x in p.paths), optimizer=sum(p.optimizer for p in parts))


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


def price_pipeline(stages: Sequence[Segment], schedule: str, pp: int, microbatches: int, virtual: int,
                   p2p: float, boundary_bytes: float, overlap_slowdown: float = 0.0) -> PipelinePrice:
    """Price ``stages`` (``pp * virtual`` virtual stages, in pipeline order) under ``schedule`` with
    ``microbatches``; ``p2p`` is one boundary transfer's seconds, ``boundary_bytes`` its size (the
    receive buffers). See the module docstring. Raises ``ValueError`` for a shape torch refuses."""
    times = StageTimes([s.forward for s in stages], [s.input_grad for s in stages],
                       [s.weight_grad for s in stages], p2p)
    rep = price_schedule(schedule, pp, microbatches, virtual, times)
    ranks = stage_ranks(schedule, pp, virtual)
    sync = 0.0
    memory, kinds = [], []
    for r in range(pp):
        mine = [s for s, rr in enumerate(ranks) if rr == r]
        fwd = sum(stages[s].forward for s in mine)
        bwd = sum(stages[s].backward for s in mine)
        gathers = sum(stages[s].gathers for s in mine)
        reductions = sum(stages[s].reductions for s in mine)
        optimizer = sum(stages[s].optimizer for s in mine)
        sync = max(sync, max(0.0, gathers - fwd) + max(0.0, reductions - bwd) + optimizer  # hidden traffic slows
                   + overlap_slowdown * (min(gathers, fwd) + min(reductions, bwd)))  # compute (search/problem.py)
        kind = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        for s in mine:
            st = stages[s]
            for k in ("params", "grads", "optimizer"):
                kind[k] += st.memory.get(k, 0.0)
            kind["params"] += st.kept
            kind["activations"] += rep.in_flight[s] * st.activations + 2 * boundary_bytes
        kinds.append(kind)
        memory.append(sum(kind.values()))
    return PipelinePrice(schedule, pp, microbatches, virtual, tuple(stages), rep, p2p, sync, rep.makespan + sync,
                         tuple(memory), tuple(kinds), max(memory))


__all__ = ["PipelinePrice", "Segment", "combine", "p2p_time", "price_pipeline"]
