"""Completing a hand-written recipe: from the placements a recipe fixes to a choice for every node.

A recipe (``recipes.py``) fixes where parameters and inputs live; ``complete`` fills in every other
node the cheapest way consistent with that (greedy, then local search; without pinned axes also from
the propagation of the recipe's placements, the cheaper kept), keeping parameters where
they lie on the recipe's *pinned* axes (Megatron's tensor axis: no weight gathers there). Every
weight's placement is the recipe's own (``recipes.tensor_layout``: column or row from the
dataflow pairing), so nothing is searched but the activations; for a recipe asked for by name the
ILP then polishes that completion exactly, within a few seconds.

Glossary: a weight is *pinned* on an axis when the recipe forbids gathering it there; a strategy
is *alive* when the problem's restrictions still allow it.
"""

from __future__ import annotations

from typing import Callable

from autopar.cost_model.comm import LOCAL_KINDS, axis_step
from autopar.ir.placement import Split, format_placements
from autopar.passes.search.merge import Merged
from autopar.passes.search.problem import Problem, evaluate
from autopar.passes.search.propagate import propagate
from autopar.passes.search.local_search import greedy, improve
from autopar.passes.search.solve import InfeasibleError, solve
from autopar.passes.search.solve_axis import FULL_ILP_LIMIT, edge_var_count
from autopar.passes.search.strategies import output_placement

#: Seconds added to a forbidden resharding while completing a recipe (far above any real step).
FORBIDDEN = 1e3


def complete(merged: Merged, problem: Problem, allowed: dict, pinned: list[int], exact: bool = False,
             regions=None, label: Callable[[str], str] = str) -> list[int]:
    """A cheap choice with the placeholders restricted to ``allowed`` placements, and parameters
    used where they lie on the ``pinned`` axes (no gathers there): greedy, then local search; with
    ``exact`` and pinned axes, then the ILP (``_exact_completion``). ``regions`` (``recipes.TensorRegions``):
    which dims activations may be split along on the pinned axes, given the weights' splits.
    ``label`` names a node for messages (``Graph.user_name``)."""
    saved = [n.allowed for n in merged.problem.nodes]
    saved_costs = [e.cost for e in merged.problem.edges]
    try:
        for e in merged.problem.edges:
            if e.kind == "param" and pinned:
                e.cost = [[c + (0.0 if _in_place(e.places_out[p], e.places_in[q], pinned) else FORBIDDEN)
                           for q, c in enumerate(row)] for p, row in enumerate(e.cost)]
        for i, n in enumerate(merged.problem.nodes):
            if n.name in allowed:
                ok = [s for s, st in enumerate(n.strategies) if output_placement(st, 0) in allowed[n.name]]
                if n.allowed is not None:
                    ok = [s for s in ok if s in n.allowed]
                if not ok:
                    raise InfeasibleError(f"{label(n.name)} cannot take the recipe's placement "
                                          f"({' or '.join(format_placements(p) for p in allowed[n.name])})")
                n.allowed = ok
        if not pinned:
            # two starts: greedy takes the first ops' strategies as if their unchosen inputs were free,
            # which can miss the completion that follows the recipe's input placements through the
            # graph (the propagation's); the cheaper after local search is kept
            starts = [improve(merged.problem, greedy(merged.problem)),
                      improve(merged.problem, propagate(merged.problem))]
            costs = [evaluate(merged.problem, c).step_time for c in starts]
            return merged.expand(starts[costs.index(min(costs))], len(problem.nodes))
        _pin_in_place(merged.problem, pinned)
        _restrict_to_regions(merged.problem, pinned, regions)
        best = merged.expand(improve(merged.problem, greedy(merged.problem)), len(problem.nodes))
        if exact and edge_var_count(merged.problem) <= FULL_ILP_LIMIT:
            best = _exact_completion(merged, problem, best)
        return best
    finally:
        for n, a in zip(merged.problem.nodes, saved):
            n.allowed = a
        for e, c in zip(merged.problem.edges, saved_costs):
            e.cost = c


