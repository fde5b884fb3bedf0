"""Pipeline schedules priced by replaying their action orders.

A schedule is, per pipeline rank, an ordered list of compute actions ``Action(stage, kind, mb)``:
``F`` forward, ``B`` full backward, ``I`` input-gradient and ``W`` weight-gradient backward of
micro-batch ``mb`` on (virtual) stage ``stage``. ``schedule_orders`` builds them for the schedules
torch 2.13 runs:

- ``GPipe``: one stage per rank, every forward then every backward (any ``m >= 1``);
- ``1F1B``: one stage per rank, ``p - s`` forwards of warm-up on stage ``s``, then one backward and
  one forward alternately, then the remaining backwards. torch's ``Schedule1F1B`` requires
  ``m >= p``. Its *listed* order (``_get_pipeline_order``, used by torch's visualizer) is wrong on
  the last rank in 2.13 (for p=2, m=4 rank 1 lists ``1F1, 1B0, ..., 1F4, 1B3``: micro-batch 4 does
  not exist and 0 is never forwarded; ``tests/test_pipeline_schedules.py`` checks this) while its
  runtime loop is right, so this order is generated here, as that loop runs it;
- ``Interleaved1F1B``: ``v >= 2`` virtual stages per rank in loop placement (stage ``k*p + r`` on
  rank ``r``), ``m`` a multiple of ``max(1, m // p)``: torch's own order;
- ``ZBVZeroBubble``: exactly two stages per rank in V placement (stages ``r`` and ``2p-1-r`` on
  rank ``r``), backward split into ``I`` and ``W``: torch's own order.

``replay`` runs the orders as a list schedule: each rank takes its next action as soon as the rank
is free and the action's inputs exist (a forward needs the previous stage's forward of that
micro-batch, a backward the next stage's input gradient and its own forward, a weight gradient
its input gradient), adding the point-to-point time when neighbouring stages sit on different ranks.
It returns the makespan, the bubble (idle fraction of ``ranks x makespan``) and each stage's peak
number of micro-batches in flight (forward started, backward not finished: ``W`` counts as the
backward's end, which over-states ZBV's memory a little, since a micro-batch waiting only for ``W``
holds just the weight-gradient inputs). With equal stage times and free transfers GPipe's and
1F1B's bubble is ``(p-1)/(m+p-1)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autopar import _torch_compat as tc

#: The schedules autopar prices and runs, by torch's names (``get_schedule_class``).
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")


@dataclass(frozen=True)
class Action:
    """One compute action: ``kind`` (F, B, I or W) of micro-batch ``mb`` on virtual stage ``stage``."""

    stage: int
    kind: str
    mb: int


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one micro-batch per virtual stage: ``forward``, ``input_grad`` and ``weight_grad``
    (a full backward is their sum), and ``p2p``: one boundary transfer between two ranks (each
    direction; per boundary ``s -> s+1``, or one figure for all)."""

    forward: Sequence[float]
    input_grad: Sequence[float]
    weight_grad: Sequence[float]
    p2p: Sequence[float] | float = 0.0

    def transfer(self, boundary: int) -> float:
        return float(self.p2p) if isinstance(self.p2p, (int, float)) else float(self.p2p[boundary])


@dataclass(frozen=True)
class Replay:
    """A replayed schedule: ``makespan`` (seconds), ``bubble`` (idle fraction of every rank's
    makespan), ``in_flight`` (per virtual stage, the peak micro-batches whose forward ran and
    whose backward has not finished), ``busy`` (compute seconds per rank)."""

    makespan: float
    bubble: float
    in_flight: tuple[int, ...]
    busy: tuple[float, ...]


def virtual_stages(schedule: str) -> int | None:
    """Stages per rank a schedule requires (None: any count from 2, Interleaved1F1B's choice)."""
    return {"GPipe": 1, "1F1B": 1, "ZBVZeroBubble": 2}.get(schedule)


