"""The recomputation ladder's step-time cutoff (``passes/search/ladder.py``, ``solve.beaten``): a
level is skipped only where CP-SAT proves no plan within its budget is as fast as a plan already
found, the plan stays byte-identical to solving every level, and a caller's incumbent
(``search_prepared``'s, the factorization search's fastest fitting shape) keeps ties and says
``Beaten`` where nothing could beat it."""

from __future__ import annotations

import functools
import math

import pytest

import autopar
from autopar import models
from autopar.ir.capture import capture
from autopar.passes.search import ladder, solve as solver
from autopar.passes.search.problem import evaluate
from autopar.planner.intra import Beaten, prepare, search_prepared
from autopar.planner.options import PlanOptions


@functools.cache
def _free():
    """A tiny GPT on a 1-D mesh (the full ILP solves it, so the cutoff applies), its graph and its
    plan's peak without a budget."""
    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=8)
    graph = capture(model, inputs)
    mesh = autopar.Mesh({"tp": 4}, device="cpu")
    free = autopar.plan(model, mesh, inputs, progress=False, graph=graph, deterministic_time=2.0)
    return model, inputs, graph, mesh, free.peak_memory


def _options(fraction: float) -> tuple:
    model, inputs, graph, mesh, peak = _free()
    return model, inputs, mesh, PlanOptions(graph=graph, memory_budget=int(peak * fraction), deterministic_time=2.0,
                                            progress=False)


@functools.cache
def _alone(fraction: float):
    """The search's plan at ``fraction`` of the free peak, with no incumbent (made once: two tests read it)."""
    model, inputs, mesh, opts = _options(fraction)
    return search_prepared(prepare(model, mesh, inputs, options=opts))


def test_beaten_only_below_the_optimum():
    planned = _alone(0.6)
    assert planned.recompute is not None and planned.recompute.any  # a recomputing level's problem
    problem = planned.merged.problem
    sol = solver.solve(problem, None, 2.0)
    assert sol.status == "OPTIMAL"
    best = evaluate(problem, sol.choice).step_time
    assert solver.beaten(problem, best * 0.97, 2.0)
    assert not solver.beaten(problem, best, 2.0)  # (a plan at the cap is not ruled out)
    assert not solver.beaten(problem, best * 1.03, 2.0)


@pytest.mark.parametrize("fraction", [0.75])
def test_the_cutoff_keeps_the_plan(monkeypatch, fraction):
    model, inputs, mesh, opts = _options(fraction)
    said = []
    beaten = solver.beaten
    monkeypatch.setattr(solver, "beaten", lambda *a: said.append(beaten(*a)) or said[-1])
    cut = autopar.plan(model, mesh, inputs, **_kwargs(opts)).to_json()
    assert any(said)  # levels were skipped
    monkeypatch.setattr(solver, "beaten", lambda *a: False)  # every level the ladder reaches solved
    assert autopar.plan(model, mesh, inputs, **_kwargs(opts)).to_json() == cut


def _kwargs(opts: PlanOptions) -> dict:
    return {"graph": opts.graph, "memory_budget": opts.memory_budget, "deterministic_time": opts.deterministic_time,
            "progress": False}


def test_a_callers_incumbent_keeps_ties_and_says_beaten():
    model, inputs, mesh, opts = _options(0.6)
    alone = _alone(0.6)
    assert alone.recompute is not None and alone.recompute.any
    tied = search_prepared(prepare(model, mesh, inputs, options=opts), alone.cost.step_time)
    assert tied.choice == alone.choice and tied.recompute == alone.recompute
    assert math.isclose(tied.cost.step_time, alone.cost.step_time)
    with pytest.raises(Beaten, match="as fast as"):
        search_prepared(prepare(model, mesh, inputs, options=opts), ladder.time_floor(alone.unscaled) * 0.5)
