"""Solve: choose one strategy per node with an integer program (OR-Tools CP-SAT).

Variables and constraints, each family built in its own function below (``formulate`` calls them):

- ``x[n, s]`` (bool): node n runs strategy s.              one-hot:  sum_s x[n, s] = 1
  Strategies a hint excludes get no variable.                              -> ``_node_vars``
- ``y[e, p, q]`` (bool): edge e carries its tensor from placement p (the producer's output) to
  placement q (the consumer's input).                      transport: sum_q y[e, p, q] = sum_{s: out(s) = p} x[src, s]
                                                                      sum_p y[e, p, q] = sum_{s: in(s) = q} x[dst, s]
- ``z[t, p, Q]`` (bool), only for a transfer t (the edges of one tensor, ``problem.py``) with two
  or more edges that can cost something, per pair of placements with a positive cost: the
  tensor is resharded from p to Q, once for all its consumers.
                                                           z[t, p, Q] >= y[e, p, q]  for every e in t whose column q is Q
  (``y`` and ``z``, with their costs in the objective: ``_edge_vars``)
- ``exposed[g]`` (int >= 0): the part of one instance of group g's parameter gathers and gradient
  reductions that its compute cannot hide, times 1 - s (s: the overlap slowdown, 0 on cpu).
                                                           exposed[g] >= (1 - s) (sum_{t in g} cost_t - sum_{n in g} compute_n(x))
                                                           -> ``_exposed``
- memory (bytes per device):                               sum_n mult_n * mem_n(x) <= budget   -> ``_memory``
  and, where ``Problem.transients`` asks, ``top`` (>= 0) the largest op's transient bytes
  (``PNode.transient``) added to the sum:                 top >= transient_n(x) for every n
  not ``PNode.head``; for the head's ops (before the layers' backward) a row of their own:
  sum_n mult_n * (mem_n - deferred_n)(x) + top_head <= budget, top_head >= transient_n(x)

where a transfer's cost is sum_{p, q} cost_e[p, q] y[e, p, q] for a lone edge and
sum_{p, Q} cost_t[p, Q] z[t, p, Q] for a shared one (minimising pushes each z down to the OR of
its edges' transports, so every distinct target placement is paid exactly once).

Objective (picoseconds): sum_n mult_n (compute_n + comm_n)(x) + sum_{t not overlappable} mult_t cost_t
+ sum_g mult_g ((1 - s) exposed[g] + s sum_{t in g} cost_t), s the overlap slowdown (compute lost
beside a hidden collective; ``_exposed`` writes the row scaled by 1 - s) — exactly
``problem.evaluate`` linearised. Ties (hidden communication
costs nothing where s is 0, as on cpu) are broken lexicographically by a second solve that keeps the step time at the
first solve's value and minimises hidden traffic plus memory, so among equally fast plans the one
that moves and holds less wins. The secondary objective's units: hidden traffic in whole microseconds
(``_edge_vars``) plus memory in whole MB (10^6 bytes, ``formulate``), coarse on purpose: the
second solve only orders plans of equal step time.

``solve_axis.solve_by_axis`` relaxes this for large multi-axis meshes: the same formulation on
HiGHS with continuous transports, re-solving one mesh axis at a time with the others fixed.

The search is deterministic: one worker, a fixed seed, and a bound on deterministic time (wall
clock only as a cap); it starts from a warm start (the best recipe), so a time limit still returns a
plan no worse than that start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

from autopar.errors import InfeasibleError
from autopar.passes.search.problem import Problem, evaluate

PS_PER_S = 1e12  # objective unit: picoseconds (integer costs; finer units keep rounding below any real difference)


@dataclass
class Solution:
    """The solver's answer: one strategy per (merged) problem node, the objective and bound in
    seconds, the solver's status and its statistics (variables, constraints, times)."""

    choice: list[int]
    objective: float  # seconds, as the solver saw it (rounded to picoseconds)
    bound: float
    status: str
    stats: dict = field(default_factory=dict)

    @property
    def gap(self) -> float:
        """The relative gap between the objective and the solver's bound (0: proven optimal)."""
        return 0.0 if self.objective <= 0 else max(0.0, (self.objective - self.bound) / self.objective)


def _ps(x: float) -> int:
    """Seconds as whole picoseconds, the solver's integer cost unit."""
    return int(round(x * PS_PER_S))


