"""The planning pipeline: capture, fold, strategies, cost, merge, recipes, solve, in that order.

``run_passes`` runs them and returns a ``Planned`` (everything they produced); ``autopar.plan`` hands
it to ``passes.report.build_plan`` for the user's ``Plan``. Each stage lives in ``passes.search``;
the recipes the search must beat are completed by ``passes.search.complete`` and priced by the same
evaluator as the searched plan.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from autopar.cost_model.liveness import Peak
from autopar.cost_model.mesh import Mesh, require_mesh
from autopar.cost_model.precision import Precision, get_precision
from autopar.errors import InfeasibleError, RecipeError
from autopar.ir.annotations import dtensor_hints, merge_hints
from autopar.ir.capture import as_args, capture
from autopar.ir.graph import Graph
from autopar.ir.placement import format_placements
from autopar.ir.recompute import recomputed_ops
from autopar.passes.search import checkpoint, kept, peak, recipes
from autopar.passes.search.build import build_problem
from autopar.passes.search.collector import collector_paused
from autopar.passes.search.complete import complete
from autopar.passes.search.fold import Folding, fold
from autopar.passes.search.merge import Merged, merge
from autopar.passes.search.problem import MEMORY_KINDS, Cost, Problem, evaluate
from autopar.passes.search.propagate import propagate
from autopar.passes.search.solve import Solution, greedy, solve
from autopar.passes.search.solve_axis import FULL_ILP_LIMIT, edge_var_count, solve_by_axis
from autopar.passes.search.strategies import Constraint, resolve_hints, search_strategies
from autopar.plans.format import human_bytes

#: The memory budget when none is given: this fraction of the device's memory. The other 15% is
#: the headroom a job on the device needs beyond the tensors the plan prices: the caching
#: allocator's fragmentation (what it reserves over what is allocated, commonly 5-10% of the peak),
#: the communication library's own buffers (NCCL keeps a few MiB per channel and peer for each
#: communicator: about 1-2 GiB with a data, a tensor and a pipeline axis), and the CUDA context,
#: kernel images and library workspaces (about 1 GiB). On an 80 GB device that leaves 12 GB.
DEFAULT_BUDGET_FRACTION = 0.85


@dataclass
class Planned:
    """Everything the passes produced, for the report (and for tests): the graph, its folding, the
    priced ``Problem`` and its merged form, the chosen strategy per problem node (``choice``) with
    its ``cost``, where it came from (``source``: "search", "recipe:NAME" or "propagate"), the
    solver's ``solution``, every recipe's baseline figures and choice, seconds per phase, and the
    search's own plan's cost (``searched``: None when no search ran), which a recipe may beat."""

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
    searched: Optional[Cost] = None
    recompute: Optional[checkpoint.Choice] = None  # what the plan recomputes (``problem`` is priced with it)
    terms: list[checkpoint.GroupTerms] = field(default_factory=list)
    unscaled: Optional[Problem] = None  # ``problem`` priced without recomputation
    #: per folded group, the instances whose gathered parameters are kept for the backward
    #: (``problem`` is priced with them) and what keeping costs and saves (``passes.search.kept``)
    kept_paths: list[list[str]] = field(default_factory=list)
    kept_terms: list[kept.GroupKept] = field(default_factory=list)
    #: the walked peak of the chosen plan (``cost.memory`` is its parts; ``passes.search.peak``)
    peak: Optional[Peak] = None


class _Clock:
    """Seconds per planning phase, printed as each ends when ``progress`` is on."""

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


# Python's cyclic garbage collector is off while the passes run (``search/collector.py``): measured
# in CPU seconds, its collections were a fifth of the torchtitan-style Llama's 32-layer plan
# (LLaMA-3-8B dims, (8, 8); 5.7 s, 4.6 s paused) and a growing share of the post-capture time as
# layers are added (tiny BART: 32 layers over 2, 1.49x with the collector on, 1.38x paused), for 3%
# more peak memory.
@collector_paused()
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
    checkpointing: checkpoint.Pin = None,
    kept_gathers: kept.Pin = None,
) -> Planned:
    """The planning passes; ``recipe`` fixes that recipe's placements instead of searching;
    ``checkpointing`` pins the recomputation (``passes.search.checkpoint.pinned``) instead of
    searching it; ``kept_gathers`` which layer instances keep their gathered parameters for the
    backward (``passes.search.kept.pinned``; default: the search keeps them where that is faster
    and fits, a named recipe keeps none)."""
    require_mesh(mesh)
    clock = _Clock(sys.stderr.isatty() if progress is None else progress)
    example_inputs = as_args(example_inputs)
    # parameters and inputs that already are DTensors keep their placements (hard, like hints)
    placed = dtensor_hints(model, tuple(example_inputs), example_kwargs or {}, mesh.shape)
    hints = merge_hints(hints, placed)
    if graph is None:
        graph = capture(model, tuple(example_inputs), example_kwargs, training=training)
    clock.lap("capture")
    folding = fold(graph)
    clock.lap("fold")
    constraints = resolve_hints(graph, mesh, hints)
    strategies = {n.name: search_strategies(graph, n, mesh) for n in graph.nodes
                  if folding.representative(n.name) == n.name}
    clock.lap("strategies")
    prec = get_precision(precision, mesh.hardware, optimizer)
    budget = float(memory_budget) if memory_budget is not None else DEFAULT_BUDGET_FRACTION * mesh.hardware.memory
    problem = build_problem(graph, mesh, folding, strategies, prec, budget, constraints)
    clock.lap("cost")
    ops = {n.name: n.op for n in graph.nodes}
    merged = merge(problem, ops)
    clock.lap("merge")

    walks: dict[tuple, tuple[Problem, Cost]] = {}  # a recipe is a baseline and a candidate: walked once

    def walk(prob: Problem, choice: list[int], rc: Optional[checkpoint.Choice] = None,
             keep_paths: Sequence[str] = ()) -> Cost:  # the choice's cost with its walked peak
        # (``terms``, the layer groups' recomputation, is set below, before anything recomputes)
        key = (id(prob), tuple(choice), rc if rc is not None and rc.any else None, tuple(keep_paths))
        if key not in walks:
            paths = checkpoint.checkpointed_paths(terms, rc) if rc is not None and rc.any else None
            walks[key] = (prob, peak.walked(graph, mesh, prec, folding, prob, choice, paths, keep_paths))  # (held)
        return walks[key][1]

    names = [recipe] if recipe else list(recipes.NAMES)
    baselines: dict[str, dict] = {}
    choices: dict[str, list[int]] = {}
    for name in names:
        try:
            allowed = recipes.constraints(graph, mesh, name, tensor_axis)
            _check_recipe_hints(graph, name, allowed, constraints, bool(recipe), {f"hints[{k!r}]" for k in placed})
            # the exact ILP completion only for a recipe asked for by name: as a baseline for the
            # search, greedy plus local search (the search's ILP starts from the best baseline)
            pinned = recipes.pinned_axes(mesh, name, tensor_axis)
            regions = recipes.tensor_regions(graph, name) if pinned else None
            choice = complete(merged, problem, allowed, pinned, exact=bool(recipe), regions=regions,
                              label=graph.user_name)
        except (RecipeError, InfeasibleError, ValueError) as e:
            if recipe:
                raise
            baselines[name] = {"error": str(e)}
            continue
        cost = walk(problem, choice)
        choices[name] = choice
        baselines[name] = {"step_time": cost.step_time, "peak_memory": int(cost.peak_memory),
                           "fits": cost.peak_memory <= budget}
    clock.lap("recipes")

    solution, searched_cost = None, None
    unscaled = problem
    terms = checkpoint.group_terms(graph, folding, problem, mesh, prec) if folding.groups else []
    pin = checkpoint.pinned(checkpointing, terms)
    keep = kept.pinned(kept_gathers, [t.paths for t in terms])
    recompute = pin or checkpoint.Choice(tuple("full" for _ in terms), tuple(0 for _ in terms))
    if pin is not None and pin.any:
        problem = checkpoint.with_checkpointing(problem, terms, pin)
        merged = merge(problem, ops)
    if recipe:
        choice, source = choices[recipe], f"recipe:{recipe}"
    elif search == "propagate":  # the annotations spread through the graph; no ILP
        choice, source = propagate(problem), "propagate"
    else:
        search_args = (mesh, deterministic_time, time_limit)
        # first without the budget: a plan that fits so is the best of every choice (recomputing
        # only adds time), and planning costs what it did before checkpointing was searched
        solution, searched = _solve(merged, problem, choices, *search_args, budget=False)
        found = [(recompute, problem, merged, solution, searched)]
        over = searched is None or walk(problem, searched, recompute).peak_memory > budget
        if over:  # (no solve when even the leanest plan is over the budget)
            solution, searched = (_solve_fitting(merged, problem, choices, search_args, budget,
                                                 lambda c: walk(problem, c, recompute).peak_memory)
                                  if leanest(problem) <= budget else (None, None))
            found = [(recompute, problem, merged, solution, searched)]
        if over and pin is None and terms:
            found += _recompute_candidates(problem, terms, choices, ops, clock, *search_args, walk=walk)
        candidates = []
        for order, (rc, prob, mrg, sol, chosen) in enumerate(found):
            if chosen is not None:
                candidates.append((walk(prob, chosen, rc), order, 0, "search", chosen, rc, prob, mrg, sol))
            for k, name in enumerate(sorted(choices)):
                candidates.append((walk(prob, choices[name], rc), order, 1 + k, f"recipe:{name}", choices[name],
                                   rc, prob, mrg, None))
        fits = [c for c in candidates if c[0].peak_memory <= budget]
        if not fits:
            raise _infeasible(graph, problem, budget, terms)
        best = min(fits, key=lambda c: (c[0].step_time, c[1], c[2]))
        _, _, _, source, choice, recompute, problem, merged, solution = best
        if solution is None:  # a recipe won: the search's figures are those of its own plan at that choice
            solution = next((c[8] for c in candidates if c[3] == "search" and c[5] == recompute), None)
        searched_cost = next((c[0] for c in candidates if c[3] == "search" and c[5] == recompute), None)
    kept_paths, kept_terms, problem = _keep(graph, folding, problem, choice, mesh, prec, terms, recompute,
                                            [[] for _ in terms] if keep is None and recipe else keep)
    paths = checkpoint.checkpointed_paths(terms, recompute) if recompute.any else None
    top = peak.choice_peak(graph, mesh, prec, folding, problem, choice, paths, [p for ps in kept_paths for p in ps])
    if any(kept_paths) and top.peak > budget:  # the kept gathers do not fit (the walked peak)
        plain = peak.choice_peak(graph, mesh, prec, folding, problem, choice, paths)
        if keep is not None and plain.peak <= budget:  # pinned: say so
            raise _kept_over(kept_paths, top.peak, budget)
        kept_paths, kept_terms, problem = _keep(graph, folding, problem, choice, mesh, prec, terms, recompute,
                                                [[] for _ in terms])
        top = plain
    cost = peak.with_peak(evaluate(problem, choice), top)
    clock.lap("solve")
    clock.phases["total"] = round(time.perf_counter() - clock.start, 4)
    return Planned(graph, mesh, folding, problem, merged, prec, choice, cost, source, solution, baselines,
                   choices, clock.phases, searched_cost, recompute, terms, unscaled, kept_paths, kept_terms, top)


def _keep(graph: Graph, folding: Folding, problem: Problem, choice: list[int], mesh: Mesh, prec: Precision,
          terms: list[checkpoint.GroupTerms], recompute: checkpoint.Choice, keep: Optional[list[list[str]]]):
    """Which instances keep their gathered parameters at the chosen placements (``keep``: pinned;
    None: chosen, ``kept.choose``), and the problem priced with them: ``(kept paths per group, the
    groups' terms, problem)``. After the solve: see ``passes.search.kept`` for why."""
    if not terms or not graph.training:
        return [[] for _ in terms], [], problem
    redo = recomputed_ops(graph, checkpoint.checkpointed_paths(terms, recompute))
    found = kept.group_kept(graph, folding, problem, choice, mesh, prec, redo)
    if keep is None:
        counts = kept.choose(problem, found, choice)
        keep = [list(t.paths) if k else [] for t, k in zip(found, counts)]
    keep = [paths if t.holder >= 0 else [] for t, paths in zip(found, keep)]  # (nothing gathered: nothing kept)
    priced = kept.with_kept(problem, found, [len(p) for p in keep], choice)
    need = evaluate(priced, choice).peak_memory
    if need > problem.memory_budget >= evaluate(problem, choice).peak_memory:
        raise _kept_over(keep, need, problem.memory_budget)
    return keep, found, priced


def _kept_over(keep: list[list[str]], need: float, budget: float) -> InfeasibleError:
    return InfeasibleError(f"kept_gathers: keeping the gathered parameters of {', '.join(p for g in keep for p in g)} "
                           f"needs {human_bytes(need)} per device, over the memory budget of {human_bytes(budget)}: "
                           f"keep fewer layers or raise memory_budget")


def _solve_fitting(merged: Merged, problem: Problem, choices: dict[str, list[int]], search_args: tuple,
                   budget: float, peak_of):
    """``_solve`` with the budget, its linear memory budget lowered until the walked peak
    (``peak_of``) of its plan fits (``passes.search.peak.solve_fitting``)."""
    return peak.solve_fitting(lambda lower: _solve(merged, problem, choices, *search_args, budget=True, lower=lower),
                              peak_of, problem, budget)


def _solve(merged: Merged, problem: Problem, choices: dict[str, list[int]], mesh: Mesh,
           deterministic_time: float, time_limit: Optional[float], budget: bool, lower: float = 0.0):
    """The search's plan of ``problem`` (``(solution, choice)``; ``(None, None)`` when the solver finds
    none), warm-started from the best recipe (the best that fits, with the budget), without the
    memory budget unless ``budget`` (lowered by ``lower`` bytes: the transient memory the linear
    form does not see)."""
    fitting = [n for n in choices if evaluate(problem, choices[n]).peak_memory <= problem.memory_budget]
    pool = fitting if budget and fitting else list(choices)
    starts = sorted(pool, key=lambda n: (evaluate(problem, choices[n]).step_time, n))
    start = choices[starts[0]] if starts else greedy(problem)
    limit = merged.problem.memory_budget - lower if budget else math.inf
    target = merged.problem if budget and not lower else Problem(
        merged.problem.nodes, merged.problem.edges, merged.problem.groups, limit, merged.problem.overlap_slowdown)
    warm_start = [start[i] for i in merged.keep]
    try:
        if edge_var_count(target) <= FULL_ILP_LIMIT or mesh.ndim == 1:
            solution = solve(target, warm_start, deterministic_time, time_limit)
        else:
            solution = solve_by_axis(target, warm_start, mesh.ndim, 2, time_limit)
    except InfeasibleError:
        return None, None
    return solution, merged.expand(solution.choice, len(problem.nodes))


def _recompute_candidates(problem: Problem, terms: list[checkpoint.GroupTerms], choices: dict[str, list[int]],
                          ops: dict[str, str], clock: "_Clock", mesh: Mesh, deterministic_time: float,
                          time_limit: Optional[float], walk=None) -> list[tuple]:
    """Plans that recompute, for a problem whose best plan does not fit: per mode, from the fewest
    recomputed instances with which any plan fits (the leanest memory is exact and cheap: it is a
    sum over nodes), then more while the plan gets faster. Every candidate is a full solve."""
    top = max(t.count for t in terms)
    out = []
    for mode in checkpoint.MODES:
        priced: dict[int, Problem] = {}

        def at(level: int) -> Problem:
            if level not in priced:
                priced[level] = checkpoint.with_checkpointing(problem, terms, checkpoint.levels(terms, mode, level))
            return priced[level]

        # recomputing the last instance saves nothing (its backward follows at once), so at most top - 1
        ladder = [lv for lv in range(1, top) if leanest(at(lv)) <= problem.memory_budget]
        if not ladder:
            continue
        best_time = math.inf
        trials = _trials(ladder[0], top - 1)
        for level in trials:
            prob, rc = at(level), checkpoint.levels(terms, mode, level)
            merged = merge(prob, ops)
            search_args = (mesh, deterministic_time, time_limit)
            solution, chosen = (_solve_fitting(merged, prob, choices, search_args, problem.memory_budget,
                                               lambda c: walk(prob, c, rc).peak_memory) if walk is not None else
                                _solve(merged, prob, choices, *search_args, budget=True))
            if chosen is None:
                continue
            cost = evaluate(prob, chosen)
            out.append((rc, prob, merged, solution, chosen))
            if clock.progress:
                print(f"autopar: recompute {mode} {level}/{top}: {cost.step_time * 1e3:.1f} ms", file=sys.stderr)
            if cost.step_time >= best_time and len(trials) < len(ladder):
                break  # a sample of many levels: stop where recomputing more stops paying
            best_time = cost.step_time
    return out


def _trials(first: int, last: int) -> list[int]:
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


def _check_recipe_hints(graph: Graph, name: str, allowed: recipes.Allowed, constraints: list[Constraint],
                        asked: bool, dtensors: set[str]) -> None:
    """A recipe that places a hinted tensor otherwise than the hint is not priced: its baseline says
    which hint it conflicts with (pricing it with the hint applied would no longer be the recipe).
    ``asked``: the recipe was asked for by name, so the error also says what to do. ``dtensors``:
    the sources of the hints that are DTensors' own placements."""
    for c in constraints:
        ways = allowed.get(c.ref.node)
        if ways is None or c.placements in ways:
            continue
        theirs = " or ".join(format_placements(w) for w in ways)
        what = "the DTensor" if c.source in dtensors else "the hint"
        whose = ("its DTensor placement" if c.source in dtensors else
                 "your hint" if c.source.startswith("hints[") else c.source)
        text = (f"conflicts with {whose} on {graph.user_name(c.ref)}: {name} places it {theirs}, {what} "
                f"{format_placements(c.placements)}")
        if asked:
            fix = "redistribute it" if c.source in dtensors else "drop the hint"
            raise RecipeError(f"the {name} recipe {text}; {fix} or choose another recipe")
        raise RecipeError(text)


def _infeasible(graph: Graph, problem: Problem, budget: float,
                terms: Optional[list[checkpoint.GroupTerms]] = None) -> InfeasibleError:
    """No plan fits: state the smallest per-device memory any plan needs and what dominates it.

    Memory is a sum over nodes with no coupling between them, so the minimum over all plans is
    the sum of every node's leanest strategy — exact, no search needed.
    """
    need = dict.fromkeys(MEMORY_KINDS, 0.0)
    tops = []
    for n in problem.nodes:
        s = min(range(len(n.strategies)), key=lambda k: (n.mem_total(k), k))
        for k in MEMORY_KINDS:
            need[k] += n.mult * n.memory[k][s]
        if n.mem_total(s):
            tops.append((n.mult * n.mem_total(s), n.name, n.mult))
    tops.sort(reverse=True)
    top = ", ".join(f"{graph.user_name(name)} ({human_bytes(b)}" + (f" over {m} layers)" if m > 1 else ")")
                    for b, name, m in tops[:5])
    total = sum(need.values())
    state = need["params"] + need["grads"] + need["optimizer"]
    deepest = max((t.count for t in terms or ()), default=0)
    if deepest > 1:  # what recomputing every layer instance but the last could save at best
        least = min(leanest(checkpoint.with_checkpointing(problem, terms, checkpoint.levels(terms, m, deepest - 1)))
                    for m in checkpoint.MODES)
        verdict = "cannot help" if least > budget else "was tried"
        recompute = (f" Recomputing activations {verdict}: with every layer recomputed the leanest plan "
                     f"needs {human_bytes(least)}" + (f", and the model state alone (parameters, gradients, optimizer) "
                                                      f"needs {human_bytes(state)}" if state > budget else "") + ".")
    else:
        recompute = " The model has no repeated layers to recompute." if terms is not None else ""
    return InfeasibleError(
        f"no plan fits the memory budget of {human_bytes(budget)} per device: the leanest possible plan needs "
        f"{human_bytes(total)} per device (params {human_bytes(need['params'])}, grads {human_bytes(need['grads'])}, "
        f"optimizer {human_bytes(need['optimizer'])}, activations {human_bytes(need['activations'])}); "
        f"largest tensors at their leanest placement: {top}.{recompute} Use more devices, a smaller batch, or raise "
        f"memory_budget."
    )


__all__ = ["DEFAULT_BUDGET_FRACTION", "Planned", "run_passes"]
