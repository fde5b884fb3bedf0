"""Compute slowed by the communication hidden under it (``Hardware.overlap_slowdown``): the
evaluator, the ILP (CP-SAT and the HiGHS rounds) and the planner price
``exposed + s * min(traffic, compute)`` per overlap group alike, and a choice the term makes worse
loses to one it does not touch."""

import dataclasses
import itertools

import pytest

import autopar
from autopar.cost_model.hardware import PRESETS, Hardware
from autopar.ir.placement import B, Split
from autopar.passes.search.problem import Group, PEdge, PNode, Problem, evaluate
from autopar.passes.search.solve import solve
from autopar.passes.search.solve_axis import solve_round

S0 = Split(0)


def _node(name, compute):
    k = len(compute)
    return PNode(name, [f"{name}:{s}" for s in range(k)], 1, 0, list(compute), [0.0] * k,
                 {"params": [0.0] * k, "grads": [0.0] * k, "optimizer": [0.0] * k, "activations": [0.0] * k})


def _gather_or_not(gather: float, slowdown: float) -> Problem:
    """A weight stored sharded and a matmul that either gathers it (``gather`` seconds of hidden
    traffic, 10 us of compute) or runs on the shard without gathering (12 us of compute)."""
    nodes = [_node("w", [0.0]), _node("mm", [10e-6, 12e-6])]
    edge = PEdge(0, 0, 1, 0, [0], [0, 1], [(S0,)], [(B,), (S0,)], [[gather, 0.0]], 1, "param", 0, None, 2)
    return Problem(nodes, [edge], [Group("g (forward)", 1), Group("g (backward)", 1)], float("inf"), slowdown)


def _brute(problem):
    return min((evaluate(problem, c).step_time, list(c))
               for c in itertools.product(*[range(len(n.strategies)) for n in problem.nodes]))


@pytest.mark.parametrize("gather", [8e-6, 14e-6])
def test_hidden_traffic_slows_the_compute_under_it_by_s(gather):
    for s in (0.0, 0.3):
        cost = evaluate(_gather_or_not(gather, s), [0, 0])
        exposed = max(0.0, gather - 10e-6)
        assert cost.exposed_param_comm == pytest.approx(exposed)
        assert cost.contention == pytest.approx(s * min(gather, 10e-6))
        assert cost.step_time == pytest.approx(10e-6 + exposed + s * min(gather, 10e-6))
        assert cost.comm_time == pytest.approx(exposed + cost.contention)  # compute_time stays the kernels'
        assert cost.compute_time == pytest.approx(10e-6)
        # the equivalent linear form the ILP uses: (1 - s) exposed + s traffic
        assert cost.step_time == pytest.approx(10e-6 + (1 - s) * exposed + s * gather)
    untouched = evaluate(_gather_or_not(gather, 0.3), [0, 1])  # no traffic: nothing slowed
    assert untouched.contention == 0.0 and untouched.step_time == pytest.approx(12e-6)


def test_the_ilp_prices_the_slowdown_like_the_evaluator_and_it_can_change_the_choice():
    # s = 0: gathering (10 us, all 8 us hidden) beats the shard (12 us); s = 0.3: 10 + 2.4 > 12
    for s, want in ((0.0, [0, 0]), (0.3, [0, 1])):
        problem = _gather_or_not(8e-6, s)
        best, choice = _brute(problem)
        assert choice == want
        sol = solve(problem)
        assert sol.choice == want and sol.objective == pytest.approx(best, abs=1e-11)
        found, stats = solve_round(problem, 30.0)  # the HiGHS formulation of the axis rounds
        assert found == want, stats
    # traffic above the compute: (1 - s) exposed + s traffic, exposed 4 us, priced alike by both
    problem = _gather_or_not(14e-6, 0.1)
    sol = solve(problem)
    assert sol.objective == pytest.approx(_brute(problem)[0], abs=1e-11)
    assert sol.choice == [0, 1]


def test_hardware_overlap_slowdown_round_trips_defaults_to_0_and_is_checked():
    h100 = PRESETS["h100"]
    assert 0.15 < h100.overlap_slowdown < 0.17 and PRESETS["a100"].overlap_slowdown == h100.overlap_slowdown
    assert PRESETS["cpu"].overlap_slowdown == 0.0
    assert Hardware.from_dict(h100.to_dict()) == h100
    old = {k: v for k, v in h100.to_dict().items() if k != "overlap_slowdown"}  # a profile or plan before it
    assert Hardware.from_dict(old).overlap_slowdown == 0.0
    with pytest.raises(ValueError, match="overlap_slowdown"):
        Hardware.from_dict({**h100.to_dict(), "overlap_slowdown": 1.0})


def test_a_plan_prices_the_slowdown_of_its_hidden_gathers_and_records_it():
    from autopar.models import make
    from autopar.planner.intra import run_passes
    from autopar.planner.options import PlanOptions
    from autopar.planner.report import build_plan

    model, inputs = make("gpt", size="tiny", batch=8, seq=32)
    planned = run_passes(model, autopar.Mesh({"dp": 4}, device="h100"), inputs,
                         options=PlanOptions(recipe="fsdp", progress=False))
    s = PRESETS["h100"].overlap_slowdown
    assert planned.problem.overlap_slowdown == s  # carried through fold, merge and the recipe's problem
    plan = build_plan(planned)
    assert plan.mesh["hardware"]["overlap_slowdown"] == s
    assert autopar.Plan.from_dict(plan.to_dict()) == plan
    slow = evaluate(planned.problem, planned.choice)
    free = evaluate(dataclasses.replace(planned.problem, overlap_slowdown=0.0), planned.choice)
    # FSDP's gathers and reductions hide under the layers' compute: that compute is slowed
    assert slow.contention > 0 and free.contention == 0.0 and slow.compute_time == free.compute_time
    assert slow.step_time == pytest.approx(free.step_time + slow.contention)
    assert plan.step_time == pytest.approx(planned.cost.step_time) and planned.cost.contention == pytest.approx(slow.contention)
