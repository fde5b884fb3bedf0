"""Solve on large multi-axis meshes: one mesh axis at a time, each round a MIP solved by HiGHS.

The full ILP grows with (strategies per node)^2 per edge; on a multi-axis mesh whose full model is
too large it is solved one mesh axis at a time (every other axis held at the current choice),
which keeps each model as small as a 1-D one. The start (the best recipe) is first polished by
local search; each round then starts from the current choice and keeps it unless the round's plan
is faster by the evaluator, so the step time never gets worse.

Rounds are solved by HiGHS (through OR-Tools' linear solver wrapper), with the same formulation as
the CP-SAT model (``solve.formulate``) but continuous transports: measured on the 32-layer
LLaMA-3-8B shape on an (8, 8) mesh (8k variables per round), HiGHS's LP-based heuristics find the
round's optimum within a second and prove it within 1% at the root, where CP-SAT took 4-12 s per
round to reach the same plan. A round stops at ``AXIS_GAP`` relative gap (the cost model is not
more exact than that); HiGHS runs single-threaded and is deterministic for a given model, and
its node limit bounds the work (wall clock only as a cap). HiGHS takes no warm start here
(pywraplp's hint crashes it in OR-Tools 9.15): the current choice is the fallback instead.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from autopar.passes.search.problem import Problem, evaluate
from autopar.passes.search.solve import Solution, formulate, improve

#: Above this many transport variables a multi-axis mesh's ILP is solved one mesh axis at a time
#: (HiGHS rounds, this module). Measured: tiny GPT on a (2, 2) mesh (39k transport
#: variables) took CP-SAT 130 s of wall time for its 20 s of deterministic time, still FEASIBLE,
#: where four HiGHS rounds reach a plan 0.8% slower (by the evaluator) in about 3 s.
FULL_ILP_LIMIT = 10_000

#: Relative optimality gap at which an axis round stops.
AXIS_GAP = 0.02
#: Branch-and-bound nodes per round (a work bound; measured rounds close at the root node).
AXIS_NODE_LIMIT = 2000
#: Further HiGHS options for every round. No restarts: measured, HiGHS's root restarts spend most
#: of a round re-solving the root LP without a better plan (tiny GPT on a (2, 2) mesh: 3.5 s
#: instead of 6.6 s for four rounds, the same plan; the 32-layer LLaMA-3-8B shape: 3.2 s against 4.1 s).
HIGHS_OPTIONS: dict = {"mip_allow_restart": "false", "mip_heuristic_run_rins": "false", "mip_heuristic_run_rens": "false", "mip_heuristic_run_root_reduced_cost": "false"}
#: Weight of the tie-break terms (hidden traffic in microseconds, memory in MB: ``solve.formulate``'s
#: secondary objective) next to the step time in microseconds.
TIE_WEIGHT = float(__import__("os").environ.get("TIE_WEIGHT", "1e-4"))
#: Wall-clock cap per round, seconds, when the caller gives no time limit.
AXIS_WALL_CAP = 120.0


class HighsModel:
    """The formulation's building blocks on HiGHS (a ``solve.ModelBackend``): 0/1 strategy choices,
    continuous transports (the transport rows make them integral once the choices are), costs in microseconds (HiGHS
    warns on costs below 1e-6) and memory in GB."""

    def __init__(self) -> None:
        from ortools.linear_solver import pywraplp

        self.solver = pywraplp.Solver.CreateSolver("HIGHS")
        if self.solver is None:
            raise RuntimeError("OR-Tools was built without HiGHS; reinstall ortools (pip install ortools)")

    def bool(self, name: str):
        return self.solver.BoolVar(name)

    def frac(self, name: str):
        return self.solver.NumVar(0.0, 1.0, name)

    def num(self, upper: float, name: str):
        return self.solver.NumVar(0.0, float(upper), name)

    def exactly_one(self, vs) -> None:
        self.linear([(1, v) for v in vs], 1, 1)

    def implies(self, a, b) -> None:
        self.linear([(1, b), (-1, a)], lo=0)

    @staticmethod
    def _coefficients(terms) -> dict:
        """Variable index -> (variable, summed coefficient): SetCoefficient overwrites, so a
        variable listed twice (it may be, e.g. a choice paying two transfers) is summed first."""
        out: dict = {}
        for c, v in terms:
            i = v.index()
            out[i] = (v, out[i][1] + c) if i in out else (v, c)
        return out

    def linear(self, terms, lo=None, hi=None) -> None:
        """lo <= sum(c * v) <= hi (None: unbounded on that side)."""
        inf = self.solver.infinity()
        row = self.solver.Constraint(-inf if lo is None else float(lo), inf if hi is None else float(hi))
        for v, c in self._coefficients(terms).values():
            row.SetCoefficient(v, float(c))

    def minimize(self, terms) -> None:
        objective = self.solver.Objective()
        for v, c in self._coefficients(terms).values():
            objective.SetCoefficient(v, float(c))
        objective.SetMinimization()

    @staticmethod
    def time(seconds: float) -> float:
        return seconds * 1e6

    @staticmethod
    def mem(nbytes: float) -> float:
        return nbytes / 1e9

    mem_limit = mem

    def warm_start(self, v, value: int) -> None:  # no warm start on HiGHS (see the module docstring)
        pass


def solve_round(problem: Problem, time_limit: Optional[float]) -> tuple[Optional[list[int]], dict]:
    """One restricted model (the strategies ``allowed`` per node) solved by HiGHS: the choice, or
    None when HiGHS found none within its limits, and the round's statistics."""
    from ortools.linear_solver import pywraplp

    m, x, primary, secondary = formulate(problem, None, shared=True, m=HighsModel())
    m.minimize(primary + [(TIE_WEIGHT * c, v) for c, v in secondary])
    solver = m.solver
    solver.SetNumThreads(1)
    # HiGHS's own options (the call returns False even when it takes them all; an unknown option
    # fails the solve instead); the gap must be given both here and to Solve, which resets it
    options = {"output_flag": "false", "mip_rel_gap": AXIS_GAP, "mip_max_nodes": AXIS_NODE_LIMIT, **HIGHS_OPTIONS}
    solver.SetSolverSpecificParametersAsString("".join(f"{k}={v}\n" for k, v in options.items()))
    solver.SetTimeLimit(int(1000 * (time_limit if time_limit is not None else AXIS_WALL_CAP)))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, AXIS_GAP)
    status = solver.Solve(params)
    names = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
             pywraplp.Solver.INFEASIBLE: "INFEASIBLE"}
    stats = {"status": names.get(status, "NOT_SOLVED"), "variables": solver.NumVariables(),
             "constraints": solver.NumConstraints(), "nodes": int(solver.nodes())}
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return None, stats
    choice = [max(vs, key=lambda s: (vs[s].solution_value(), -s)) for vs in (x[i] for i in range(len(x)))]
    return choice, stats


