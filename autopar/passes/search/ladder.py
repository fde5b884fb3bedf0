"""The search's solves of one priced problem: the ILP within or without the memory budget
(``solve_choice``), within it until the walked peak fits (``solve_walked``), and the plans that
recompute layer instances, level by level (``recompute_candidates``), with the two bounds that
decide what is worth solving: the least memory (``leanest``) and the least step time
(``time_floor``) any plan of a problem can have.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Optional

from autopar.cost_model.mesh import Mesh
from autopar.errors import InfeasibleError
from autopar.passes.search import checkpoint, peak, solve as solver
from autopar.passes.search.merge import Merged, merge
from autopar.passes.search.problem import Problem, evaluate, least_transient
from autopar.passes.search.local_search import greedy
from autopar.passes.search.solve import Solution, solve
from autopar.passes.search.solve_axis import FULL_ILP_LIMIT, edge_var_count, solve_by_axis


@dataclass
class Solved:
    """One solve of the search: the recomputation its ``problem`` is priced with, the problem's merged
    form, the solver's ``solution`` and its ``choice`` per problem node (None: the solver found none)."""

    recompute: checkpoint.Choice
    problem: Problem
    merged: Merged
    solution: Optional[Solution]
    choice: Optional[list[int]]


def solve_walked(merged: Merged, problem: Problem, choices: dict[str, list[int]], search_args: tuple,
                 budget: float, peak_of):
    """``solve_choice`` with the budget, its linear memory budget lowered until the walked peak
    (``peak_of``) of its plan fits (``passes.search.peak.solve_fitting``)."""
    return peak.solve_fitting(lambda lower, transients, start=None: solve_choice(
        merged, problem, choices, *search_args, budget=True, lower=lower, transients=transients, start=start),
        peak_of, problem, budget)


def solve_choice(merged: Merged, problem: Problem, choices: dict[str, list[int]], mesh: Mesh,
                 deterministic_time: float, time_limit: Optional[float], budget: bool, lower: float = 0.0,
                 transients: bool = False, start: Optional[list[int]] = None):
    """The search's plan of ``problem`` (``(solution, choice)``; ``(None, None)`` when the solver finds
    none), warm-started from the best recipe (the best that fits, with the budget), without the
    memory budget unless ``budget`` (lowered by ``lower`` bytes: the transient memory the linear
    form does not see; ``transients``: the largest op's transient bytes beside the persistent memory;
    ``start``: a plan to start from instead, the fitting search's last, just over the budget)."""
    fitting = [n for n in choices if evaluate(problem, choices[n]).peak_memory <= problem.memory_budget]
    pool = fitting if budget and fitting else list(choices)
    starts = sorted(pool, key=lambda n: (evaluate(problem, choices[n]).step_time, n))
    start = start if start is not None else choices[starts[0]] if starts else greedy(problem)
    limit = merged.problem.memory_budget - lower if budget else math.inf
    target = merged.problem if budget and not lower and not transients else Problem(
        merged.problem.nodes, merged.problem.edges, merged.problem.groups, limit, merged.problem.overlap_slowdown,
        transients=budget and transients)
    warm_start = [start[i] for i in merged.keep]
    if budget and surely_over(target):  # (what the solver would find after its search: nothing)
        return None, None
    try:
        if exact_solver(target, mesh):
            solution = solve(target, warm_start, deterministic_time, time_limit)
        else:
            solution = solve_by_axis(target, warm_start, mesh.ndim, 2, time_limit)
    except InfeasibleError:
        return None, None
    return solution, merged.expand(solution.choice, len(problem.nodes))


