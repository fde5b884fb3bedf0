"""Pipeline schedules priced by replay (``autopar.cost_model.schedules``): the replay against the
closed forms, the in-flight counts that price activation memory, torch's constraints refused up
front, and torch 2.13's wrongly listed 1F1B order on the last rank."""

from __future__ import annotations

import pytest

from autopar import _torch_compat as tc
from autopar.cost_model.schedules import (
    StageTimes,
    check_orders,
    closed_form_bubble,
    price_schedule,
    replay,
    schedule_orders,
    stage_ranks,
)


def _equal(n: int, f: float = 1.0, i: float = 1.0, w: float = 1.0, p2p: float = 0.0) -> StageTimes:
    return StageTimes([f] * n, [i] * n, [w] * n, p2p)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 5), (4, 4), (4, 9), (8, 32)])
def test_bubble_equals_closed_form(schedule, pp, m):
    r = price_schedule(schedule, pp, m, 1, _equal(pp, 1.0, 1.5, 0.5))
    assert r.bubble == pytest.approx(closed_form_bubble(pp, m), abs=1e-12)
    assert r.makespan == pytest.approx((m + pp - 1) * 3.0)
    assert r.busy == pytest.approx([m * 3.0] * pp)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 32)])
def test_interleaved_bubble_shrinks_by_virtual_stages(pp, m):
    """Megatron's interleaved closed form (p-1)/(v m + p-1), stage times 1/v of a 1-stage-per-rank stage."""
    v = 2
    r = price_schedule("Interleaved1F1B", pp, m, v, _equal(pp * v, 0.5, 0.5, 0.5))
    assert r.bubble == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)


def test_zero_bubble_beats_1f1b():
    one = price_schedule("1F1B", 8, 32, 1, _equal(8))
    zbv = price_schedule("ZBVZeroBubble", 8, 32, 2, _equal(16, 0.5, 0.5, 0.5))
    assert zbv.bubble < one.bubble / 4  # 0.035 vs 0.179 with F = I = W


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 9)])
def test_in_flight_counts(pp, m):
    one = price_schedule("1F1B", pp, m, 1, _equal(pp))
    assert one.in_flight == tuple(min(m, pp - s) for s in range(pp))  # 1F1B holds p - s on stage s
    gpipe = price_schedule("GPipe", pp, m, 1, _equal(pp))
    assert gpipe.in_flight == (m,) * pp  # GPipe holds every micro-batch


def test_transfers_lengthen_the_step():
    free = price_schedule("GPipe", 4, 8, 1, _equal(4))
    slow = price_schedule("GPipe", 4, 8, 1, _equal(4, p2p=0.25))
    # GPipe's critical path: the last forward and the last backward cross 3 boundaries each
    assert slow.makespan == pytest.approx(free.makespan + 2 * 3 * 0.25)
    # 1F1B's steady state waits on round trips too: at least as much longer
    one_free = price_schedule("1F1B", 4, 8, 1, _equal(4))
    one_slow = price_schedule("1F1B", 4, 8, 1, _equal(4, p2p=0.25))
    assert one_slow.makespan >= one_free.makespan + 2 * 3 * 0.25
    # V placement: ZBV's middle boundary stays on the last rank, no transfer there
    ranks = stage_ranks("ZBVZeroBubble", 2, 2)
    assert ranks == (0, 1, 1, 0)


def test_uneven_stages_bottleneck():
    """The slowest stage sets the steady state: m backward+forward pairs on it."""
    times = StageTimes([1, 2, 1, 1], [1, 2, 1, 1], [1, 2, 1, 1])
    r = price_schedule("1F1B", 4, 16, 1, times)
    assert r.makespan >= 16 * 6
    assert r.bubble > closed_form_bubble(4, 16)


def test_torch_constraints_refused():
    with pytest.raises(ValueError, match="at least as many micro-batches"):
        schedule_orders("1F1B", 4, 3)
    with pytest.raises(ValueError, match="multiple of its rounds"):
        schedule_orders("Interleaved1F1B", 4, 9, 2)
    with pytest.raises(ValueError, match="exactly 2 stage"):
        schedule_orders("ZBVZeroBubble", 4, 8, 3)
    with pytest.raises(ValueError, match="not one of"):
        schedule_orders("DualPipeV", 4, 8, 2)


def test_torch_listed_1f1b_order_is_wrong_on_the_last_rank():
    """torch 2.13's Schedule1F1B lists micro-batch 4 of 4 and never forwards 0 on its last rank
    (its runtime loop is right): autopar generates its own order, and refuses torch's."""
    listed = tc.schedule_order("1F1B", 2, 4, 1)
    assert (1, "F", 4) in listed[1] and (1, "F", 0) not in listed[1]
    from autopar.cost_model.schedules import Action
    orders = [[Action(*a) for a in row] for row in listed]
    with pytest.raises(ValueError, match="outside its 2 stages"):
        check_orders(orders, "1F1B", 2, 4, (0, 1))
    own = schedule_orders("1F1B", 2, 4)
    check_orders(own, "1F1B", 2, 4, (0, 1))


def test_deadlock_is_refused():
    from autopar.cost_model.schedules import Action
    bad = [[Action(0, "B", 0), Action(0, "F", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        replay(bad, (0, 1), _equal(2))
