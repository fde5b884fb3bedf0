"""``passes.search.solve_axis.solve_by_axis``: the axis-by-axis search never returns a plan slower than
its start (by ``problem.evaluate``), stops once a full cycle over the axes gains nothing (a fixed
point: started again from its own result, it keeps it), is deterministic, and leaves the problem's
restrictions as it found them."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import autopar
import autopar.models
from autopar.planner.intra import run_passes
from autopar.planner.options import PlanOptions
from autopar.errors import InfeasibleError
from autopar.passes.search.problem import Problem, evaluate
from autopar.passes.search.local_search import greedy
from autopar.passes.search.solve_axis import leanest_choice, solve_by_axis, within_budget

STARTS = ("ddp", "fsdp", "megatron_tp", "greedy")


@functools.cache
def _planned():
    """The tiny MLP's merged problem on a (2, 2) mesh, and every recipe's choice on it."""
    torch.manual_seed(0)
    model, args = autopar.models.make("mlp", "tiny", batch=8)
    planned = run_passes(model, autopar.Mesh({"a": 2, "b": 2}, device="cpu"), args,
                         options=PlanOptions(search="propagate", progress=False))
    return planned


def _start(name: str) -> list[int]:
    planned = _planned()
    if name == "greedy":
        return greedy(planned.merged.problem)
    return [planned.recipe_choices[name][i] for i in planned.merged.keep]


@pytest.mark.parametrize("name", STARTS)
def test_never_worse_than_its_start(name):
    problem = _planned().merged.problem
    start = _start(name)
    before = evaluate(problem, start)
    assert before.peak_memory <= problem.memory_budget  # a start that fits: the result must too
    allowed = [n.allowed for n in problem.nodes]
    sol = solve_by_axis(problem, start, 2)
    after = evaluate(problem, sol.choice)
    assert after.step_time <= before.step_time, (name, after.step_time, before.step_time)
    assert after.peak_memory <= problem.memory_budget
    assert sol.objective == after.step_time  # the figure it reports is the evaluator's
    assert [n.allowed for n in problem.nodes] == allowed  # restrictions restored
    assert all(0 <= c < len(n.strategies) for c, n in zip(sol.choice, problem.nodes))


def test_improves_a_poor_start():
    """Data parallelism on both axes of a tiny MLP with a batch of 8 is far from the best plan:
    the search must find a faster one (else "never worse" above could hold by doing nothing)."""
    problem = _planned().merged.problem
    start = _start("ddp")
    sol = solve_by_axis(problem, start, 2)
    assert sol.objective < 0.9 * evaluate(problem, start).step_time
    assert sol.stats["rounds"] >= 1


def test_stops_at_a_fixed_point():
    problem = _planned().merged.problem
    first = solve_by_axis(problem, _start("ddp"), 2)
    # allowed many rounds, started from its own result: one cycle over the two axes, no gain, stop
    again = solve_by_axis(problem, first.choice, 2, rounds=5)
    assert again.choice == first.choice and again.objective == first.objective
    assert again.stats["rounds"] == 2, again.stats
    assert [r["axis"] for r in again.stats["per_round"]] == [1, 0]  # the last axis first
    assert "start" not in again.stats  # local search found nothing to polish either


def test_is_deterministic():
    problem = _planned().merged.problem
    a = solve_by_axis(problem, _start("fsdp"), 2)
    b = solve_by_axis(problem, _start("fsdp"), 2)
    assert a.choice == b.choice and a.objective == b.objective
    assert {k: v for k, v in a.stats.items() if k != "wall_time"} == \
        {k: v for k, v in b.stats.items() if k != "wall_time"}


def _budgeted(budget: float):
    """The tiny MLP's merged problem with its memory budget set to ``budget`` bytes."""
    p = _planned().merged.problem
    return Problem(p.nodes, p.edges, p.groups, budget, p.overlap_slowdown)


def test_a_start_over_the_budget_is_not_returned():
    """Data parallelism keeps every weight whole on every device: with the budget just above the
    leanest choice it is over, and no round restricted to one axis from it fits (both axes must
    shard). The search descends from the leanest choice instead, and its plan fits."""
    lean = _budgeted(math.inf)
    floor = evaluate(lean, leanest_choice(lean)).peak_memory
    problem = _budgeted(floor * 1.0001)
    start = _start("ddp")
    assert not within_budget(problem, start)
    sol = solve_by_axis(problem, start, 2)
    assert within_budget(problem, sol.choice), evaluate(problem, sol.choice).peak_memory
    assert sol.choice != start
    assert sol.objective == evaluate(problem, sol.choice).step_time


def test_no_plan_within_the_budget_is_infeasible():
    """Below the least memory any choice needs nothing fits: the search says so rather than return
    its start."""
    lean = _budgeted(math.inf)
    floor = sum(n.mult * min(n.mem_total(s) for s in n.alive()) for n in lean.nodes)  # a lower bound
    with pytest.raises(InfeasibleError, match="no plan fits the memory budget"):
        solve_by_axis(_budgeted(floor * 0.99), _start("fsdp"), 2)
