"""The memory-fitting search sees temporaries (``PNode.transient``, ``passes.search.peak.solve_fitting``):
a model whose peak is one op's unsaved output (an outer product reduced at once), which alone breaks
the budget when replicated, gets a plan of the search's own that splits it and fits the walked peak."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import autopar
from autopar.passes.search.problem import largest_transient


class Outer(nn.Module):
    """``[n, e, e]`` outer products of two projections, summed at once: a temporary nothing saves,
    ``e / d`` times the size of the weights."""

    def __init__(self, d: int = 8, e: int = 512):
        super().__init__()
        self.a = nn.Linear(d, e, bias=False)
        self.b = nn.Linear(d, e, bias=False)

    def forward(self, x):
        p = self.a(x).unsqueeze(2) * self.b(x).unsqueeze(1)
        return torch.tanh(p.sum(2)).square().mean()


def _plan(budget):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(Outer(), autopar.Mesh({"dp": 4}, device="cpu"), (torch.randn(1, 8),), progress=False,
                            memory_budget=budget)


def test_a_replicated_temporary_over_the_budget_is_split_by_the_search():
    free = _plan(None)
    temporaries = free.memory["temporaries"]
    assert temporaries > 0.9 * free.peak_memory  # the fastest plan keeps the product whole
    budget = 1_000_000
    assert free.peak_memory > budget
    plan = _plan(budget)
    assert plan.peak_memory <= budget  # the walked peak
    assert plan.memory["temporaries"] < temporaries
    # the search's own plan, faster than every recipe that fits (lowering the budget alone only
    # squeezes the persistent state: no plan of the search's fits, and a recipe wins)
    assert plan.source == "search"
    fitting = [b["step_time"] for b in plan.baselines.values() if b.get("fits")]
    assert fitting and plan.step_time < min(fitting)
    assert any(n.get("tags") == ["S:d1"] for n in plan.nodes if n["name"] == "mul")


def test_the_largest_transient_is_the_chosen_strategies_biggest():
    from autopar.ir.capture import capture
    from autopar.passes.search.build import build_problem
    from autopar.passes.search.fold import fold
    from autopar.passes.search.strategies import search_strategies
    from autopar.cost_model.precision import get_precision

    torch.manual_seed(0)
    mesh = autopar.Mesh({"dp": 4}, device="cpu")
    graph = capture(Outer(), (torch.randn(1, 8),))
    folding = fold(graph)
    strategies = {n.name: search_strategies(graph, n, mesh) for n in graph.nodes}
    problem = build_problem(graph, mesh, folding, strategies, get_precision("fp32", mesh.hardware, "adamw"), 1e9)
    whole = [next(s for s, st in enumerate(n.strategies) if all(t.tag == "B" for t in st)) for n in problem.nodes]
    mul = problem.nodes[problem.index["mul"]]
    # the product [1, 512, 512] in fp32, whole on every device (its inputs are saved for the
    # backward: persistent memory, not transient)
    assert mul.transient[whole[problem.index["mul"]]] == 4 * 512 * 512
    assert largest_transient(problem, whole) >= 4 * 512 * 512
    split = min(mul.transient)
    assert split < mul.transient[whole[problem.index["mul"]]] / 2
