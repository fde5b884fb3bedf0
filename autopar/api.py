"""``autopar.plan``: run the passes in order — capture, fold, strategies, cost, merge, solve — and
hand back a Plan (``autopar/plans/schema.py``; assembled in ``autopar/passes/report.py``)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from autopar.cost_model.comm import LOCAL_KINDS, axis_step
from autopar.cost_model.precision import Precision, get_precision
from autopar.ir.annotations import dtensor_hints, merge_hints
from autopar.ir.capture import capture
from autopar.ir.graph import Graph
from autopar.ir.placement import Split
from autopar.mesh import Mesh
from autopar.passes.cost import build_problem
from autopar.passes.fold import Folding, fold
from autopar.passes.merge import Merged, merge
from autopar.passes.propagate import propagate
from autopar.passes.problem import Cost, Problem, evaluate
from autopar.passes.solve import InfeasibleError, Solution, greedy, improve, solve
from autopar.passes.solve_axis import edge_var_count, solve_by_axis
from autopar.passes.strategies import node_strategies, output_placement, resolve_hints

#: Above this many transport variables a multi-axis mesh's ILP is solved one mesh axis at a time
#: (HiGHS rounds, ``passes/solve_axis.py``). Measured: tiny GPT on a (2, 2) mesh (39k transport
#: variables) took CP-SAT 130 s of wall time for its 20 s of deterministic time, still FEASIBLE,
#: where four HiGHS rounds reach a plan 0.8% slower (by the evaluator) in about 3 s.
FULL_ILP_LIMIT = 10_000
DEFAULT_BUDGET_FRACTION = 0.9


@dataclass
class Planned:
    """Everything the passes produced, for the report (and for tests)."""

    graph: Graph
    mesh: Mesh
    folding: Folding
    problem: Problem
    merged: Merged
    precision: Precision
    choice: list[int]
    cost: Cost
    source: str
    solution: Optional[Solution]
    baselines: dict[str, dict]
    recipe_choices: dict[str, list[int]]
    phases: dict[str, float] = field(default_factory=dict)


class _Clock:
    def __init__(self, progress: bool):
        self.t = time.perf_counter()
        self.start = self.t
        self.phases: dict[str, float] = {}
        self.progress = progress

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(now - self.t, 4)
        self.t = now
        if self.progress:
            print(f"autopar: {name:<10} {self.phases[name]:7.2f} s", file=sys.stderr)


def run_passes(
    model,
    mesh: Mesh,
    example_inputs=(),
    example_kwargs=None,
    *,
    training: bool = True,
    hints=None,
    memory_budget: Optional[float] = None,
    time_limit: Optional[float] = None,
    precision=None,
    optimizer: str = "adamw",
    recipe: Optional[str] = None,
    tensor_axis=-1,
    deterministic_time: float = 20.0,
    progress: Optional[bool] = None,
    graph: Optional[Graph] = None,
    search: str = "ilp",
) -> Planned:
    """The planning passes; ``recipe`` fixes that recipe's placements instead of searching."""
    from autopar import recipes as R

    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an autopar.Mesh, got {type(mesh).__name__}")
    clock = _Clock(sys.stderr.isatty() if progress is None else progress)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    # parameters and inputs that already are DTensors keep their placements (hard, like hints)
    hints = merge_hints(hints, dtensor_hints(model, tuple(example_inputs), example_kwargs or {}, mesh.shape))
    if graph is None:
        graph = capture(model, tuple(example_inputs), example_kwargs, training=training)
    clock.lap("capture")
    folding = fold(graph)
    clock.lap("fold")
    constraints = resolve_hints(graph, mesh, hints)
    strategies = {n.name: node_strategies(graph, n, mesh) for n in graph.nodes
                  if folding.representative(n.name) == n.name}
    clock.lap("strategies")
    prec = get_precision(precision, mesh.hardware, optimizer)
    budget = float(memory_budget) if memory_budget is not None else DEFAULT_BUDGET_FRACTION * mesh.hardware.memory
    problem = build_problem(graph, mesh, folding, strategies, prec, budget, constraints)
    clock.lap("cost")
    merged = merge(problem, {n.name: n.op for n in graph.nodes})
    clock.lap("merge")

    names = [recipe] if recipe else list(R.NAMES)
    baselines: dict[str, dict] = {}
    choices: dict[str, list[int]] = {}
    for name in names:
        try:
            allowed = R.constraints(graph, mesh, name, tensor_axis)
            # the weights' column/row descent only for a recipe asked for by name: as a baseline
            # for the search it would cost seconds of planning on large meshes
            pinned = R.pinned_axes(mesh, name, tensor_axis)
            regions = R.tensor_regions(graph, name) if pinned else None
            choice = _complete(merged, problem, allowed, pinned, orient=bool(recipe), regions=regions)
        except (R.RecipeError, InfeasibleError, ValueError) as e:
            if recipe:
                raise
            baselines[name] = {"error": str(e)}
            continue
        cost = evaluate(problem, choice)
        choices[name] = choice
        baselines[name] = {"step_time": cost.step_time, "peak_memory": int(cost.peak_memory),
                           "fits": cost.peak_memory <= budget}
    fitting = [n for n in choices if baselines[n]["fits"]]
    best_recipe = min(fitting or choices, key=lambda n: (baselines[n]["step_time"], n)) if choices else None

    solution = None
    if recipe:
        choice, source = choices[recipe], f"recipe:{recipe}"
    elif search == "propagate":  # the annotations spread through the graph; no ILP
        choice, source = propagate(problem), "propagate"
    else:
        start = choices[best_recipe] if best_recipe else greedy(problem)
        hint = [start[i] for i in merged.keep]
        try:
            if edge_var_count(merged.problem) <= FULL_ILP_LIMIT or mesh.ndim == 1:
                solution = solve(merged.problem, hint, deterministic_time, time_limit)
            else:
                solution = solve_by_axis(merged.problem, hint, mesh.ndim, 2, time_limit)
            searched = merged.expand(solution.choice, len(problem.nodes))
        except InfeasibleError:
            searched = None
        candidates = []
        if searched is not None:
            candidates.append((evaluate(problem, searched), 0, "search", searched))
        for k, name in enumerate(sorted(choices)):
            candidates.append((evaluate(problem, choices[name]), 1 + k, f"recipe:{name}", choices[name]))
        fits = [c for c in candidates if c[0].peak_memory <= budget]
        if not fits:
            raise _infeasible(graph, problem, budget)
        best = min(fits, key=lambda c: (c[0].step_time, c[1]))
        choice, source = best[3], best[2]
    clock.lap("solve")
    cost = evaluate(problem, choice)
    clock.phases["total"] = round(time.perf_counter() - clock.start, 4)
    return Planned(graph, mesh, folding, problem, merged, prec, choice, cost, source, solution, baselines,
                   choices, clock.phases)