def recompute_candidates(problem: Problem, terms: list[checkpoint.GroupTerms], choices: dict[str, list[int]],
                         ops: dict[str, str], progress: bool, mesh: Mesh, deterministic_time: float,
                         time_limit: Optional[float], walk: Optional[peak.Walker] = None,
                         incumbent: float = math.inf) -> list[Solved]:
    """Plans that recompute, for a problem whose best plan does not fit: per mode, from the fewest
    recomputed instances with which any plan fits (the leanest memory: a cheap sum over nodes), then
    more until a plan's walked peak fits (the sum misses what lives between ops), then more while
    the fitting plan gets faster. Every candidate is a full solve; after one over the budget, levels
    whose leanest memory plus that plan's walked excess is still over are skipped (what lives between
    ops, temporaries and gathers in flight, hardly depends on how many instances recompute).

    Returned in ``checkpoint.MODES`` order, levels ascending. The modes are walked most promising
    first (the lowest ``time_floor`` of their first level), and a mode's remaining levels are not
    solved once no plan of any of them can be as fast as the fastest fitting plan found
    (``incumbent``: the caller's, then each fitting solve's): every plan they could add would lose
    to that one, so the choice among the returned plans is the same as with every level solved.
    Where the full ILP solves a level (``solve.beaten`` needs it), a level is also skipped when
    CP-SAT proves that no plan within its memory budget is as fast as the incumbent and no recipe
    is either; with no incumbent yet, a mode's last level (the leanest, the likeliest to fit) is
    solved first to give one (``_first_incumbent``)."""
    top = max(t.count for t in terms)
    priced: dict[tuple[str, int], Problem] = {}
    floors: dict[tuple[str, int], float] = {}
    merges: dict[tuple[str, int], Merged] = {}

    def at(mode: str, level: int) -> Problem:
        if (mode, level) not in priced:
            priced[mode, level] = checkpoint.with_checkpointing(problem, terms, checkpoint.levels(terms, mode, level))
        return priced[mode, level]

    def floor(mode: str, level: int) -> float:
        if (mode, level) not in floors:
            floors[mode, level] = time_floor(at(mode, level))
        return floors[mode, level]

    def merged_at(mode: str, level: int) -> Merged:
        if (mode, level) not in merges:
            merges[mode, level] = merge(at(mode, level), ops)
        return merges[mode, level]

    def attempt(mode: str, level: int):
        """The level's solve: ``(Solved, cost)``, or None when the solver finds no plan."""
        prob, rc = at(mode, level), checkpoint.levels(terms, mode, level)
        merged = merged_at(mode, level)
        search_args = (mesh, deterministic_time, time_limit)
        solution, chosen = (solve_walked(merged, prob, choices, search_args, problem.memory_budget,
                                         lambda c: walk(prob, c, rc).peak_memory) if walk is not None else
                            solve_choice(merged, prob, choices, *search_args, budget=True))
        if chosen is None:
            return None
        cost = walk(prob, chosen, rc) if walk is not None else evaluate(prob, chosen)
        if progress:
            print(f"autopar: recompute {mode} {level}/{top}: {cost.step_time * 1e3:.1f} ms"
                  f"{'' if cost.peak_memory <= problem.memory_budget else ' (over the budget)'}", file=sys.stderr)
        return Solved(rc, prob, merged, solution, chosen), cost

    def beaten(mode: str, level: int, cap: float) -> bool:
        """Whether no candidate of the level (its solves' plans, the recipes priced on it) can be as
        fast as ``cap``: proved by CP-SAT on the full ILP, where that is the level's solver."""
        if cap == math.inf or not exact_solver(merged_at(mode, level).problem, mesh):
            return False
        prob, rc = at(mode, level), checkpoint.levels(terms, mode, level)
        for c in choices.values():  # (a recipe that fits and is as fast would be a candidate)
            if evaluate(prob, c).step_time <= cap * (1 + 1e-9) and (
                    walk(prob, c, rc) if walk is not None else evaluate(prob, c)).peak_memory <= problem.memory_budget:
                return False
        return solver.beaten(merged_at(mode, level).problem, cap, deterministic_time, time_limit)

    # recomputing the last instance saves nothing (its backward follows at once), so at most top - 1
    ladders = {mode: [lv for lv in range(1, top) if leanest(at(mode, lv)) <= problem.memory_budget]
               for mode in checkpoint.MODES}
    walked = sorted((m for m in checkpoint.MODES if ladders[m]),
                    key=lambda m: (floor(m, ladders[m][0]), checkpoint.MODES.index(m)))
    out: dict[str, list[tuple[int, Solved]]] = {}
    for mode in walked:
        ladder = ladders[mode]
        found = out.setdefault(mode, [])
        best_time, excess = math.inf, 0.0
        tried = trials(ladder[0], top - 1)
        sampled, last = len(tried) < len(ladder), tried[-1]
        if incumbent == math.inf and len(tried) > 1 and exact_solver(merged_at(mode, last).problem, mesh):
            got = _first_incumbent(attempt(mode, last), problem.memory_budget)
            found += [(last, got[0])] if got[0] is not None else []
            incumbent, tried = got[1], tried[:-1]
        for n, level in enumerate(tried):
            if min(floor(mode, lv) for lv in tried[n:]) * (1 - 1e-9) > incumbent:
                break  # no plan of this or a later level can win (ties go to an earlier mode: strictly slower)
            if excess and level != last and leanest(at(mode, level)) + excess > problem.memory_budget:
                continue
            if beaten(mode, level, incumbent):
                continue  # (the plans it would add are slower than one found: none of them is chosen)
            got = attempt(mode, level)
            if got is None:
                continue
            solved, cost = got
            found.append((level, solved))
            if cost.peak_memory > problem.memory_budget:  # recomputing more lowers the peak: a later level may fit
                excess = max(excess, cost.peak_memory - evaluate(solved.problem, solved.choice).peak_memory)
                continue
            incumbent = min(incumbent, cost.step_time)
            if cost.step_time >= best_time and sampled:
                break  # a sample of many levels: stop where recomputing more stops paying
            best_time = cost.step_time
    return [s for mode in checkpoint.MODES for _, s in sorted(out.get(mode, []), key=lambda ls: ls[0])]


