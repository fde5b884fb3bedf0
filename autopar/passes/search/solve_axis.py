"""Solve on large multi-axis meshes: one mesh axis at a time, each round a MIP solved by HiGHS.

The full ILP grows with (strategies per node)^2 per edge; on a multi-axis mesh whose full model is
too large it is solved one mesh axis at a time (every other axis held at the current choice),
which keeps each model as small as a 1-D one. The start (the best recipe) is first polished by
local search; each round then starts from the current choice and keeps it unless the round's plan
is faster by the evaluator, so the step time never gets worse.

Rounds are solved by HiGHS (through OR-Tools' linear solver wrapper), with the same formulation as
the CP-SAT model (``solve.formulate``) but continuous transports: measured on the 32-layer
LLaMA-3-8B shape on an (8, 8) mesh (8k variables per round), HiGHS's LP-based heuristics find the
round's optimum within a second and prove it within 2% at the root, where CP-SAT took 4-12 s per
round to reach the same plan. A round stops at ``AXIS_GAP`` relative gap (the cost model is not
more exact than that); HiGHS runs single-threaded and is deterministic for a given model, and
its node limit bounds the work (wall clock only as a cap). HiGHS takes no warm start here
(OR-Tools 9.15 passes a hint to HiGHS through vectors it never sizes, and crashes): the current
choice is the fallback instead.

Where the time of a round goes, and why the options below: the LP relaxation is tight except
at the overlap rows (``solve._exposed``: exposed = max(0, a group's parameter traffic minus its
compute)). When a layer's parameter traffic is close to its compute, the LP mixes two layouts of
a layer (measured at 32 layers: 86% of the plan's MLP layout and 14% of one that moves 32 ms less
activation data but exposes 62 ms of gathers) so that the traffic lands exactly on the compute;
every integral plan pays one or the other, and the root bound is 2.1% below the round's optimum,
which HiGHS's central rounding finds at once. HiGHS then spent 2 s per round in its root
sub-MIP heuristics (RINS, RENS, root reduced cost), which found nothing better; its cuts close the
gap to 1.3% without them. Hence those three are off (``HIGHS_OPTIONS``).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from autopar.passes.search.collector import collector_paused
from autopar.errors import InfeasibleError
from autopar.passes.search.problem import Problem, evaluate, largest_transient
from autopar.passes.search.local_search import improve
from autopar.passes.search.solve import Solution, formulate

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
#: instead of 6.6 s for four rounds, the same plan; the 32-layer LLaMA-3-8B shape: 3.2 s against
#: 4.1 s). No root sub-MIP heuristics (RINS, RENS, root reduced cost): measured on the LLaMA-3-8B
#: shape on (8, 8), they found no better plan in any round at 2, 8 or 32 layers (nor on a
#: (4, 8, 8) mesh), and at 32 layers they were 67% of the first tensor-axis round's LP iterations
#: (5.6k of 8.4k; see the module docstring).
HIGHS_OPTIONS: dict = {
    "mip_allow_restart": "false",
    "mip_heuristic_run_rins": "false",
    "mip_heuristic_run_rens": "false",
    "mip_heuristic_run_root_reduced_cost": "false",
}
#: Weight of the tie-break terms next to the step time (microseconds) in a round's objective: the
#: secondary objective of ``solve.formulate`` (hidden traffic in microseconds, memory in MB), as one
#: objective rather than CP-SAT's second, lexicographic solve (which would double a round). All of
#: them together weigh a few microseconds of step time on the 32-layer model, far below the
#: round's gap; without them a round returned any of the equally fast plans (measured at 32
#: layers: a layer weight replicated on the data axis instead of sharded, 1 GiB more per device).
TIE_WEIGHT = 1e-4
#: Wall-clock cap per round, seconds, when the caller gives no time limit.
AXIS_WALL_CAP = 120.0


class HighsModel:
    """The formulation's building blocks on HiGHS (a ``solve.ModelBackend``): 0/1 strategy choices,
    continuous transports (the transport rows make them integral once the choices are), costs in
    microseconds (HiGHS warns on costs below 1e-6) and memory in GB. Variables are column indices;
    the model is collected in lists and handed to the solver in one piece (``solve``), since
    building it through the wrapper one variable and one coefficient at a time cost more than
    HiGHS's own presolve."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[tuple[float, float, list[int], list[float]]] = []
        self.cost: dict[int, float] = {}

    def _col(self, upper: float, integer: bool) -> int:
        self.lower.append(0.0)
        self.upper.append(float(upper))
        self.integer.append(integer)
        return len(self.upper) - 1

    def bool(self, name: str) -> int:
        return self._col(1.0, True)

    def frac(self, name: str) -> int:
        return self._col(1.0, False)

    def num(self, upper: float, name: str) -> int:
        return self._col(upper, False)

    def exactly_one(self, vs) -> None:
        self.linear([(1, v) for v in vs], 1, 1)

    def implies(self, a, b) -> None:
        self.linear([(1, b), (-1, a)], lo=0)

    @staticmethod
    def _coefficients(terms) -> dict[int, float]:
        """Column -> summed coefficient (a variable may be listed twice, e.g. a choice paying two
        transfers)."""
        out: dict[int, float] = {}
        for c, v in terms:
            out[v] = out.get(v, 0.0) + c
        return out

    def linear(self, terms, lo=None, hi=None) -> None:
        """lo <= sum(c * v) <= hi (None: unbounded on that side)."""
        coef = self._coefficients(terms)
        inf = float("inf")
        self.rows.append((-inf if lo is None else float(lo), inf if hi is None else float(hi),
                          list(coef), [float(c) for c in coef.values()]))

    def minimize(self, terms) -> None:
        self.cost = self._coefficients(terms)

    @staticmethod
    def time(seconds: float) -> float:
        return seconds * 1e6

    @staticmethod
    def mem(nbytes: float) -> float:
        return nbytes / 1e9

    mem_limit = mem

    def warm_start(self, v, value: int) -> None:  # no warm start on HiGHS (see the module docstring)
        pass

    def solve(self, options: dict, time_limit: float) -> tuple[str, Optional[list[float]], int]:
        """Solve with HiGHS ``options``, single-threaded, within ``time_limit`` seconds of wall
        clock: the status (OPTIMAL, FEASIBLE, INFEASIBLE or NOT_SOLVED), every column's value
        (None unless OPTIMAL or FEASIBLE) and the branch-and-bound nodes."""
        from ortools.linear_solver import linear_solver_pb2, pywraplp

        proto = linear_solver_pb2.MPModelProto()
        for k, (lo, hi, integer) in enumerate(zip(self.lower, self.upper, self.integer)):
            proto.variable.add(lower_bound=lo, upper_bound=hi, is_integer=integer,
                               objective_coefficient=self.cost.get(k, 0.0))
        for lo, hi, cols, coefs in self.rows:
            row = proto.constraint.add(lower_bound=lo, upper_bound=hi)
            row.var_index.extend(cols)
            row.coefficient.extend(coefs)
        solver = pywraplp.Solver.CreateSolver("HIGHS")
        if solver is None:
            raise RuntimeError("OR-Tools was built without HiGHS; reinstall ortools (pip install ortools)")
        error = solver.LoadModelFromProto(proto)
        if error:
            raise RuntimeError(f"HiGHS did not take the axis round's model: {error}")
        solver.SetNumThreads(1)
        # HiGHS's own options (the call returns False even when it takes them all; an unknown
        # option fails the solve instead); the gap must be given both here and to Solve, which resets it
        solver.SetSolverSpecificParametersAsString("".join(f"{k}={v}\n" for k, v in options.items()))
        solver.SetTimeLimit(int(1000 * time_limit))
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, float(options["mip_rel_gap"]))
        status = solver.Solve(params)
        names = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
                 pywraplp.Solver.INFEASIBLE: "INFEASIBLE"}
        name = names.get(status, "NOT_SOLVED")
        if name not in ("OPTIMAL", "FEASIBLE"):
            return name, None, int(solver.nodes())
        response = linear_solver_pb2.MPSolutionResponse()
        solver.FillSolutionResponseProto(response)
        return name, list(response.variable_value), int(solver.nodes())