#: Seconds added to a forbidden resharding while completing a recipe (far above any real step).
FORBIDDEN = 1e3


def _complete(merged: Merged, problem: Problem, allowed: dict, pinned: list[int], orient: bool = False,
              regions=None) -> list[int]:
    """A cheap choice with the placeholders restricted to ``allowed`` placements, and parameters
    used where they lie on the ``pinned`` axes (no gathers there): greedy, then local search.
    With ``orient``, each pinned weight's split is chosen by coordinate descent (``_orient``).
    ``regions`` (``recipes.TensorRegions``): which dims activations may be split along on the
    pinned axes, given the weights' splits."""
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
                    raise InfeasibleError(f"no strategy of {n.name} has the recipe's placement")
                n.allowed = ok
        if not pinned:
            return merged.expand(improve(merged.problem, greedy(merged.problem)), len(problem.nodes))
        best, prefer = _orient(merged, problem, pinned, rounds=2 if orient else 0, regions=regions)
        if orient and edge_var_count(merged.problem) <= FULL_ILP_LIMIT:
            _pin_in_place(merged.problem, pinned, prefer)
            _restrict_to_regions(merged.problem, pinned, regions)
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
    """The recipe's cheapest completion by the ILP, warm-started from the descent's (which it
    replaces only when cheaper): coordinate descent flips one weight at a time, and Megatron's
    pairing of a column-split and a row-split weight is sometimes two flips away."""
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
        outs = {tuple(n.strategies[s][a].outputs[0] for a in pinned) for s in _alive(n)}
        if len(outs) == 1:
            dims = {p.dim for p in outs.pop() if isinstance(p, Split)}
            if len(dims) == 1:
                splits[n.name] = dims.pop()
    ok = regions.allowed(splits)
    for n in mp.nodes:
        if n.name in params or n.name in fixed:
            continue
        dims_of = ok.get(n.name, {})
        keep = [s for s in _alive(n) if not _splits_outside(n.strategies[s], dims_of, pinned)]
        if keep:
            n.allowed = keep