def edge_var_count(problem: Problem) -> int:
    """How many transport variables ``y`` the full ILP would have (a shared transfer's ``z`` add
    at most as many again; they are not counted, so the full-ILP threshold keeps its meaning)."""
    total = 0
    for e in problem.edges:
        src = problem.nodes[e.src]
        dst = problem.nodes[e.dst]
        rows = {e.src_place[s] for s in src.alive()}
        cols = {e.dst_place[s] for s in dst.alive()}
        total += len(rows) * len(cols)
    return total


def solve_by_axis(
    problem: Problem,
    start: Sequence[int],
    ndim: int,
    rounds: int = 2,
    time_limit: Optional[float] = None,
) -> Solution:
    """Coordinate descent over mesh axes: re-solve the last axis (usually the fastest, tensor
    parallel one) first, then the others, ``rounds`` times. A round whose restricted space (the
    strategies each node may take) was already solved is skipped: it cannot gain."""
    choice = list(start)
    saved = [n.allowed for n in problem.nodes]
    stats: dict = {"solver": "HiGHS by mesh axis", "rounds": 0, "variables": 0, "constraints": 0,
                   "relative_gap_per_round": AXIS_GAP, "status": "FEASIBLE"}
    order = [a for r in range(rounds) for a in reversed(range(ndim))]
    best = evaluate(problem, choice).step_time
    # Local search first (cheap): measured, a start nearer the optimum makes the rounds both
    # faster and better (LLaMA-3-8B shape, 32 layers, (8, 8): 4.6 s of CPU instead of 8.9 s, a
    # plan 1% faster). It ignores memory: a polished start over the budget is only a starting
    # point (every round's plan fits, and replaces it); if no round finds one, the start stands.
    original, fits = list(choice), True
    polished = improve(problem, choice)
    cost = evaluate(problem, polished)
    if cost.step_time < best * (1 - 1e-9):
        choice, best, fits = polished, cost.step_time, cost.peak_memory <= problem.memory_budget
        stats["start"] = "local search from the hint" + ("" if fits else " (over the memory budget)")
    since_gain = 0
    solved: set = set()  # restricted spaces (allowed strategies per node) already solved
    t0 = time.perf_counter()
    try:
        for axis in order:
            if since_gain >= ndim:  # a full cycle over the axes without a gain: a fixed point
                break
            for i, n in enumerate(problem.nodes):
                cur = n.strategies[choice[i]]
                ok = [s for s, st in enumerate(n.strategies)
                      if all(st[a] == cur[a] for a in range(ndim) if a != axis)]
                if saved[i] is not None:
                    ok = [s for s in ok if s in saved[i]]
                n.allowed = ok or [choice[i]]
            space = tuple(tuple(n.allowed) for n in problem.nodes)
            if space in solved:
                since_gain += 1
                continue
            left = None if time_limit is None else max(1.0, time_limit - (time.perf_counter() - t0))
            found, round_stats = solve_round(problem, left)
            for k in ("variables", "constraints"):
                stats[k] = max(stats[k], round_stats[k])
            stats["rounds"] += 1
            # no wall time per round: plans on disk stay byte-identical
            stats.setdefault("per_round", []).append({"axis": axis, **round_stats})
            if round_stats["status"] == "OPTIMAL":
                solved.add(space)
            value = evaluate(problem, found).step_time if found is not None else best
            if found is not None and (not fits or value < best * (1 - 1e-9)):
                choice, best, since_gain, fits = found, value, 0, True
            else:
                since_gain += 1
    finally:
        for n, a in zip(problem.nodes, saved):
            n.allowed = a
    if not fits:  # no round turned the polished start into a plan that fits
        choice, best = original, evaluate(problem, original).step_time
    stats["wall_time"] = round(time.perf_counter() - t0, 3)
    stats["gap"] = None  # a bound over the whole space is not known
    return Solution(choice, best, 0.0, "FEASIBLE", stats)


__all__ = ["AXIS_GAP", "HighsModel", "edge_var_count", "solve_by_axis", "solve_round"]