def check_schedule(schedule: str, pp: int, microbatches: int, virtual: int) -> None:
    """Raise ``ValueError`` (what torch would refuse, said up front) unless torch 2.13's ``schedule``
    runs ``microbatches`` on ``pp`` ranks with ``virtual`` stages per rank."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {list(SCHEDULES)}")
    if pp < 1 or microbatches < 1:
        raise ValueError(f"a pipeline needs at least one rank and one micro-batch, got pp={pp}, m={microbatches}")
    need = virtual_stages(schedule)
    if need is not None and virtual != need:
        raise ValueError(f"{schedule} runs exactly {need} stage(s) per rank, got {virtual}")
    if schedule == "Interleaved1F1B":
        if virtual < 2:
            raise ValueError("Interleaved1F1B needs at least 2 virtual stages per rank (with one it is 1F1B "
                             "with twice the warm-up); use 1F1B")
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(f"Interleaved1F1B needs the micro-batch count to be a multiple of its rounds "
                             f"max(1, m // pp) = {rounds}, got m={microbatches} on pp={pp}")
    if schedule == "1F1B" and microbatches < pp:
        raise ValueError(f"1F1B needs at least as many micro-batches as stages ({pp}), got {microbatches}")


def stage_ranks(schedule: str, pp: int, virtual: int) -> tuple[int, ...]:
    """The rank of each virtual stage: loop placement, or V placement for ZBVZeroBubble."""
    if schedule == "ZBVZeroBubble":
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(2 * pp))
    return tuple(s % pp for s in range(pp * virtual))


def schedule_orders(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Each rank's compute actions in the order it runs them (see the module docstring)."""
    check_schedule(schedule, pp, microbatches, virtual)
    m = microbatches
    if schedule == "GPipe":
        return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(pp)]
    if schedule == "1F1B":
        out = []
        for r in range(pp):
            warm = min(m, pp - r)
            row = [Action(r, "F", i) for i in range(warm)]
            for i in range(m - warm):
                row += [Action(r, "B", i), Action(r, "F", warm + i)]
            row += [Action(r, "B", i) for i in range(m - warm, m)]
            out.append(row)
        return out
    rows = tc.schedule_order(schedule, pp, m, virtual)
    orders = [[Action(*a) for a in row] for row in rows]
    check_orders(orders, schedule, pp * virtual, m, stage_ranks(schedule, pp, virtual))
    return orders


def check_orders(orders: list[list[Action]], schedule: str, n_stages: int, microbatches: int,
                 ranks: Sequence[int]) -> None:
    """Raise ``ValueError`` unless every stage runs each micro-batch's forward once and its backward
    once (B, or I then W) on its own rank."""
    seen: dict[tuple[int, str, int], int] = {}
    for r, row in enumerate(orders):
        for a in row:
            if not (0 <= a.stage < n_stages and 0 <= a.mb < microbatches) or ranks[a.stage] != r:
                raise ValueError(f"{schedule}'s order has {a} on rank {r}, outside its {n_stages} stages x "
                                 f"{microbatches} micro-batches or on the wrong rank")
            key = (a.stage, a.kind, a.mb)
            seen[key] = seen.get(key, 0) + 1
    for s in range(n_stages):
        for i in range(microbatches):
            split = (s, "I", i) in seen
            kinds = ("F", "I", "W") if split else ("F", "B")
            for k in kinds:
                if seen.get((s, k, i)) != 1:
                    raise ValueError(f"{schedule}'s order runs {k} of micro-batch {i} on stage {s} "
                                     f"{seen.get((s, k, i), 0)} times, not once")


