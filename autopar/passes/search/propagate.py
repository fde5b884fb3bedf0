"""Propagation-only planning (``autopar.plan(..., search="propagate")``): no ILP.

GSPMD-style: the user's annotations (hints, which restrict nodes' strategies) spread along the
graph's edges, forward and backward, until nothing changes:

- forward: when every strategy left to a producer gives one output placement, a consumer keeps
  only the strategies that read the tensor that way (if it has any);
- backward: when every strategy left to a consumer reads one placement of an input, the producer
  keeps only the strategies that produce it (if it has any).

Nodes the annotations do not determine then take the cheapest local choice, in graph order, given
the choices made so far (compute, sink communication and the reshardings to already-chosen
neighbours: ``problem.local_cost``); a second sweep lets early nodes answer later ones. The result
is a choice for the same ``Problem``, priced by the same evaluator as a searched plan.
"""

from __future__ import annotations

from typing import Optional

from autopar.passes.search.problem import Problem, incident_transfers, local_cost


def propagate(problem: Problem, max_rounds: int = 1000) -> list[int]:
    """One strategy per node of ``problem`` by annotation propagation, then cheapest local choices."""
    alive: list[set[int]] = [
        set(n.alive()) for n in problem.nodes
    ]
    for _ in range(max_rounds):
        changed = False
        for e in problem.edges:
            src, dst = alive[e.src], alive[e.dst]
            rows = {e.src_place[s] for s in src}
            if len(rows) == 1 and e.dst_slot >= 0:  # forward: the tensor's placement is known
                want = e.places_out[next(iter(rows))]
                keep = {s for s in dst if e.places_in[e.dst_place[s]] == want}
                if keep and keep != dst:
                    alive[e.dst] = keep
                    changed = True
            cols = {e.dst_place[s] for s in alive[e.dst]}
            if len(cols) == 1:  # backward: what the consumer reads is known
                want = e.places_in[next(iter(cols))]
                keep = {s for s in alive[e.src] if e.places_out[e.src_place[s]] == want}
                if keep and keep != alive[e.src]:
                    alive[e.src] = keep
                    changed = True
        if not changed:
            break
    return _cheapest(problem, alive)


def _cheapest(problem: Problem, alive: list[set[int]]) -> list[int]:
    incident = incident_transfers(problem)
    choice: list[int] = [-1] * len(problem.nodes)
    for _sweep in range(2):
        for i in range(len(problem.nodes)):
            options = sorted(alive[i])
            best: Optional[tuple[float, int]] = None
            for s in options:
                c = local_cost(problem, incident, choice, i, s)
                if best is None or c < best[0]:
                    best = (c, s)
            assert best is not None
            choice[i] = best[1]
    return choice


__all__ = ["propagate"]
