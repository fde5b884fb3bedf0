"""torch.distributed.pipelining's action orders (torch 2.13), read without a process group.

``schedule_order`` builds one of torch's multi-stage schedules on mocked stages (torch's own
``_schedule_visualizer.get_schedule_ops``) and returns each rank's compute actions as plain tuples
``(stage, kind, microbatch)`` with ``kind`` in ``"F"``, ``"B"``, ``"I"``, ``"W"``, so that the
pipeline cost model replays exactly the order torch will run.

``forward_only`` runs a schedule of torch's action runtime (``ScheduleZBVZeroBubble``) forward-only:
torch 2.13's ``eval`` of it runs the whole order with the backward switched off, and the V
placement's same-rank hand-over of a backward output (stage ``2p-1`` to ``2p-2`` on the last rank)
then fails, since no backward ran. During the block the schedule's lowered order keeps its forward
computations and their sends and receives only.

On a torch upgrade: check that ``get_schedule_ops`` still takes ``(name, pp_degree, num_microbatches,
num_stages_per_rank)`` and returns per-rank lists of ``_Action`` (``None`` for idle slots) whose
``computation_type`` values are ``_ComputationType`` members named FORWARD, FULL_BACKWARD,
BACKWARD_INPUT, BACKWARD_WEIGHT; that ``_PipelineScheduleRuntime`` still runs
``pipeline_order_with_comms`` (rank -> its actions, communication included) in ``_step_microbatches``
and names the forward's actions FORWARD, SEND_F, RECV_F (UNSHARD/RESHARD: FSDP's, kept).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch.distributed.pipelining import _schedule_visualizer
from torch.distributed.pipelining.schedules import _ComputationType

_KINDS = {
    _ComputationType.FORWARD: "F",
    _ComputationType.FULL_BACKWARD: "B",
    _ComputationType.BACKWARD_INPUT: "I",
    _ComputationType.BACKWARD_WEIGHT: "W",
}

_ONCE_PER_STEP = (_ComputationType.REDUCE_GRAD, _ComputationType.UNSHARD, _ComputationType.RESHARD)


def schedule_order(name: str, pp: int, microbatches: int, stages_per_rank: int) -> list[list[tuple[int, str, int]]]:
    """Each rank's compute actions of torch's schedule ``name`` (as ``get_schedule_class`` names it,
    e.g. ``"Interleaved1F1B"``, ``"ZBVZeroBubble"``), in the order that rank runs them."""
    ranks = _schedule_visualizer.get_schedule_ops(name, pp, microbatches, stages_per_rank)
    out = []
    for actions in ranks:
        row = []
        for a in actions:
            if a is None:
                continue
            kind = _KINDS.get(a.computation_type)
            if a.computation_type in _ONCE_PER_STEP:
                continue  # gradient reductions and parameter gathers: priced once per step, not here
            if kind is None:
                raise ValueError(f"torch's {name} order holds a {a.computation_type} action, which autopar "
                                 "does not price")
            row.append((int(a.stage_index), kind, int(a.microbatch_index)))
        out.append(row)
    return out


#: The actions of a forward-only step: the forwards, their activations' transfers, FSDP's (un)shards.
_FORWARD_ONLY = (_ComputationType.FORWARD, _ComputationType.SEND_F, _ComputationType.RECV_F,
                 _ComputationType.UNSHARD, _ComputationType.RESHARD)


def runs_action_order(schedule) -> bool:
    """Whether ``schedule`` runs a lowered action order (torch's action runtime: ZBV, DualPipeV, ...)."""
    return isinstance(getattr(schedule, "pipeline_order_with_comms", None), dict)


@contextlib.contextmanager
def forward_only(schedule) -> Iterator[None]:
    """Within the block, ``schedule`` (one that ``runs_action_order``) runs only its forward actions
    and their sends and receives, in its own order, so its ``eval`` is a forward-only step. Dropping
    actions cannot deadlock the rest: a forward waits only on the earlier forward it receives from,
    which runs no later than in the whole order, and sends are asynchronous."""
    whole = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {
        rank: [a for a in actions if a is not None and a.computation_type in _FORWARD_ONLY]
        for rank, actions in whole.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = whole
