"""The recomputation ladder's bounds (``passes/search/ladder.py``): ``time_floor`` is below every
choice's step time, and skipping the levels that cannot beat the fastest fitting plan leaves the plan
byte-identical to solving every level."""

from __future__ import annotations

import random

import pytest

import autopar
from autopar import models
from autopar.ir.capture import capture
from autopar.passes.search import ladder
from autopar.passes.search.problem import evaluate
from autopar.planner.intra import run_passes
from autopar.planner.options import PlanOptions


def _budgeted(fraction: float):
    """A tiny GPT on (2, 2) whose budget is ``fraction`` of its plan's peak without one."""
    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=8)
    graph = capture(model, inputs)
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="cpu")
    free = autopar.plan(model, mesh, inputs, progress=False, graph=graph, deterministic_time=2.0)
    return model, inputs, graph, mesh, int(free.peak_memory * fraction)


def test_the_time_floor_is_below_every_choice():
    model, inputs, graph, mesh, budget = _budgeted(0.8)
    planned = run_passes(model, mesh, inputs, options=PlanOptions(graph=graph, memory_budget=budget,
                                                                  deterministic_time=2.0, progress=False))
    assert planned.recompute is not None and planned.recompute.any  # the ladder ran
    rng = random.Random(0)
    for problem in (planned.unscaled, planned.problem):
        floor = ladder.time_floor(problem)
        choices = [planned.choice] + [[rng.randrange(len(n.strategies)) for n in problem.nodes] for _ in range(50)]
        assert floor > 0
        assert all(floor <= evaluate(problem, c).step_time for c in choices)


@pytest.mark.parametrize("fraction", [0.8, 0.7])
def test_skipping_levels_that_cannot_win_keeps_the_plan(monkeypatch, fraction):
    model, inputs, graph, mesh, budget = _budgeted(fraction)
    solves = []
    solve_walked = ladder.solve_walked
    monkeypatch.setattr(ladder, "solve_walked", lambda *a, **k: solves.append(1) or solve_walked(*a, **k))

    def planned():
        solves.clear()
        plan = autopar.plan(model, mesh, inputs, memory_budget=budget, progress=False, graph=graph,
                            deterministic_time=2.0)
        return plan.to_json(), len(solves)

    skipping, solved = planned()
    monkeypatch.setattr(ladder, "time_floor", lambda problem: 0.0)  # no bound: every level solved, modes in order
    every, solved_all = planned()
    assert '"checkpointing": {}' not in skipping  # the plan recomputes: the ladder chose it
    assert skipping == every
    assert solved <= solved_all
