"""The recomputation ladder's bounds (``passes/search/ladder.py``): ``time_floor`` is below every
choice's step time, and skipping the levels that cannot beat the fastest fitting plan leaves the plan
byte-identical to solving every level."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import pytest

import autopar
from autopar import api, models
from autopar.ir.capture import capture
from autopar.errors import InfeasibleError
from autopar.passes.search import ladder
from autopar.passes.search.problem import evaluate
from autopar.passes.search.solve import solve
from autopar.passes.search.solve_axis import leanest_choice, solve_by_axis


@functools.cache
def _free():
    """A tiny GPT on (2, 2), its graph and its plan's peak without a budget (made once)."""
    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=6)
    graph = capture(model, inputs)
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="cpu")
    free = autopar.plan(model, mesh, inputs, progress=False, graph=graph, deterministic_time=2.0)
    return model, inputs, graph, mesh, free.peak_memory


def _budgeted(fraction: float):
    """The tiny GPT of ``_free`` with a budget of ``fraction`` of its plan's peak without one."""
    model, inputs, graph, mesh, peak = _free()
    return model, inputs, graph, mesh, int(peak * fraction)


def _plan(fraction: float) -> str:
    """The plan's JSON at ``fraction`` of the free peak, or what no plan fits says."""
    model, inputs, graph, mesh, budget = _budgeted(fraction)
    try:
        return autopar.plan(model, mesh, inputs, memory_budget=budget, progress=False, graph=graph,
                            deterministic_time=2.0).to_json()
    except InfeasibleError as e:
        return str(e)


@functools.cache
def _bounded(fraction: float):
    """The plan with the ladder's bounds as they are (made once: every test reads it), how many
    walked solves ran, how many solves ``surely_over`` skipped, and the ``Planned`` behind the plan
    (None where none fits); the wrappers only count and keep."""
    walked, over, passes = ladder.solve_walked, ladder.surely_over, api.run_passes
    counts = {"solves": 0, "skipped": 0}
    kept: list = []

    def counting_walked(*a, **k):
        counts["solves"] += 1
        return walked(*a, **k)

    def counting_over(p):
        said = over(p)
        counts["skipped"] += said
        return said

    def keeping(*a, **k):
        kept.append(passes(*a, **k))
        return kept[-1]

    ladder.solve_walked, ladder.surely_over, api.run_passes = counting_walked, counting_over, keeping
    try:
        plan = _plan(fraction)
    finally:
        ladder.solve_walked, ladder.surely_over, api.run_passes = walked, over, passes
    return plan, counts["solves"], counts["skipped"], kept[-1] if kept else None


def test_the_time_floor_is_below_every_choice():
    planned = _bounded(0.7)[3]
    assert planned.recompute is not None and planned.recompute.any  # the ladder ran
    rng = random.Random(0)
    for problem in (planned.unscaled, planned.problem):
        floor = ladder.time_floor(problem)
        choices = [planned.choice] + [[rng.randrange(len(n.strategies)) for n in problem.nodes] for _ in range(50)]
        assert floor > 0
        assert all(floor <= evaluate(problem, c).step_time for c in choices)


def _solved(problem, mesh) -> bool:
    """Whether the by-axis descent or the full ILP finds a plan within ``problem``'s memory row (the
    descent first: where it finds one, the answer is known without the slower ILP)."""
    for solver in (lambda: solve_by_axis(problem, leanest_choice(problem), 2), lambda: solve(problem, None, 2.0)):
        try:
            solver()
            return True
        except InfeasibleError:
            pass
    return False


@pytest.mark.parametrize("transients", [True])
def test_surely_over_only_where_no_solver_finds_a_plan(transients):
    mesh = _free()[3]
    planned = _bounded(0.7)[3]
    problem = planned.merged.problem
    bound = ladder.leanest(problem) + (max(min(n.transient[s] for s in n.alive()) for n in problem.nodes
                                           if n.transient) if transients else 0.0)
    said, found = [], []
    for f in (0.9, 0.99, 0.999999, 1.0, 1.01, 1.05, 1.1, 1.3, 2.0):  # (just below: within the solvers' slack)
        at = replace(problem, memory_budget=int(bound * f), transients=transients)
        over = ladder.surely_over(at)
        said.append(over)
        found.append(_solved(at, mesh))
        assert not (over and found[-1]), f"the bound ruled out a plan a solver finds at {f} x the least memory"
    assert said[:2] == [True, True] and not any(said[2:])
    assert any(found)  # the budgets reach plans: a bound that ruled them out would fail above


def test_skipping_what_cannot_win_or_fit_keeps_the_plan(monkeypatch):
    """The ladder's bounds (levels whose ``time_floor`` cannot beat the fastest fitting plan;
    solves whose least memory is over their budget, ``surely_over``) leave the plan (or what no
    plan fits says) byte-identical to solving every level, modes in order, with every solve run."""
    fractions = (0.7, 0.6)
    bounded = [_bounded(f) for f in fractions]
    solves = []
    solve_walked = ladder.solve_walked
    monkeypatch.setattr(ladder, "solve_walked", lambda *a, **k: solves.append(1) or solve_walked(*a, **k))
    monkeypatch.setattr(ladder, "time_floor", lambda problem: 0.0)  # no time bound: every level solved
    monkeypatch.setattr(ladder, "surely_over", lambda p: False)  # no memory bound: every solve runs
    every = []
    for f in fractions:
        solves.clear()
        every.append((_plan(f), len(solves)))
    assert '"checkpointing": {}' not in bounded[0][0]  # the plan recomputes: the ladder chose it
    assert [b[0] for b in bounded] == [p for p, _ in every]
    assert bounded[0][1] <= every[0][1]
    assert sum(b[2] for b in bounded) > 0  # the memory bound skipped solves