def _alive(n) -> list[int]:
    return n.allowed if n.allowed is not None else list(range(len(n.strategies)))


def _splits_outside(strategy, dims_of: dict[int, set[int]], axes: list[int]) -> bool:
    """Whether ``strategy`` splits some output on one of ``axes`` along a dim not in ``dims_of``."""
    for a in axes:
        for j, p in enumerate(strategy[a].outputs):
            if isinstance(p, Split) and p.dim not in dims_of.get(j, ()):
                return True
    return False


def _orient(merged: Merged, problem: Problem, pinned: list[int], rounds: int = 2,
            regions=None) -> tuple[list[int], dict]:
    """Tensor parallelism with each weight split the way (column or row) that makes the completed
    plan cheapest: Megatron alternates them (a column-split linear feeds a row-split one with no
    collective between them), which no weight sees alone. From every weight's locally preferred
    way (``_pin_in_place``), each weight in turn tries its other ways, the rest completed by
    greedy plus local search, and keeps the cheapest (coordinate descent, until a round changes
    nothing). Returns the choice and each weight's way. With ``regions``, the weights Megatron
    pairs (``TensorRegions.pairs``: a column-split weight feeding a row-split one) lie that way,
    and the descent moves only the others."""
    mp = merged.problem
    base = [n.allowed for n in mp.nodes]
    if regions is not None and rounds:
        ways_of = regions.pairs()
        for i, n in enumerate(mp.nodes):
            if n.name in ways_of:
                keep = [s for s in _alive(n) if all(n.strategies[s][a].outputs[0] == Split(ways_of[n.name])
                                                     for a in pinned)]
                base[i] = keep or base[i]

    def complete(prefer: dict) -> tuple[float, list[int], dict]:
        for n, a in zip(mp.nodes, base):
            n.allowed = a
        ways = _pin_in_place(mp, pinned, prefer)
        _restrict_to_regions(mp, pinned, regions)
        choice = merged.expand(improve(mp, greedy(mp)), len(problem.nodes))
        return evaluate(problem, choice).step_time, choice, ways

    best_t, best, ways = complete({})
    prefer = {src: opts[0] for src, opts in ways.items()}  # opts[0]: the way taken
    try:
        for _ in range(rounds):
            changed = False
            for src, opts in sorted(ways.items()):  # weights and their views
                for opt in opts:
                    if opt == prefer[src]:
                        continue
                    t, choice, _ = complete({**prefer, src: opt})
                    if t < best_t * (1 - 1e-9):
                        best_t, best, prefer[src], changed = t, choice, opt, True
            if not changed:
                break
    finally:
        for n, a in zip(mp.nodes, base):
            n.allowed = a
    return best, prefer


def _in_place(src, dst, pinned: list[int]) -> bool:
    """Whether a tensor placed ``src`` is read as ``dst`` without communication on the pinned axes
    (the same placement, or a local step: slicing a replicated bias is in place)."""
    return all(src[a] == dst[a] or axis_step(src[a], dst[a]) in LOCAL_KINDS for a in pinned)