def solve(
    problem: Problem,
    warm_start: Optional[Sequence[int]] = None,
    deterministic_time: float = 30.0,
    time_limit: Optional[float] = None,
) -> Solution:
    """The cheapest choice within the memory budget; raises InfeasibleError if there is none.
    A second, lexicographic solve then keeps the step time and minimises hidden traffic and memory.

    When some tensor has several consumers, the exact model (shared
    reshardings) is solved from the optimum of the same model with every consumer paying its own
    resharding (an upper bound of the evaluator, whose LP is the tight transport one; solved in a
    fraction of the time), or from the warm start if that is cheaper by the evaluator. From a poor warm start
    (a recipe) the exact model's search can take long to find good plans (measured: an MLP on a
    (2, 2) mesh, FEASIBLE and 8% off after 20 s of deterministic time; warm-started, OPTIMAL
    after 0.6 s); a time limit still returns a plan no worse than the warm start."""
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    det = 0.0
    ok = (cp_model.OPTIMAL, cp_model.FEASIBLE)
    stages = []
    if any(len(t) > 1 for t in problem.transfers):
        built, x, primary, _ = formulate(problem, warm_start, shared=False)
        built.minimize(primary)
        model = built.model
        solver = _solver(deterministic_time / 2, time_limit)
        status = solver.solve(model)
        if status not in ok:
            raise InfeasibleError(f"the ILP found no plan ({solver.status_name(status)})")
        det += solver.deterministic_time
        stages.append({"model": "per-consumer reshardings", "status": solver.status_name(status),
                       "deterministic_time": round(solver.deterministic_time, 3)})
        first = _read(solver, x)
        if warm_start is None or _fits_better(problem, first, warm_start):
            warm_start = first

    built, x, primary, secondary = formulate(problem, warm_start, shared=True)
    built.minimize(primary)
    model = built.model
    solver = _solver(max(deterministic_time - det, deterministic_time / 2), time_limit)
    status = solver.solve(model)
    name = solver.status_name(status)
    if status not in ok:
        raise InfeasibleError(f"the ILP found no plan ({name})")
    best, bound = int(round(solver.objective_value)), solver.best_objective_bound
    det += solver.deterministic_time
    choice = _read(solver, x)

    # Lexicographic tie-break: same step time, less hidden traffic and memory.
    if secondary:
        model.ClearHints()
        for i, vars_ in x.items():
            for s, v in vars_.items():
                model.AddHint(v, 1 if choice[i] == s else 0)
        built.linear(primary, hi=best)
        built.minimize(secondary)
        solver2 = _solver(max(1.0, deterministic_time / 4), time_limit)
        if solver2.solve(model) in ok:
            choice = _read(solver2, x)
        det += solver2.deterministic_time
    stats = {
        "solver": "CP-SAT",
        "variables": len(model.Proto().variables),
        "constraints": len(model.Proto().constraints),
        "status": name,
        "wall_time": round(time.perf_counter() - t0, 3),
        "deterministic_time": round(det, 3),
    }
    if stages:
        stats["warm_start"] = stages[0]
    sol = Solution(choice, best / PS_PER_S, bound / PS_PER_S, name, stats)
    stats["gap"] = round(sol.gap, 6)
    return sol


def beaten(problem: Problem, cap: float, deterministic_time: float = 30.0, time_limit: Optional[float] = None) -> bool:
    """Whether CP-SAT proves that no choice within ``problem``'s memory row has a step time of at
    most ``cap`` seconds (the exact model with the step time capped, minimised: the cap prunes
    the search where the plain solve would go on to its optimum). False when it finds one, or
    proves nothing within its limits. The cap is widened by a picosecond per objective term, above
    the model's rounding of each term, so a plan ``evaluate`` prices at ``cap`` is never ruled out."""
    built, _, primary, _ = formulate(problem, None, shared=True)
    built.linear(primary, hi=_ps(cap * (1 + 1e-9)) + len(primary) + 1)
    built.minimize(primary)
    return _solver(deterministic_time, time_limit).solve(built.model) == built.cp_model.INFEASIBLE