def replay(orders: list[list[Action]], ranks: Sequence[int], times: StageTimes) -> Replay:
    """Replay per-rank ``orders`` (stage ``s`` on rank ``ranks[s]``) with ``times``; see the module
    docstring. Raises ``ValueError`` if the orders deadlock."""
    n_stages = len(ranks)
    last = n_stages - 1
    done: dict[tuple[int, str, int], float] = {}  # finish time per action; "G" = its input gradient is out
    free = [0.0] * len(orders)
    busy = [0.0] * len(orders)
    pos = [0] * len(orders)
    events: list[tuple[float, int, int]] = []  # (time, +1 at a forward's start / -1 at a backward's end, stage)

    def hop(a: int, b: int) -> float:
        return 0.0 if ranks[a] == ranks[b] else times.transfer(min(a, b))

    def ready(a: Action) -> float | None:
        deps: list[float] = []
        if a.kind == "F":
            if a.stage > 0:
                t = done.get((a.stage - 1, "F", a.mb))
                if t is None:
                    return None
                deps.append(t + hop(a.stage - 1, a.stage))
        elif a.kind in ("B", "I"):
            t = done.get((a.stage, "F", a.mb))
            if t is None:
                return None
            deps.append(t)
            if a.stage < last:
                g = done.get((a.stage + 1, "G", a.mb))
                if g is None:
                    return None
                deps.append(g + hop(a.stage + 1, a.stage))
        else:  # W
            t = done.get((a.stage, "I", a.mb))
            if t is None:
                return None
            deps.append(t)
        return max(deps, default=0.0)

    def duration(a: Action) -> float:
        s = a.stage
        return {"F": times.forward[s], "I": times.input_grad[s], "W": times.weight_grad[s],
                "B": times.input_grad[s] + times.weight_grad[s]}[a.kind]

    remaining = sum(len(r) for r in orders)
    while remaining:
        progressed = False
        for r, row in enumerate(orders):
            while pos[r] < len(row):
                a = row[pos[r]]
                t = ready(a)
                if t is None:
                    break
                start = max(t, free[r])
                end = start + float(duration(a))
                free[r] = end
                busy[r] += end - start
                done[(a.stage, a.kind, a.mb)] = end
                if a.kind in ("B", "I"):
                    done[(a.stage, "G", a.mb)] = end
                if a.kind == "F":
                    events.append((start, 1, a.stage))
                if a.kind == "B" or a.kind == "W":
                    events.append((end, -1, a.stage))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: row[pos[r]] for r, row in enumerate(orders) if pos[r] < len(row)}
            raise ValueError(f"the pipeline order deadlocks: the ranks wait at {stuck}")
    makespan = max(free, default=0.0)
    count = [0] * n_stages
    peak = [0] * n_stages
    for _, delta, s in sorted(events, key=lambda e: (e[0], e[1])):  # at equal times a backward ends first
        count[s] += delta
        peak[s] = max(peak[s], count[s])
    idle = 1.0 - sum(busy) / (len(orders) * makespan) if makespan > 0 else 0.0
    return Replay(makespan, max(0.0, idle), tuple(peak), tuple(busy))


def price_schedule(schedule: str, pp: int, microbatches: int, virtual: int, times: StageTimes) -> Replay:
    """``schedule``'s orders for this shape, replayed with ``times`` (one entry per virtual stage)."""
    orders = schedule_orders(schedule, pp, microbatches, virtual)
    ranks = stage_ranks(schedule, pp, virtual)
    if len(times.forward) != len(ranks):
        raise ValueError(f"{schedule} on pp={pp} has {len(ranks)} stages, the times give {len(times.forward)}")
    return replay(orders, ranks, times)


def closed_form_bubble(pp: int, microbatches: int) -> float:
    """GPipe's and 1F1B's bubble with equal stage times and free transfers: ``(p-1)/(m+p-1)``."""
    return (pp - 1) / (microbatches + pp - 1)


__all__ = ["Action", "Replay", "SCHEDULES", "StageTimes", "check_orders", "check_schedule", "closed_form_bubble",
           "price_schedule", "replay", "schedule_orders", "stage_ranks", "virtual_stages"]