#: Deterministic seconds (CP-SAT's measure) for the exact completion of a recipe asked for by name.
RECIPE_ILP_TIME = 5.0


def _exact_completion(merged: Merged, problem: Problem, start: list[int]) -> list[int]:
    """The recipe's cheapest completion by the ILP, warm-started from greedy plus local search's
    (which it replaces only when cheaper): a single-node move cannot switch an activation's split
    together with every op that reads it."""
    try:
        sol = solve(merged.problem, [start[i] for i in merged.keep], RECIPE_ILP_TIME)
    except InfeasibleError:
        return start
    choice = merged.expand(sol.choice, len(problem.nodes))
    return choice if evaluate(problem, choice).step_time < evaluate(problem, start).step_time * (1 - 1e-9) else start


def _restrict_to_regions(mp: Problem, pinned: list[int], regions) -> None:
    """Keep, on the pinned axes, only the strategies whose outputs are split along dims
    ``regions`` allows for the weights' current splits (a node left with none keeps its own)."""
    if regions is None:
        return
    params, fixed = set(regions.graph.params.values()), set(regions.graph.inputs.values())
    splits = {}
    for n in mp.nodes:
        if n.name not in params:
            continue
        outs = {tuple(n.strategies[s][a].outputs[0] for a in pinned) for s in n.alive()}
        if len(outs) == 1:
            dims = {p.dim for p in outs.pop() if isinstance(p, Split)}
            if len(dims) == 1:
                splits[n.name] = dims.pop()
    ok = regions.allowed(splits)
    for n in mp.nodes:
        if n.name in params or n.name in fixed:
            continue
        dims_of = ok.get(n.name, {})
        keep = [s for s in n.alive() if not _splits_outside(n.strategies[s], dims_of, pinned)]
        if keep:
            n.allowed = keep


def _splits_outside(strategy, dims_of: dict[int, set[int]], axes: list[int]) -> bool:
    """Whether ``strategy`` splits some output on one of ``axes`` along a dim not in ``dims_of``."""
    for a in axes:
        for j, p in enumerate(strategy[a].outputs):
            if isinstance(p, Split) and p.dim not in dims_of.get(j, ()):
                return True
    return False


def _in_place(src, dst, pinned: list[int]) -> bool:
    """Whether a tensor placed ``src`` is read as ``dst`` without communication on the pinned axes
    (the same placement, or a local step: slicing a replicated bias is in place)."""
    return all(src[a] == dst[a] or axis_step(src[a], dst[a]) in LOCAL_KINDS for a in pinned)


def _pin_in_place(problem: Problem, pinned: list[int]) -> None:
    """Megatron's weights are used where they lie on the tensor axis: wherever a parameter (or a
    view of it) has one placement on the ``pinned`` axes, its consumers keep only the strategies
    that read it that way, along the chain of views, until nothing changes. (A penalty alone
    leaves greedy and single-node local search stuck: a weight's forward and backward consumers
    must switch together.) A consumer with no such strategy keeps all of its own."""
    def alive(i: int) -> list[int]:
        return problem.nodes[i].alive()

    def pinned_out(e, s):
        return tuple(e.places_out[e.src_place[s]][a] for a in pinned)

    def reads(e, s, opt) -> bool:  # consumer strategy s reads the weight placed ``opt`` in place
        have = list(e.places_in[e.dst_place[s]])
        src = list(have)
        for a, p in zip(pinned, opt):
            src[a] = p
        return _in_place(src, have, pinned)

    changed = True
    while changed:
        changed = False
        for e in problem.edges:
            if e.kind != "param" or e.dst_slot < 0:
                continue
            outs = {pinned_out(e, s) for s in alive(e.src)}
            if len(outs) != 1:
                continue
            want = outs.pop()
            have = alive(e.dst)
            keep = [s for s in have if reads(e, s, want)]
            if keep and len(keep) < len(have):
                problem.nodes[e.dst].allowed = keep
                changed = True


__all__ = ["FORBIDDEN", "RECIPE_ILP_TIME", "complete"]