def _fits_better(problem: Problem, a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether choice ``a`` is at least as good a start as ``b``: it fits the memory budget and
    is no slower, or ``b`` does not fit."""
    ca, cb = evaluate(problem, a), evaluate(problem, b)
    if cb.peak_memory > problem.memory_budget:
        return True
    return ca.peak_memory <= problem.memory_budget and ca.step_time <= cb.step_time


class ModelBackend(Protocol):
    """The building blocks ``formulate`` writes a model with; ``CpSatModel`` (below) and
    ``solve_axis.HighsModel`` implement them. Linear rows and objectives are lists of
    (coefficient, variable)."""

    def bool(self, name: str) -> Any:
        """A new 0/1 variable (a strategy choice)."""

    def frac(self, name: str) -> Any:
        """A new variable in [0, 1] (a transport; integral once the choices are)."""

    def num(self, upper: float, name: str) -> Any:
        """A new variable in [0, upper] (exposed communication)."""

    def exactly_one(self, vs) -> None:
        """Exactly one of the 0/1 variables ``vs`` is 1."""

    def implies(self, a, b) -> None:
        """``a`` = 1 forces ``b`` = 1."""

    def linear(self, terms, lo=None, hi=None) -> None:
        """lo <= sum(c * v) <= hi (None: unbounded on that side)."""

    def minimize(self, terms) -> None:
        """The objective to minimise."""

    def time(self, seconds: float) -> Any:
        """Seconds in the model's cost unit."""

    def mem(self, nbytes: float) -> Any:
        """Bytes in the model's memory unit."""

    def mem_limit(self, nbytes: float) -> Any:
        """The memory budget in the model's memory unit."""

    def warm_start(self, v, value: int) -> None:
        """Suggest ``value`` for variable ``v`` (a no-op where the solver takes no warm start)."""


class CpSatModel:
    """The formulation's building blocks on CP-SAT (a ``ModelBackend``): every variable integral,
    costs in integer picoseconds, memory in bytes."""

    def __init__(self) -> None:
        from ortools.sat.python import cp_model

        self.cp_model = cp_model
        self.model = cp_model.CpModel()

    def bool(self, name: str):
        return self.model.NewBoolVar(name)

    frac = bool  # transports and shared-resharding indicators: 0/1 in CP-SAT too

    def num(self, upper: float, name: str):
        return self.model.NewIntVar(0, int(upper), name)

    def exactly_one(self, vs) -> None:
        self.model.AddExactlyOne(vs)

    def implies(self, a, b) -> None:
        self.model.AddImplication(a, b)

    def _expr(self, terms):
        return self.cp_model.LinearExpr.WeightedSum([v for _, v in terms], [c for c, _ in terms])

    def linear(self, terms, lo=None, hi=None) -> None:
        """lo <= sum(c * v) <= hi (None: unbounded on that side)."""
        expr = self._expr(terms)
        if lo is not None and hi is not None:
            self.model.Add(expr == lo) if lo == hi else self.model.AddLinearConstraint(expr, lo, hi)
        elif lo is not None:
            self.model.Add(expr >= lo)
        else:
            self.model.Add(expr <= hi)

    def minimize(self, terms) -> None:
        self.model.Minimize(self._expr(terms))

    @staticmethod
    def time(seconds: float) -> int:
        return _ps(seconds)

    @staticmethod
    def mem(nbytes: float) -> int:
        return int(round(nbytes))

    @staticmethod
    def mem_limit(nbytes: float) -> int:
        return int(nbytes)

    def warm_start(self, v, value: int) -> None:
        self.model.AddHint(v, value)


def formulate(problem: Problem, warm_start: Optional[Sequence[int]], shared: bool, m: Optional[ModelBackend] = None):
    """The model on backend ``m`` (default: a new ``CpSatModel``): variables, constraints,
    warm start; returns it with ``x`` and the objective terms as (coefficient, variable) lists
    (primary: step time in the backend's unit; secondary: hidden traffic and memory). ``shared``
    False prices every edge on its own (each consumer pays its resharding)."""
    m = CpSatModel() if m is None else m
    x = _node_vars(m, problem)
    primary: list = []
    secondary: list = []
    for i, n in enumerate(problem.nodes):
        for s, v in x[i].items():
            c = m.time(n.mult * (n.compute[s] + n.comm[s]))
            if c:
                primary.append((c, v))
            mem = int(n.mult * n.mem_total(s) / 1e6)  # MB
            if mem:
                secondary.append((mem, v))
    kept: list = []  # the resharded copies kept for the backward: (bytes, var) for the memory row
    comm = _edge_vars(m, problem, x, primary, secondary, shared, kept)
    _exposed(m, problem, x, comm, primary)
    _memory(m, problem, x, kept)
    if warm_start is not None:
        for i, vars_ in x.items():
            for s, v in vars_.items():
                m.warm_start(v, 1 if warm_start[i] == s else 0)
    return m, x, primary, secondary


def _solver(deterministic_time: float, time_limit: Optional[float]):
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    p = solver.parameters
    p.num_workers = 1
    p.random_seed = 0
    p.max_deterministic_time = deterministic_time
    p.max_time_in_seconds = time_limit if time_limit is not None else 600.0
    p.linearization_level = 2  # the LP of the transport rows is what proves optimality quickly
    p.cp_model_probing_level = 0  # probing costs more than it saves here (measured: 2-4x slower)
    return solver


def _read(solver, x) -> list[int]:
    return [next(s for s, v in x[i].items() if solver.value(v)) for i in range(len(x))]


def _node_vars(m, problem: Problem) -> dict[int, dict[int, object]]:
    """One-hot ``x[n, s]`` over the strategies each node's hints allow."""
    x: dict[int, dict[int, object]] = {}
    for i, n in enumerate(problem.nodes):
        allowed = n.alive()
        x[i] = {s: m.bool(f"x{i}_{s}") for s in allowed}
        m.exactly_one(list(x[i].values()))
    return x


def _marginals(x, node: int, place: list[int]) -> dict[int, list]:
    """Placement index -> the strategy variables of ``node`` that give it."""
    out: dict[int, list] = {}
    for s, v in x[node].items():
        out.setdefault(place[s], []).append(v)
    return out


def _edge_vars(m, problem: Problem, x, objective: list, secondary: list, shared: bool = True,
               kept: Optional[list] = None) -> dict[int, list]:
    """Transport variables per edge (only for edges that can cost something), and per transfer
    whose consumers could share a resharding one indicator ``z`` per paid (source, target)
    placement pair, implied by every edge's transport on that pair. Costs go on the transports of
    a lone edge, on the indicators of a shared transfer; adds the non-overlappable ones to the
    objective and returns, per overlap group, one instance's overlappable terms (seconds, var)."""
    comm: dict[int, list] = {}
    transfers = problem.transfers if shared else [[k] for k in range(len(problem.edges))]
    for t, ks in enumerate(transfers):
        ys: dict[int, dict] = {}
        for k in ks:
            e = problem.edges[k]
            rows = _marginals(x, e.src, e.src_place)
            cols = _marginals(x, e.dst, e.dst_place)
            if all(e.cost[p][q] == 0 for p in rows for q in cols):
                continue
            if len(rows) == 1:  # one source placement: the transport is the consumer's own choice
                ((p, _),) = rows.items()
                ys[k] = {(p, q): vs for q, vs in cols.items()}
                continue
            if len(cols) == 1:  # one target placement: the producer's choice
                ((q, _),) = cols.items()
                ys[k] = {(p, q): vs for p, vs in rows.items()}
                continue
            y = {(p, q): m.frac(f"y{k}_{p}_{q}") for p in rows for q in cols}
            for p, vs in rows.items():
                m.linear([(1, y[p, q]) for q in cols] + [(-1, v) for v in vs], 0, 0)
            for q, vs in cols.items():
                m.linear([(1, y[p, q]) for p in rows] + [(-1, v) for v in vs], 0, 0)
            ys[k] = {pq: [v] for pq, v in y.items()}
        if not ys:
            continue
        k0 = next(iter(ys))
        e0 = problem.edges[k0]
        if len(ys) == 1:  # nothing to share: the edge's transports carry its cost
            paid = [(e0.cost[p][q], v) for (p, q), vs in ys[k0].items() if e0.cost[p][q] for v in vs]
            if kept is not None and e0.saved is not None:  # a resharded copy kept for the backward
                kept.extend((e0.mult * e0.saved[p][q], v) for (p, q), vs in ys[k0].items()
                            if e0.cost[p][q] and e0.saved[p][q] for v in vs)
        else:  # z[p, Q] >= y[e, p, q] for every edge e whose column q is placement Q
            z: dict[tuple, list] = {}
            for k, y in ys.items():
                e = problem.edges[k]
                for (p, q), vs in y.items():
                    c = e.cost[p][q]
                    if not c:
                        continue
                    key = (e.places_out[p], e.places_in[q])
                    if key not in z:
                        z[key] = [m.frac(f"z{t}_{len(z)}"), c, 0.0]
                    z[key][1] = max(z[key][1], c)
                    if e.saved is not None:
                        z[key][2] = max(z[key][2], e.saved[p][q])
                    if len(vs) == 1:
                        m.implies(vs[0], z[key][0])
                    else:
                        m.linear([(1, z[key][0])] + [(-1, v) for v in vs], lo=0)
            paid = [(c, v) for v, c, _ in z.values()]
            if kept is not None:
                kept.extend((e0.mult * b, v) for v, _, b in z.values() if b)
        if not e0.overlappable():
            objective.extend((m.time(e0.mult * c), v) for c, v in paid)
        else:  # tie-break: hidden traffic, in microseconds; one instance's share in the group's row
            secondary.extend((int(e0.mult * c * 1e6), v) for c, v in paid if c * 1e6 >= 1)
            share = e0.mult / problem.groups[e0.group].mult
            comm.setdefault(e0.group, []).extend((share * c, v) for c, v in paid)
    return comm


def _exposed(m, problem: Problem, x, comm: dict[int, list], objective: list) -> None:
    """exposed[g] >= one instance's parameter communication minus its compute, and >= 0.

    A transfer's share of one instance is its total (cost x its multiplicity) over the group's
    multiplicity, exactly as ``problem.evaluate`` counts it. With an overlap slowdown ``s``
    (``Problem.overlap_slowdown``) a group costs ``exposed + s * min(traffic, compute)`` =
    ``(1 - s) exposed + s traffic`` (``problem.overlap_terms``): the row is written for
    ``(1 - s) exposed`` (each coefficient scaled by ``1 - s``, so CP-SAT's integer picoseconds keep
    their precision) and every transport of the group pays ``s`` of its traffic in the objective.
    With ``s`` 0 the model is the one without the term, coefficient for coefficient."""
    keep = 1.0 - problem.overlap_slowdown
    for g, terms in comm.items():
        mult = problem.groups[g].mult
        hide = []
        for i, n in enumerate(problem.nodes):
            if n.group == g:
                hide.extend((m.time(keep * n.compute[s]), v) for s, v in x[i].items() if n.compute[s])
        upper = sum(m.time(keep * c) for c, _ in terms)
        exposed = m.num(upper + 1, f"exposed{g}")
        m.linear([(1, exposed)] + [(-m.time(keep * c), v) for c, v in terms] + hide, lo=0)
        objective.append((mult, exposed))
        if keep < 1.0:
            objective.extend((m.time(mult * (1.0 - keep) * c), v) for c, v in terms if m.time(mult * (1.0 - keep) * c))


def _memory(m, problem: Problem, x, kept: Sequence = ()) -> None:
    """Per-device memory of the choice within the budget (``kept``: the resharded copies kept for
    the backward, ``PEdge.saved``, as (bytes, transport or indicator variable))."""
    terms = []
    for i, n in enumerate(problem.nodes):
        for s, v in x[i].items():
            b = m.mem(n.mult * n.mem_total(s))
            if b:
                terms.append((b, v))
    terms.extend((m.mem(b), v) for b, v in kept if m.mem(b))
    if problem.transients and problem.memory_budget < float("inf"):
        _transients(m, problem, x, terms, kept)
    if terms and problem.memory_budget < float("inf"):
        m.linear(terms, hi=m.mem_limit(problem.memory_budget))


def _transients(m, problem: Problem, x, terms: list, kept: Sequence = ()) -> None:
    """Adds to the memory ``terms`` the largest transient of the choice from the layers' backward
    on (``PNode.transient``; one variable at least every such chosen strategy's bytes), and a row
    of its own for the ops before it (``PNode.head``): the persistent memory less what the layers'
    backward makes (``PNode.deferred``) plus their largest transient (``largest_transient``)."""
    late, head = [], []
    for i, n in enumerate(problem.nodes):
        row = [(m.mem(n.transient[s]), v) for s, v in x[i].items() if n.transient and m.mem(n.transient[s])]
        if row:
            (head if n.head else late).append(row)
    for rows, name in ((late, "transient"), (head, "transient_head")):
        if not rows:
            continue
        top = m.num(max(c for row in rows for c, _ in row) + 1, name)
        for row in rows:
            m.linear([(1, top)] + [(-c, v) for c, v in row], lo=0)
        if rows is late:
            terms.append((1, top))
            continue
        before = [(m.mem(n.mult * (n.mem_total(s) - (n.deferred[s] if n.deferred else 0.0))), v)
                  for i, n in enumerate(problem.nodes) for s, v in x[i].items()]
        before = [(b, v) for b, v in before if b] + [(m.mem(b), v) for b, v in kept if m.mem(b)] + [(1, top)]
        m.linear(before, hi=m.mem_limit(problem.memory_budget))
