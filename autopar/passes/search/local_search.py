"""Quick choices without a solver: ``greedy`` (each op its cheapest strategy given those before it)
and ``improve`` (local search from a choice), for warm starts and for completing recipes."""

from __future__ import annotations

from typing import Sequence

from autopar.passes.search.problem import Problem, incident_transfers, local_cost


def greedy(problem: Problem) -> list[int]:
    """A quick choice: op nodes in order take the strategy that is cheapest given the nodes already
    chosen (graph inputs not yet chosen cost nothing: they will follow), then every graph input
    takes the placement its chosen consumers want most."""
    choice = [-1] * len(problem.nodes)
    incident = incident_transfers(problem)
    inputs = {i for i, n in enumerate(problem.nodes) if all(len(st[0].inputs) == 0 for st in n.strategies)}
    order = [i for i in range(len(problem.nodes)) if i not in inputs] + sorted(inputs)
    for i in order:
        n = problem.nodes[i]
        best, best_cost = None, None
        for s in n.alive():
            c = local_cost(problem, incident, choice, i, s)
            if best_cost is None or c < best_cost - 1e-15:  # near-ties keep the earlier strategy
                best, best_cost = s, c
        choice[i] = best  # type: ignore[assignment]
    return choice


def improve(problem: Problem, choice: Sequence[int], sweeps: int = 5) -> list[int]:
    """Local search from ``choice``: each node in turn takes its best strategy with its neighbours
    held (compute, sink communication, the transfers it touches, priced as ``evaluate`` does),
    until a sweep changes nothing.
    Cheap; used to complete recipes, where an exact ILP per recipe would cost more than it tells."""
    choice = list(choice)
    incident = incident_transfers(problem)
    for _ in range(sweeps):
        changed = False
        for i, n in enumerate(problem.nodes):
            options = n.alive()
            cost = {s: local_cost(problem, incident, choice, i, s) for s in options}
            best = min(options, key=lambda s: (cost[s], s != choice[i], s))
            if best != choice[i] and cost[best] < cost[choice[i]] - 1e-15:
                choice[i] = best
                changed = True
        if not changed:
            break
    return choice
