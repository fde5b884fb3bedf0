"""The intra-op planner: the passes capture, fold, strategies, cost, merge, recipes and solve, in
that order, on one mesh.

``run_passes`` runs them with the ``PlanOptions`` (``planner/options.py``) and returns a ``Planned``
(everything they produced); ``autopar.plan`` hands it to ``planner.report.build_plan`` for the user's
``Plan``. Each stage lives in ``passes.search``; the recipes the search must beat are completed by
``passes.search.complete`` and priced by the same evaluator as the searched plan. The phases are
``_price_recipes``, ``_search`` (the solves, as ``Candidate`` records) and ``_choose``.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from autopar.cost_model.liveness import Peak
from autopar.cost_model.mesh import Mesh, require_mesh
from autopar.cost_model.precision import Precision, get_precision
from autopar.errors import InfeasibleError, RecipeError
from autopar.ir.annotations import dtensor_hints, merge_hints
from autopar.ir.attention_forms import check_forms
from autopar.ir.capture import as_args
from autopar.ir.graph import Graph
from autopar.ir.placement import format_placements
from autopar.ir.recompute import recomputed_ops
from autopar.passes.search import checkpoint, kept, layout, peak, recipes
from autopar.passes.search.build import build_problem
from autopar.passes.search.collector import collector_paused
from autopar.passes.search.complete import complete
from autopar.passes.search.fold import Folding, fold
from autopar.passes.search.forms import apply_forms
from autopar.passes.search.ladder import Solved, leanest, recompute_candidates, solve_choice, solve_walked
from autopar.passes.search.merge import Merged, merge
from autopar.passes.search.problem import MEMORY_KINDS, Cost, Problem, evaluate
from autopar.passes.search.propagate import propagate
from autopar.passes.search.solve import Solution
from autopar.passes.search.strategies import Constraint, balanced_search, resolve_hints, search_strategies
from autopar.planner.captures import capture
from autopar.planner.options import PlanOptions
from autopar.plans.format import human_bytes

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


@dataclass
class Candidate:
    """A plan the planner may choose: a solve's choice (``source`` "search") or a recipe's
    (``source`` "recipe:NAME") priced on that solve's problem (``cost``). Ties on the step time go
    to the lower ``order`` (the solve's place: without recomputation first), then the lower ``rank``
    (the search's own plan, then the recipes by name)."""

    cost: Cost
    order: int
    rank: int
    source: str
    choice: list[int]
    solved: Solved

    @property
    def key(self) -> tuple:
        """What ``_choose`` minimises among the candidates that fit."""
        return (self.cost.step_time, self.order, self.rank)


# Python's cyclic garbage collector is off while the passes run (``search/collector.py``): measured
# in CPU seconds, its collections were a fifth of the torchtitan-style Llama's 32-layer plan
# (LLaMA-3-8B dims, (8, 8); 5.7 s, 4.6 s paused) and a growing share of the post-capture time as
# layers are added (tiny BART: 32 layers over 2, 1.49x with the collector on, 1.38x paused), for 3%
# more peak memory.
@collector_paused()
@balanced_search  # the balanced split Z weighed where it may pay (``passes.search.strategies``)
def run_passes(model, mesh: Mesh, example_inputs=(), example_kwargs=None, options: Optional[PlanOptions] = None) -> Planned:
    """The planning passes with ``options`` (``planner.options.PlanOptions``; default: every default):
    its ``recipe`` fixes that recipe's placements instead of searching; ``checkpointing`` pins the
    recomputation (``passes.search.checkpoint.pinned_checkpointing``) instead of searching it;
    ``kept_gathers`` which layer instances keep their gathered parameters for the backward
    (``passes.search.kept.pinned_kept_gathers``; default: the search keeps them where that is faster
    and fits, a named recipe keeps none); ``graph`` skips the capture; ``compiled`` prices the program
    as Inductor compiles it (``cost_model.fusion``: pointwise chains fused); ``capture_outputs`` and
    ``loss_fn`` are ``ir.capture.capture``'s ``outputs`` and ``loss_fn`` (the model's other outputs in
    the step; the loss of a model that returns logits)."""
    return search_prepared(prepare(model, mesh, example_inputs, example_kwargs, options))


@dataclass
class Prepared:
    """The passes before the search (capture to recipes) on one mesh with ``opts``: the priced
    ``problem`` (and ``merged``), the recipes' ``baselines`` and ``choices``, the walker of their
    peaks, and the seconds per phase so far. ``search_prepared`` finishes it; ``within`` re-budgets it."""

    graph: Graph
    mesh: Mesh
    opts: PlanOptions
    folding: Folding
    problem: Problem
    merged: Merged
    precision: Precision
    ops: dict[str, str]
    walk: peak.Walker
    baselines: dict[str, dict]
    choices: dict[str, list[int]]
    phases: dict[str, float]
    progress: bool
    #: the search's solve without the budget, once made: ``(solution, choice)`` (see ``within``)
    unbudgeted: Optional[tuple] = None


@collector_paused()
def prepare(model, mesh: Mesh, example_inputs=(), example_kwargs=None,
            options: Optional[PlanOptions] = None) -> Prepared:
    """``run_passes``' passes up to the search (capture, fold, strategies, cost, merge, recipes)."""
    require_mesh(mesh)
    opts = options if options is not None else PlanOptions()
    clock = _Clock(sys.stderr.isatty() if opts.progress is None else opts.progress)
    example_inputs = as_args(example_inputs)
    # parameters and inputs that already are DTensors keep their placements (hard, like hints)
    placed = dtensor_hints(model, tuple(example_inputs), example_kwargs or {}, mesh.shape)
    hints = merge_hints(opts.hints, placed)
    graph = opts.graph
    if graph is None:
        graph = capture(model, tuple(example_inputs), example_kwargs, training=opts.training,
                        outputs=opts.capture_outputs, loss_fn=opts.loss_fn, planning=True)
    clock.lap("capture")
    folding = fold(graph)
    clock.lap("fold")
    constraints = resolve_hints(graph, mesh, hints)
    strategies = {n.name: search_strategies(graph, n, mesh) for n in graph.nodes
                  if folding.representative(n.name) == n.name}
    clock.lap("strategies")
    prec = get_precision(opts.precision, mesh.hardware, opts.optimizer)
    budget = opts.budget(mesh)
    problem = build_problem(graph, mesh, folding, strategies, prec, budget, constraints, compiled=opts.compiled)
    apply_forms(graph, mesh, folding, problem, check_forms(opts.attention, mesh.names))
    clock.lap("cost")
    ops = {n.name: n.op for n in graph.nodes}
    merged = merge(problem, ops)
    clock.lap("merge")

    walk = peak.Walker(graph, mesh, prec, folding)
    baselines, choices = _price_recipes(graph, mesh, problem, merged, constraints, placed, opts, walk)
    clock.lap("recipes")
    return Prepared(graph, mesh, opts, folding, problem, merged, prec, ops, walk, baselines, choices,
                    dict(clock.phases), clock.progress)


def within(prep: Prepared, memory_budget: float) -> Prepared:
    """``prep`` as ``prepare`` makes it with ``memory_budget`` instead: nothing before the search
    depends on the budget but the problem's budget row and whether each recipe fits, and the
    search's solve without the budget is made once for both (the factorization search plans each
    shape without the budget first: ``search_prepared`` of ``prep`` first, then of this, shares it)."""
    opts = replace(prep.opts, memory_budget=memory_budget)
    budget = opts.budget(prep.mesh)
    problem = replace(prep.problem, memory_budget=budget)
    merged = replace(prep.merged, problem=replace(prep.merged.problem, memory_budget=budget))
    baselines = {name: b if "error" in b else
                 {**b, "fits": prep.walk(prep.problem, prep.choices[name]).peak_memory <= budget}
                 for name, b in prep.baselines.items()}
    return replace(prep, opts=opts, problem=problem, merged=merged, baselines=baselines)


def _unbudgeted(prep: Prepared) -> tuple:
    """The search's solve of ``prep``'s problem without the memory budget (made once)."""
    if prep.unbudgeted is None:
        prep.unbudgeted = solve_choice(prep.merged, prep.problem, prep.choices, prep.mesh, prep.opts.deterministic_time,
                                       prep.opts.time_limit, budget=False)
    return prep.unbudgeted


@collector_paused()
def search_prepared(prep: Prepared, incumbent: float = math.inf) -> Planned:
    """``run_passes``' search of ``prep`` (or the recipe or propagation asked for), the chosen plan's
    kept gathers and walked peak: the ``Planned``. ``incumbent``: the step time of a plan the
    caller has already (the factorization search: its fastest fitting shape); recomputation levels
    that cannot beat it are not solved, and where nothing fits for that a ``Beaten`` error says so."""
    graph, mesh, opts, folding, prec, ops = prep.graph, prep.mesh, prep.opts, prep.folding, prep.precision, prep.ops
    problem, merged, walk, baselines, choices = prep.problem, prep.merged, prep.walk, prep.baselines, prep.choices
    budget = problem.memory_budget
    clock = _Clock(prep.progress)
    clock.phases = dict(prep.phases)
    clock.start -= sum(prep.phases.values())  # (``total``: the preparation's seconds too)
    solution, searched_cost = None, None
    unscaled = problem
    terms = checkpoint.group_terms(graph, folding, problem, mesh, prec) if folding.groups else []
    walk.terms = terms
    pin = checkpoint.pinned_checkpointing(opts.checkpointing, terms)
    keep = kept.pinned_kept_gathers(opts.kept_gathers, [t.paths for t in terms])
    recompute = pin or checkpoint.Choice(tuple("full" for _ in terms), tuple(0 for _ in terms))
    if pin is not None and pin.any:
        problem = checkpoint.with_checkpointing(problem, terms, pin)
        merged = merge(problem, ops)
    if opts.recipe:
        name = layout.recipe_name(opts.recipe)
        choice, source = choices[name], f"recipe:{name}"
    elif opts.search == "propagate":  # the annotations spread through the graph; no ILP
        choice, source = propagate(problem), "propagate"
    else:
        plain = Solved(recompute, problem, merged, None, None)
        # (the solve without the budget is ``prep``'s own unless a pinned recomputation re-priced it)
        candidates = _search(plain, choices, ops, clock, mesh, opts, terms if pin is None else [], walk,
                             (lambda: _unbudgeted(prep)) if problem is prep.problem else None, incumbent)
        best = _choose(candidates, budget, graph, problem, unscaled, terms, pin is None, incumbent)
        source, choice, solved = best.source, best.choice, best.solved
        recompute, problem, merged = solved.recompute, solved.problem, solved.merged
        # (a recipe that won keeps the solver's figures and the cost of the search's plan of its solve)
        solution = solved.solution
        searched_cost = next((c.cost for c in candidates if c.source == "search" and c.solved is solved), None)
    kept_paths, kept_terms, problem = _keep(graph, folding, problem, choice, mesh, prec, terms, recompute,
                                            [[] for _ in terms] if keep is None and opts.recipe else keep)
    top = walk.peak(problem, choice, recompute, [p for ps in kept_paths for p in ps])
    if any(kept_paths) and top.peak > budget:  # the kept gathers do not fit (the walked peak)
        plain_peak = walk.peak(problem, choice, recompute)
        if keep is not None and plain_peak.peak <= budget:  # pinned: say so
            raise _kept_over(kept_paths, top.peak, budget)
        kept_paths, kept_terms, problem = _keep(graph, folding, problem, choice, mesh, prec, terms, recompute,
                                                [[] for _ in terms])
        top = plain_peak
    cost = peak.with_peak(evaluate(problem, choice), top)
    clock.lap("solve")
    clock.phases["total"] = round(time.perf_counter() - clock.start, 4)
    return Planned(graph, mesh, folding, problem, merged, prec, choice, cost, source, solution, baselines,
                   choices, clock.phases, searched_cost, recompute, terms, unscaled, kept_paths, kept_terms, top)


def _price_recipes(graph: Graph, mesh: Mesh, problem: Problem, merged: Merged, constraints: list[Constraint],
                   placed: dict, opts: PlanOptions, walk: peak.Walker) -> tuple[dict[str, dict], dict[str, list[int]]]:
    """Each recipe's placements completed and priced (only ``opts.recipe`` when one is asked for):
    ``(baselines, choices)``, its figures (or why it was not priced) and its choice per recipe, its
    peak walked (``walk``)."""
    recipe = opts.recipe  # a name, or a ``Layout`` (``passes.search.layout``): the user's own
    names = [recipe] if recipe else list(recipes.NAMES)
    baselines: dict[str, dict] = {}
    choices: dict[str, list[int]] = {}
    budget = problem.memory_budget
    for entry in names:
        name = layout.recipe_name(entry)
        try:
            allowed = layout.recipe_constraints(graph, mesh, entry, opts.tensor_axis)
            _check_recipe_hints(graph, name, allowed, constraints, bool(recipe), {f"hints[{k!r}]" for k in placed})
            # the exact ILP completion only for a recipe asked for by name: as a baseline for the
            # search, greedy plus local search (the search's ILP starts from the best baseline)
            pinned = layout.recipe_pinned(mesh, entry, opts.tensor_axis)
            regions = layout.recipe_regions(graph, entry) if pinned else None
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
    return baselines, choices


def _search(plain: Solved, choices: dict[str, list[int]], ops: dict[str, str], clock: "_Clock", mesh: Mesh,
            opts: PlanOptions, terms: list[checkpoint.GroupTerms], walk: peak.Walker,
            unbudgeted: Optional[Callable[[], tuple]] = None, incumbent: float = math.inf) -> list[Candidate]:
    """The search's solves of ``plain.problem`` and the recipes priced on each, as candidates. First
    without the budget: a plan that fits so is the best of every choice (recomputing only adds time),
    and the budgeted solve and the recomputation are skipped. Else within the budget (no solve when
    even the leanest plan is over it), then, with ``terms`` (recomputation not pinned), plans that
    recompute (``passes.search.ladder.recompute_candidates``; those that cannot beat ``incumbent``
    not solved). ``unbudgeted()``: the solve without the
    budget when already made or shared (``_unbudgeted``)."""
    problem, merged = plain.problem, plain.merged
    args = (mesh, opts.deterministic_time, opts.time_limit)
    solution, searched = (unbudgeted() if unbudgeted is not None else
                          solve_choice(merged, problem, choices, *args, budget=False))
    found = [replace(plain, solution=solution, choice=searched)]
    over = searched is None or walk(problem, searched, plain.recompute).peak_memory > problem.memory_budget
    if over:  # the budgeted solve's linear budget lowered until its walked peak fits
        solution, searched = (solve_walked(merged, problem, choices, args, problem.memory_budget,
                                           lambda c: walk(problem, c, plain.recompute).peak_memory)
                              if leanest(problem) <= problem.memory_budget else (None, None))
        found = [replace(plain, solution=solution, choice=searched)]
    if over and terms:
        # the fastest fitting plan so far (its walks are the candidates' below): what recomputing must beat
        plain_costs = [walk(problem, c, plain.recompute) for c in [searched, *choices.values()] if c is not None]
        incumbent = min([c.step_time for c in plain_costs if c.peak_memory <= problem.memory_budget] + [incumbent])
        found += recompute_candidates(problem, terms, choices, ops, clock.progress, *args, walk=walk,
                                      incumbent=incumbent)
    candidates = []
    for order, solved in enumerate(found):
        if solved.choice is not None:
            candidates.append(Candidate(walk(solved.problem, solved.choice, solved.recompute), order, 0, "search",
                                        solved.choice, solved))
        for k, name in enumerate(sorted(choices)):
            candidates.append(Candidate(walk(solved.problem, choices[name], solved.recompute), order, 1 + k,
                                        f"recipe:{name}", choices[name], solved))
    return candidates


def _choose(candidates: list[Candidate], budget: float, graph: Graph, problem: Problem, unscaled: Problem,
            terms: list[checkpoint.GroupTerms], searched: bool, incumbent: float = math.inf) -> Candidate:
    """The fastest candidate that fits (``Candidate.key``); an ``InfeasibleError`` saying what the
    leanest plan would need when none fits (``searched``: the recomputation was the search's to choose),
    or a ``Beaten`` one where the caller's ``incumbent`` kept the search from solving every level."""
    fits = [c for c in candidates if c.cost.peak_memory <= budget]
    if not fits and incumbent < math.inf and terms and searched:
        raise Beaten(f"no plan found within the memory budget of {human_bytes(budget)} as fast as "
                     f"{incumbent * 1e3:.1f} ms (a plan already found): the recomputation levels that could "
                     f"not beat it were not solved")
    if not fits:
        raise _infeasible(graph, problem, budget, terms, unscaled, searched)
    return min(fits, key=lambda c: c.key)


class Beaten(InfeasibleError):
    """No plan fits among those the search made, and the recomputation levels it did not solve
    (``search_prepared``'s ``incumbent``) could not have been faster than the caller's plan."""


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


def _leanest_parts(graph: Graph, problem: Problem) -> tuple[dict[str, float], str]:
    """The leanest plan of ``problem`` by memory kind, and its five largest tensors by user name.

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
    return need, top


def _infeasible(graph: Graph, problem: Problem, budget: float, terms: Optional[list[checkpoint.GroupTerms]] = None,
                unscaled: Optional[Problem] = None, searched: bool = True) -> InfeasibleError:
    """No plan fits: state the smallest per-device memory any plan the search could choose needs,
    and what dominates it. ``unscaled``: the problem priced without recomputation (default
    ``problem``). ``searched``: the search chooses the recomputation, so the leanest plan recomputes
    every layer instance but the last where that lowers it; else ``problem``'s own (pinned) stands."""
    deepest = max((t.count for t in terms or ()), default=0)
    recomputed = None
    if deepest > 1:  # what recomputing every layer instance but the last could save at best
        base = unscaled if unscaled is not None else problem
        tried = [checkpoint.with_checkpointing(base, terms, checkpoint.levels(terms, m, deepest - 1))
                 for m in checkpoint.MODES]
        least, k = min((leanest(q), k) for k, q in enumerate(tried))
        recomputed = tried[k]
    plain = leanest(problem)
    lowered = searched and recomputed is not None and least < plain
    need, top = _leanest_parts(graph, recomputed if lowered else problem)
    total = sum(need.values())
    state = need["params"] + need["grads"] + need["optimizer"]
    too_big = (f", and the model state alone (parameters, gradients, optimizer) needs {human_bytes(state)}"
               if state > budget else "")
    if recomputed is None:
        recompute = " The model has no repeated layers to recompute." if terms is not None else ""
    elif not searched:
        recompute = (f" checkpointing= fixes what is recomputed; with every layer recomputed the leanest plan "
                     f"would need {human_bytes(least)}{too_big}.")
    else:
        verdict = "cannot help" if least > budget else "was tried"
        recompute = (f" Recomputing activations {verdict}: with every layer recomputed the leanest plan needs "
                     f"{human_bytes(least)}" + (f", against {human_bytes(plain)} without" if lowered else "")
                     + f"{too_big}.")
    return InfeasibleError(
        f"no plan fits the memory budget of {human_bytes(budget)} per device: the leanest possible plan needs "
        f"{human_bytes(total)} per device" + (" recomputing activations" if lowered else "")
        + f" (params {human_bytes(need['params'])}, grads {human_bytes(need['grads'])}, "
        f"optimizer {human_bytes(need['optimizer'])}, activations {human_bytes(need['activations'])}); "
        f"largest tensors at their leanest placement: {top}.{recompute} Use more devices, a smaller batch, or raise "
        f"memory_budget."
    )


__all__ = ["Beaten", "Candidate", "Planned", "Prepared", "Solved", "prepare", "run_passes", "search_prepared", "within"]
