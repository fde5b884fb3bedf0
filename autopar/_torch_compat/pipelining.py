"""torch.distributed.pipelining's action orders (torch 2.13), read without a process group.

``schedule_order`` builds one of torch's multi-stage schedules on mocked stages (torch's own
``_schedule_visualizer.get_schedule_ops``) and returns each rank's compute actions as plain tuples
``(stage, kind, microbatch)`` with ``kind`` in ``"F"``, ``"B"``, ``"I"``, ``"W"``, so that the
pipeline cost model replays exactly the order torch will run.

On a torch upgrade: check that ``get_schedule_ops`` still takes ``(name, pp_degree, num_microbatches,
num_stages_per_rank)`` and returns per-rank lists of ``_Action`` (``None`` for idle slots) whose
``computation_type`` values are ``_ComputationType`` members named FORWARD, FULL_BACKWARD,
BACKWARD_INPUT, BACKWARD_WEIGHT.
"""

from __future__ import annotations

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