def _pin_in_place(problem: Problem, pinned: list[int], prefer: Optional[dict] = None) -> dict[int, list]:
    """Megatron's weights are used where they lie on the tensor axis: wherever a parameter (or a
    view of it) has one placement on the ``pinned`` axes, its consumers keep only the strategies
    that read it that way, along the chain of views, until nothing changes. (A penalty alone
    leaves greedy and single-node local search stuck: a weight's forward and backward consumers
    must switch together.) A consumer with no such strategy keeps all of its own.

    ``prefer`` (parameter node index -> placement on the pinned axes) overrides the choice for
    those weights. Returns, per weight that could lie more than one way, its ways (the one taken
    first)."""
    prefer = prefer or {}
    ways: dict[int, list] = {}
    def alive(i: int) -> list[int]:
        return _alive(problem.nodes[i])

    def pinned_out(e, s):
        return tuple(e.places_out[e.src_place[s]][a] for a in pinned)

    def reads(e, s, opt) -> bool:  # consumer strategy s reads the weight placed ``opt`` in place
        have = list(e.places_in[e.dst_place[s]])
        src = list(have)
        for a, p in zip(pinned, opt):
            src[a] = p
        return _in_place(src, have, pinned)

    uses: dict[int, list] = {}
    views = set()  # views of a weight (its transpose in the backward): they follow the weight
    for e in problem.edges:
        if e.kind == "param" and e.dst_slot >= 0:
            uses.setdefault(e.src, []).append(e)
            views.add(e.dst)
    # a weight the recipe lets lie either way (column or row) lies the way most of its consumers
    # can read in place, then the cheaper way for them
    for src, es in sorted(uses.items()):
        if src in views:
            continue
        options = sorted({pinned_out(es[0], s) for s in alive(src)}, key=str)
        if len(options) < 2:
            continue

        def score(opt, es=es):
            readers = [[s for s in alive(e.dst) if reads(e, s, opt)] for e in es]
            cost = sum(min(problem.nodes[e.dst].compute[s] for s in r) for e, r in zip(es, readers) if r)
            return (-sum(1 for r in readers if r), cost)

        best = prefer.get(src)
        if best not in options:
            best = min(options, key=lambda o: (score(o), str(o)))
        ways[src] = [best] + [o for o in options if o != best]
        problem.nodes[src].allowed = [s for s in alive(src) if pinned_out(es[0], s) == best]

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
    return ways


def _infeasible(graph: Graph, problem: Problem, budget: float) -> InfeasibleError:
    """No plan fits: state the smallest per-device memory any plan needs and what dominates it.

    Memory is a sum over nodes with no coupling between them, so the minimum over all plans is
    the sum of every node's leanest strategy — exact, no search needed.
    """
    from autopar.passes.problem import MEMORY_KINDS
    from autopar.plans import human_bytes

    need = dict.fromkeys(MEMORY_KINDS, 0.0)
    tops = []
    for n in problem.nodes:
        s = min(range(len(n.strategies)), key=lambda k: (n.mem_total(k), k))
        for k in MEMORY_KINDS:
            need[k] += n.mult * n.memory[k][s]
        if n.mem_total(s):
            tops.append((n.mult * n.mem_total(s), n.name, n.mult))
    tops.sort(reverse=True)
    names = {v: k for k, v in list(graph.params.items()) + list(graph.buffers.items()) + list(graph.inputs.items())}

    def label(name: str) -> str:
        if name in names:
            return names[name]
        node = graph.node(name)
        return f"{name} ({node.op.replace('aten.', '')} in {node.module_path or '<root>'})"

    top = ", ".join(f"{label(name)} ({human_bytes(b)}" + (f" over {m} layers)" if m > 1 else ")") for b, name, m in tops[:5])
    total = sum(need.values())
    return InfeasibleError(
        f"no plan fits the memory budget of {human_bytes(budget)} per device: the leanest possible plan needs "
        f"{human_bytes(total)} per device (params {human_bytes(need['params'])}, grads {human_bytes(need['grads'])}, "
        f"optimizer {human_bytes(need['optimizer'])}, activations {human_bytes(need['activations'])}); "
        f"largest tensors at their leanest placement: {top}. Use more devices, a smaller batch, or raise memory_budget."
    )


def plan(model, mesh: Mesh, example_inputs=(), example_kwargs=None, *, training: bool = True, hints=None,
         memory_budget=None, time_limit=None, search: str = "ilp", **kw):
    """Plan how to run ``model`` on ``mesh``: the cheapest strategy per op within the memory budget,
    never slower than the best hand-written recipe that fits (see ``autopar.Plan``).

    ``search="propagate"`` skips the ILP: the annotations (``hints``, ``autopar.hint``, DTensor
    parameters and inputs) spread through the graph and the rest takes the cheapest local choice
    (``passes/propagate.py``); the plan's ``source`` is then ``"propagate"`` and it may not fit.
    """
    from autopar.passes.report import build_plan

    if search not in ("ilp", "propagate"):
        raise ValueError(f"search={search!r}: choose 'ilp' (the cheapest plan) or 'propagate' (the annotations "
                         "spread GSPMD-style, the rest chosen locally)")
    planned = run_passes(model, mesh, example_inputs, example_kwargs, training=training, hints=hints,
                         memory_budget=memory_budget, time_limit=time_limit, search=search, **kw)
    return build_plan(planned)