def solve_round(problem: Problem, time_limit: Optional[float]) -> tuple[Optional[list[int]], dict]:
    """One restricted model (the strategies ``allowed`` per node) solved by HiGHS: the choice, or
    None when HiGHS found none within its limits, and the round's statistics."""
    m, x, primary, secondary = formulate(problem, None, shared=True, m=HighsModel())
    m.minimize(primary + [(TIE_WEIGHT * c, v) for c, v in secondary])
    options = {"output_flag": "false", "mip_rel_gap": AXIS_GAP, "mip_max_nodes": AXIS_NODE_LIMIT, **HIGHS_OPTIONS}
    status, values, nodes = m.solve(options, time_limit if time_limit is not None else AXIS_WALL_CAP)
    stats = {"status": status, "variables": len(m.upper), "constraints": len(m.rows), "nodes": nodes}
    if values is None:
        return None, stats
    choice = [max(vs, key=lambda s: (values[vs[s]], -s)) for vs in (x[i] for i in range(len(x)))]
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
    strategies each node may take) was already solved is skipped: it cannot gain.

    The plan returned fits the problem's memory row (``within_budget``): where no round fits and
    the start is over the budget too, the rounds run again from the leanest choice
    (``leanest_choice``); where even that is over, ``InfeasibleError``, as ``solve.solve`` raises.

    Python's cyclic garbage collector is paused meanwhile: the rounds allocate tens of thousands of
    small objects (the models' rows, freed by reference counting), and each collection they
    triggered walked the whole planning heap (graph, priced problem): measured at 32 layers, one
    round's model took 0.5 s to build with the collector on and 0.06 s with it paused."""
    with collector_paused():
        return _solve_by_axis(problem, start, ndim, rounds, time_limit)


def _solve_by_axis(problem: Problem, start: Sequence[int], ndim: int, rounds: int,
                   time_limit: Optional[float]) -> Solution:
    t0 = time.perf_counter()
    stats: dict = {"solver": "HiGHS by mesh axis", "rounds": 0, "variables": 0, "constraints": 0,
                   "relative_gap_per_round": AXIS_GAP, "status": "FEASIBLE"}
    deadline = None if time_limit is None else t0 + time_limit
    choice, best, fits = _descend(problem, start, ndim, rounds, deadline, stats, polish=True)
    if not fits and within_budget(problem, start):  # no round fitted the polished start's space
        choice, best, fits = list(start), evaluate(problem, start).step_time, True
    if not fits:
        # the start itself is over the budget: descend again from the leanest choice, which fits
        # whenever any choice does (memory is a sum over nodes), so a fitting plan is not missed
        # because the start's restricted spaces held none
        lean = leanest_choice(problem)
        if not within_budget(problem, lean):
            raise InfeasibleError(f"no plan fits the memory budget of {problem.memory_budget / 2**30:.1f} GiB: "
                                  f"the leanest choice needs {_need(problem, lean) / 2**30:.1f} GiB")
        stats["start"] = "the leanest choice (the start is over the memory budget)"
        choice, best, _ = _descend(problem, lean, ndim, rounds, deadline, stats, polish=False)
    stats["wall_time"] = round(time.perf_counter() - t0, 3)
    stats["gap"] = None  # a bound over the whole space is not known
    return Solution(choice, best, 0.0, "FEASIBLE", stats)


def _need(problem: Problem, choice: Sequence[int]) -> float:
    """The bytes the solver's memory row counts for ``choice``: the nodes' memory, and the largest
    transient where ``Problem.transients`` asks for it."""
    return evaluate(problem, choice).peak_memory + (largest_transient(problem, choice) if problem.transients else 0.0)


def within_budget(problem: Problem, choice: Sequence[int]) -> bool:
    """Whether ``choice`` satisfies the memory row of ``problem``'s solve (``solve._memory``)."""
    return _need(problem, choice) <= problem.memory_budget


def leanest_choice(problem: Problem) -> list[int]:
    """Per node the allowed strategy with the least memory (ties: the least compute, then the
    first): the choice that fits whenever any does, up to the transient term."""
    return [min(n.alive(), key=lambda s: (n.mem_total(s), n.transient[s] if n.transient else 0.0, n.compute[s], s))
            for n in problem.nodes]


def _descend(problem: Problem, start: Sequence[int], ndim: int, rounds: int, deadline: Optional[float],
             stats: dict, polish: bool) -> tuple[list[int], float, bool]:
    """The rounds of ``solve_by_axis`` from ``start``: ``(choice, its step time, whether it fits)``.
    A round's plan fits (its model has the memory row); the start may not, and then any round's
    plan replaces it."""
    choice = list(start)
    saved = [n.allowed for n in problem.nodes]
    order = [a for r in range(rounds) for a in reversed(range(ndim))]
    best = evaluate(problem, choice).step_time
    fits = within_budget(problem, choice)
    # Local search first (cheap): measured, a start nearer the optimum makes the rounds both
    # faster and better (LLaMA-3-8B shape, 32 layers, (8, 8): 4.6 s of CPU instead of 8.9 s, a
    # plan 1% faster). It ignores memory: a polished start over the budget is only a starting
    # point (every round's plan fits, and replaces it).
    if polish:
        polished = improve(problem, choice)
        cost = evaluate(problem, polished)
        if cost.step_time < best * (1 - 1e-9):
            choice, best, fits = polished, cost.step_time, within_budget(problem, polished)
            stats["start"] = "local search from the hint" + ("" if fits else " (over the memory budget)")
    since_gain = 0
    solved: set = set()  # restricted spaces (allowed strategies per node) already solved
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
            left = None if deadline is None else max(1.0, deadline - time.perf_counter())
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
    return choice, best, fits


__all__ = ["AXIS_GAP", "HighsModel", "edge_var_count", "leanest_choice", "solve_by_axis", "solve_round",
           "within_budget"]