def _first_incumbent(got, budget: float) -> tuple[Optional[Solved], float]:
    """A mode's last level solved first (``recompute_candidates``): its plan (None: none found) and
    its step time where it fits (an incumbent for the mode's other levels; else none, ``inf``).
    Its walked excess is not carried to the other levels, as when it is solved after them."""
    if got is None:
        return None, math.inf
    solved, cost = got
    return solved, cost.step_time if cost.peak_memory <= budget else math.inf


def exact_solver(problem: Problem, mesh: Mesh) -> bool:
    """Whether ``solve_choice`` solves ``problem`` (merged) by the full ILP (CP-SAT) rather than
    by mesh axis (``solve_axis``)."""
    return edge_var_count(problem) <= FULL_ILP_LIMIT or mesh.ndim == 1


def trials(first: int, last: int) -> list[int]:
    """The recomputation levels tried from the fewest that fits: every one when few, else doubling steps."""
    if last - first <= 3:
        return list(range(first, last + 1))
    out, step = [first], 1
    while first + step < last:
        out.append(first + step)
        step *= 2
    return out + [last]


def leanest(problem: Problem) -> float:
    """The least memory per device any plan of ``problem`` needs (memory is a sum over nodes)."""
    return sum(n.mult * min(n.mem_total(s) for s in n.alive()) for n in problem.nodes)


#: how far the least memory must exceed the budget for ``surely_over`` (relative, plus bytes and half
#: a byte per node): above the solvers' rounding of bytes (CP-SAT: each term to whole bytes) and
#: their feasibility tolerance (HiGHS: its memory row in GB), so no plan a solver accepts is ruled out
OVER_MARGIN, OVER_BYTES = 1e-6, 4096


def surely_over(problem: Problem) -> bool:
    """Whether no choice can satisfy the memory row of ``problem``'s solve: its least memory
    (``leanest``: the kept copies an edge adds are never negative), plus, where the row counts the
    largest transient (``Problem.transients``), the largest of the nodes' least transients, is over
    the budget. The solvers would search and find nothing (the lowered budgets of
    ``solve_walked`` often ask for that); this answers at the cost of a sum."""
    if problem.memory_budget == math.inf:
        return False
    need = leanest(problem)
    if problem.transients:
        need += least_transient(problem)
    slack = OVER_MARGIN * abs(problem.memory_budget) + OVER_BYTES + 0.5 * len(problem.nodes)
    # (with no memory at all the solvers write no memory row: any budget is met)
    return need >= 1 and need > problem.memory_budget + slack


def time_floor(problem: Problem) -> float:
    """A lower bound of every choice's step time on ``problem`` (any strategy, allowed or not):
    each node's cheapest compute and own communication. ``evaluate`` adds only what is never
    negative to that sum: reshardings, exposed parameter traffic, the compute it slows."""
    return sum(n.mult * min(c + m for c, m in zip(n.compute, n.comm)) for n in problem.nodes)


__all__ = ["Solved", "exact_solver", "leanest", "recompute_candidates", "solve_choice", "solve_walked", "surely_over", "time_floor", "trials"]
