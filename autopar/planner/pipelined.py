"""Planning with a pipeline axis: the driver ``plan`` calls for a mesh with a ``pp`` axis (or a pinned
``pipeline=``), on top of the intra-op planning passes.

The model is planned by ``run_passes`` on the mesh without the pipeline axis at a micro-batch's
shape (the batch dimension of every input cut to ``B / m``): one folded solve, which every stage of
alike layers shares. That plan is read back per segment (``search/pipeline_split.py``), the layer
instances are split into stages, and every schedule torch 2.13 runs at that shape is priced by
replay (``cost_model/pipeline_price.py``). Only one micro-batch count is solved first (the pipelined
recipe's, whose shape is solved for the recipe anyway, when it is a candidate; else the middle one);
the others are priced from its segments with the per-micro-batch figures estimated so as to lean
optimistic (``search/pipeline_split.scaled``), and the count that estimate ranks best is then solved
exactly, until the best candidate is an exact one (one or two solves, not one per count). The model
is captured once, at a probe batch, and that graph is re-shaped to each micro-batch size solved
(``planner/captures.at_rows``, ``ir/rebatch.py``); a size whose re-shape cannot be proven is
captured itself. The intra-op solve is first made without a memory budget (the fastest layer plan;
a stage holds only its share of the model); when no pipeline fits so, again within the budget (the
leaner layer plan).

A mesh that names a ``pp`` axis asks for a pipeline: the plan pipelines on it, and the plain
(intra-op) plan of the same devices, where ``pp`` would be one more data or sharding axis, is not
planned (its recomputation search on every axis was most of the time of a large model's plan: 327 of
410 s for LLaMA-3.1-405B on 512 devices). ``baselines["unpipelined"]`` says so; the factorization
search (``Mesh.devices(count, pp=[1, ...])``, ``planner/factorize.py``) is where pipelined and
unpipelined shapes are compared. Without a ``pp`` axis, ``pipeline=`` asks for gradient
accumulation: one stage, ``m`` micro-batches, the parameters' gathers and reductions once per step.

A pipelined ``Plan``'s ``mesh`` is the stage mesh (the other axes, on which its placements,
reshardings and collectives are stated, per micro-batch); ``plan.pipeline`` holds the pipeline axis
and the whole mesh's axes, the schedule, the stages and the priced figures; ``step_time`` and
``peak_memory`` are the pipeline's (see ``cost_model/pipeline_price.py``).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

import torch

from autopar.cost_model.mesh import DP_AXIS, PP_AXIS, Mesh
from autopar.cost_model.pipeline_price import PipelinePrice, p2p_time
from autopar.errors import ArgumentError, InfeasibleError, RecipeError
from autopar.ir.attention_forms import check_forms
from autopar.ir.capture import as_args
from autopar.passes.search.batch_coupled import batch_coupled
from autopar.passes.search.pipeline_split import (ModelSegments, best_pipelines, between_ops, candidates, scaled,
                                                  segments)
from autopar.planner.captures import at_rows
from autopar.planner.intra import Planned, run_passes
from autopar.planner.options import PlanOptions, check_pipeline
from autopar.planner.report import PipelineDecision, build_plan

#: ``baselines["unpipelined"]`` of a plan on a given ``pp`` mesh (see the module docstring)
UNPIPELINED_NOTE = "not planned: a given 'pp' axis pipelines; Mesh.devices(n, pp=[1, ...]) compares it"
#: micro-batch counts tried, as multiples of the pipeline degree (gradient accumulation: as counts)
MICROBATCH_FACTORS = (1, 2, 4)
ACCUMULATION_COUNTS = (2, 4, 8)
#: the pipelined baseline recipe: torchtitan's layout (pipeline over ``pp``, FSDP on the data axis and
#: Megatron TP on the tensor axis of each stage, 1F1B, torchtitan's default micro-batch of one sample per
#: data rank: ``_recipe_count``)
RECIPE = "pp_fsdp_tp"


def wants_pipeline(mesh: Mesh, pipeline: Optional[Mapping]) -> bool:
    """Whether ``plan`` goes through this driver: a ``pp`` axis, or a pinned ``pipeline``."""
    return PP_AXIS in mesh.names or pipeline is not None


def stage_mesh(mesh: Mesh) -> Mesh:
    """The mesh without the ``pp`` axis (its links kept); a pipeline alone gets a one-device axis ``dp``."""
    names = [n for n in mesh.names if n != PP_AXIS]
    if not names:
        return Mesh({DP_AXIS: 1}, device=mesh.hardware)
    return Mesh({n: mesh.axis_size(n) for n in names}, device=mesh.hardware,
                links={n: mesh.link(n) for n in names})


def batch_size(args: tuple, kwargs: Mapping) -> int:
    """The first tensor input's dimension 0 (the batch every input with that leading size shares)."""
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return int(v.shape[0])
    raise ArgumentError("autopar.plan: a pipeline cuts the batch into micro-batches, but no example input is a "
                        "tensor with a batch dimension")


def micro_inputs(args: tuple, kwargs: Mapping, batch: int, m: int) -> tuple[tuple, dict]:
    """Every tensor input whose dimension 0 is ``batch`` cut to its first ``batch // m`` rows."""
    cut = batch // m

    def one(v):
        return v[:cut] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch else v

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


@dataclass
class Staged:
    """A pipeline priced on an exact intra-op plan: its ``price``, stage ``ranges`` (layer instances
    per stage), micro-batch count, the intra-op plan at that count and its segments; ``order``: the
    place it was found in (ties on time and memory go to the earlier)."""

    price: PipelinePrice
    ranges: list[tuple[int, int]]
    microbatches: int
    planned: Planned
    model: ModelSegments
    order: int


@dataclass
class Estimate:
    """A pipeline priced from another count's segments scaled to ``microbatches`` (``scaled``)."""

    price: PipelinePrice
    microbatches: int


@dataclass
class _Solver:
    """What the phases of ``plan_pipelined`` share: the model and its inputs, the stage mesh, the
    options of the intra-op solves, the captures by rows per micro-batch, the phases' seconds."""

    model: object
    sub: Mesh
    args: tuple
    kwargs: dict
    batch: int
    pp: int
    link: object
    budget: float
    options: PlanOptions
    graphs: dict
    phases: dict = field(default_factory=dict)
    #: the step a pipeline must beat to matter (the factorization search's fastest fitting shape so far)
    beat: float = math.inf

    def lap(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.phases[name] = round(self.phases.get(name, 0.0) + now - since, 4)
        return now

    def exact(self, m: int, bounded: bool, recipe: Optional[str] = None) -> tuple[Planned, ModelSegments]:
        """One intra-op plan on the stage mesh at ``m`` micro-batches, read back per segment."""
        t = time.perf_counter()
        margs, mkwargs = micro_inputs(self.args, self.kwargs, self.batch, m)
        rows = self.batch // m
        if rows not in self.graphs:  # one capture for every size: re-shaped from a probe batch (``captures``)
            self.graphs[rows] = at_rows(self.model, self.args, self.kwargs, self.batch, rows,
                                        training=self.options.training, outputs=self.options.capture_outputs)
        t = self.lap("capture", t)
        planned = run_passes(self.model, self.sub, margs, mkwargs,
                             replace(self.options, memory_budget=self.budget if bounded else math.inf,
                                     graph=self.graphs[rows], recipe=recipe))
        for k, v in planned.phases.items():
            if k != "total":
                self.phases[k] = round(self.phases.get(k, 0.0) + v, 4)
        t = self.lap("stage_plans", t)
        # per-stage recomputation is priced from the layer plan without any (the unbounded solve's)
        plain_layers = planned.recompute is None or not planned.recompute.any
        segs = segments(planned.graph, planned.folding, planned.problem, planned.choice, self.sub,
                        planned.precision, planned.terms if plain_layers and recipe is None else ())
        segs = between_ops(segs, planned.peak)  # what a micro-batch holds between its ops
        self.lap("split", t)
        if not segs.units:
            raise ArgumentError("autopar.plan: a pipeline splits the model's repeated layers (numbered modules such "
                                "as layers.0, layers.1, ...) into stages, and this model has none")
        return planned, segs

    def priced(self, segs: ModelSegments, m: int, schedule=None, virtual=None, bounded: bool = True):
        """Every schedule at ``m`` micro-batches priced on ``segs``: within the memory budget (ranks over
        it recompute), or with ``bounded`` false without one (nothing recomputed)."""
        t = time.perf_counter()
        hop = p2p_time(segs.boundary_bytes, self.link) if self.link is not None else 0.0
        out = best_pipelines(segs, self.pp, m, hop, schedule, virtual, self.budget if bounded else None)
        self.lap("split", t)
        return out

    def fastest(self, segs: ModelSegments, m: int, counts: list[int], schedule=None, virtual=None) -> float:
        """The least step any pipeline of this shape could price at, from the fastest layer plan's
        ``segs`` at ``m`` micro-batches: priced without a budget (recomputation and the leaner layer
        plan only add time), the other ``counts`` by the optimistic estimate (``scaled``)."""
        steps = [p.step_time for p, _ in self.priced(segs, m, schedule, virtual, bounded=False)]
        for k in counts:
            if k != m:
                steps += [p.step_time
                          for p, _ in self.priced(scaled(segs, m / k), k, schedule, virtual, bounded=False)]
        return min(steps, default=math.inf)


class NotFaster(Exception):
    """Raised by ``plan_pipelined`` given ``beat``: no pipeline of this shape can be faster than that
    (its message says what the fastest could be); the shape's remaining solves are not made."""


def plan_pipelined(model, mesh: Mesh, example_inputs=(), example_kwargs=None, options: Optional[PlanOptions] = None,
                   *, mesh_search: bool = False, graphs: Optional[dict] = None, beat: float = math.inf):
    """The ``Plan`` for a mesh with a ``pp`` axis or a pinned ``options.pipeline`` (see the module
    docstring). ``mesh_search``: called by the factorization search, which compares the unpipelined
    shapes itself (the plan then carries no note that they were not planned); ``graphs`` (rows per
    micro-batch -> a captured graph) shares captures across calls and is filled with this call's;
    ``beat``: the step time of a fitting plan found already (the search's), where ``NotFaster`` is
    raised once the first solve shows no pipeline of this shape could beat it."""
    start = time.perf_counter()
    options = options if options is not None else PlanOptions()
    pin = dict(options.pipeline or {})  # (checked by ``planner.options.plan_options``)
    _check_options(options, mesh)
    pp = mesh.axis_size(PP_AXIS) if PP_AXIS in mesh.names else 1
    sub = stage_mesh(mesh)
    args = as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    batch = batch_size(args, kwargs)
    solver = _Solver(model, sub, args, kwargs, batch, pp, mesh.link(PP_AXIS) if PP_AXIS in mesh.names else None,
                     options.budget(mesh), options, {} if graphs is None else graphs, beat=beat)
    budget = solver.budget
    counts = _microbatch_counts(pin, batch, pp)
    # The pipelined recipe's count first when it is one of them: its shape is solved for the recipe
    # anyway, so a second solve is paid only if another count might win. Else the middle count. The
    # estimates lean optimistic both ways (``scaled``), so a count they rank worse than an exact
    # candidate would not have won.
    recipe_m = _recipe_count(sub, batch, pp, counts) if not pin and pp > 1 else None
    first = recipe_m if recipe_m in counts else counts[len(counts) // 2]
    found, estimated = _solve_counts(solver, counts, first, pin)
    solved = {f.microbatches for f in found}
    estimated = [e for e in estimated if e.microbatches not in solved]
    tried = [(f.price, False) for f in found] + [(e.price, True) for e in estimated]
    if not found:
        raise ArgumentError(f"autopar.plan: no pipeline schedule runs {pp} stage(s) with micro-batch counts {counts}"
                            + (f" and {pin}" if pin else "") + " (1F1B needs m >= pp, ZBV and Interleaved1F1B two "
                            "stages per rank and at least two layers per rank)")
    recipe_row = None
    if not pin and pp > 1:  # the torchtitan-style pipelined recipe, priced like the search's pipelines
        t = time.perf_counter()
        recipe_row, recipe_found = _pp_recipe(solver, _recipe_count(sub, batch, pp, counts), len(found))
        solver.lap("pp_recipe", t)
        found += recipe_found
    fitting = [f for f in found if f.price.peak_memory <= budget]
    if not fitting:
        raise InfeasibleError(
            f"no pipeline fits the memory budget of {budget / 2**30:.2f} GiB per device: the leanest pipelined plan "
            f"tried needs {min(p.peak_memory for p, _ in tried) / 2**30:.2f} GiB per device (pp={pp}, micro-batches "
            f"{counts}); use more devices, more micro-batches, a smaller batch, or raise memory_budget")
    # the fastest that fits; of equally fast ones the one that needs less memory, then the first found
    best = min(fitting, key=lambda f: (f.price.step_time, f.price.peak_memory, f.order))
    m, planned = best.microbatches, best.planned
    # the recipes priced at the micro-batch's shape on the stage mesh do not compare with a step:
    # the baselines are the whole mesh's (the plain plan's recipes and the plain plan itself)
    baselines = {} if recipe_row is None else {RECIPE: recipe_row}
    if pp > 1 and not mesh_search:  # said in the baselines (and so in the summary): what was not compared, and how to compare it
        baselines = dict(baselines, unpipelined={"error": UNPIPELINED_NOTE})
    coupled = batch_coupled(planned.graph, batch // m)
    if coupled and m > 1:
        warnings.warn(f"autopar.plan: {len(coupled)} op(s) couple the whole batch ({', '.join(coupled[:3])}"
                      f"{', ...' if len(coupled) > 3 else ''}) and run per micro-batch in this pipeline ({m} "
                      f"micro-batches): the plan equals the single-device run of the same micro-batches one after "
                      f"the other, not of the whole batch (plan.pipeline.reference); pin "
                      f"pipeline={{'microbatches': 1}} to keep the whole batch", stacklevel=4)
    choice = PipelineDecision(
        price=best.price, microbatches=m, stages=best.model.stage_paths(best.ranges), mesh=mesh, compared=tried,
        batch_coupled=coupled, budget=budget, baselines=baselines,
        source=f"recipe:{RECIPE}" if planned.source.startswith("recipe:") else planned.source,
        phases=dict(solver.phases, total=round(time.perf_counter() - start, 4)))
    return build_plan(planned, pipeline=choice)


def _check_options(options: PlanOptions, mesh: Mesh) -> None:
    """What a pipeline is not planned with (yet)."""
    if not options.training:
        raise ArgumentError("autopar.plan: a pipeline (a 'pp' mesh axis or pipeline=) is planned for training only; "
                            "plan inference without the pp axis")
    for k in ("recipe", "graph"):
        if getattr(options, k) is not None:
            raise ArgumentError(f"autopar.plan: {k}= is not supported with a pipeline yet (a 'pp' axis or pipeline=); "
                                f"plan without it")
    # hints and attention forms apply to every stage's plan, on the stage mesh (the axes but pp)
    for key, value in (options.hints or {}).items():
        named = [part.split("=")[0].strip() for part in value.split(",")] if isinstance(value, str) else []
        if not named or any("=" not in part for part in value.split(",")) or PP_AXIS in named:
            raise ArgumentError(f"autopar.plan: hints[{key!r}]={value!r}: with a pipeline, hints place tensors on the "
                                f"stage mesh (the axes but '{PP_AXIS}'); name those axes, e.g. 'cp=S(1)'")
    for glob, per_axis in check_forms(options.attention, tuple(mesh.names)).items():
        if PP_AXIS in per_axis:
            raise ArgumentError(f"autopar.plan: attention[{glob!r}] names the pipeline axis '{PP_AXIS}'; attention "
                                "forms apply to the stage mesh's axes (the axes but pp)")
    if options.search != "ilp":
        raise ArgumentError("autopar.plan: a pipeline is planned with search='ilp' only")


def _microbatch_counts(pin: dict, batch: int, pp: int) -> list[int]:
    """The micro-batch counts tried: the pinned one, else those of ``MICROBATCH_FACTORS`` (of
    ``ACCUMULATION_COUNTS`` without a pipeline axis) that divide the batch; an ``ArgumentError`` when
    none is, or when no schedule runs any of them."""
    if "microbatches" in pin:
        counts = [pin["microbatches"]]
        if batch % counts[0]:
            raise ArgumentError(f"autopar.plan: pipeline microbatches={counts[0]} does not divide the batch of {batch}")
    else:
        wanted = [pp * f for f in MICROBATCH_FACTORS] if pp > 1 else list(ACCUMULATION_COUNTS)
        counts = [m for m in wanted if batch % m == 0]
        if not counts:
            raise ArgumentError(f"autopar.plan: the batch of {batch} splits into none of the micro-batch counts "
                                f"{wanted} a pipeline of {pp} stages would use; pin pipeline={{'microbatches': m}}")
    if not any(candidates(pp, m, pin.get("schedule"), pin.get("virtual_stages")) for m in counts):
        raise ArgumentError(f"autopar.plan: no pipeline schedule runs {pp} stage(s) with micro-batch counts {counts}"
                            + (f" and {pin}" if pin else "") + " (1F1B needs m >= pp, ZBV exactly 2 and "
                            "Interleaved1F1B at least 2 stages per rank)")
    return counts


def _solve_counts(solver: _Solver, counts: list[int], first: int, pin: dict) -> tuple[list[Staged], list[Estimate]]:
    """The pipelines of the exact solves and the estimates of the counts not solved. One exact solve at
    ``first``; the other counts are priced from it with the per-micro-batch figures scaled (``scaled``);
    the best count by that estimate is then solved exactly, and so on until the best candidate is an
    exact one: typically one or two solves. First without a memory budget on the intra-op solve (the
    fastest layer plan; a stage holds only its share of the model), and when no pipeline fits so,
    again within it (the leaner layer plan)."""
    schedule, virtual = pin.get("schedule"), pin.get("virtual_stages")
    found: list[Staged] = []
    estimated: list[Estimate] = []
    for bounded in (False, True):
        solved: set[int] = set()
        estimated = []
        m = first
        while m is not None:
            solved.add(m)
            try:
                planned, segs = solver.exact(m, bounded)
            except InfeasibleError:
                planned = None
            if planned is not None and not bounded and len(solved) == 1 and solver.beat < math.inf:
                least = solver.fastest(segs, m, counts, schedule, virtual)
                if least >= solver.beat:
                    raise NotFaster(f"not planned further: its fastest pipeline without a memory budget "
                                    f"({least * 1e3:.1f} ms, the layer plan at m={m}, other counts estimated) is "
                                    f"already slower than a fitting shape")
            if planned is not None:
                for price, ranges in solver.priced(segs, m, schedule, virtual):
                    found.append(Staged(price, ranges, m, planned, segs, len(found)))
                estimated = [e for e in estimated if e.microbatches != m]
                if not estimated and len(solved) == 1:
                    for k in counts:
                        if k not in solved:
                            estimated += [Estimate(price, k)
                                          for price, _ in solver.priced(scaled(segs, m / k), k, schedule, virtual)]
            # (price, count, exact)
            pool = ([(f.price, f.microbatches, True) for f in found]
                    + [(e.price, e.microbatches, False) for e in estimated if e.microbatches not in solved])
            fit = [c for c in pool if c[0].peak_memory <= solver.budget]
            best = min(fit or pool, key=lambda c: (c[0].step_time, not c[2])) if pool else None
            m = best[1] if best is not None and not best[2] else None
            if planned is None and not found and not estimated:  # nothing to estimate from: the next count
                m = next((k for k in counts if k not in solved), None)
        if any(f.price.peak_memory <= solver.budget for f in found):
            break
    return found, estimated


def _recipe_count(sub: Mesh, batch: int, pp: int, counts: list[int]) -> int:
    """``RECIPE``'s micro-batch count: one sample per data rank and micro-batch (torchtitan's default
    micro-batch size of 1), i.e. the batch over the data axes (every stage-mesh axis but the last, the
    tensor axis, when there are two or more), when that divides the batch and is at least ``pp``; else
    the largest count tried."""
    data = math.prod(sub.shape[:-1]) if sub.ndim >= 2 else sub.size
    m = batch // data if batch % data == 0 else 0
    return m if m >= pp else max(counts)


def _pp_recipe(solver: _Solver, m: int, order: int) -> tuple[dict, list[Staged]]:
    """``RECIPE`` priced at ``m`` micro-batches: its baseline row and its candidate (found in place
    ``order``), or an error row (the capture at that shape is shared)."""
    inner = "fsdp_tp" if solver.sub.ndim >= 2 else "fsdp"
    try:
        planned, segs = solver.exact(m, False, recipe=inner)
    except (RecipeError, InfeasibleError, ValueError) as e:
        return {"error": f"{RECIPE}: {e}"}, []
    found = solver.priced(segs, m, "1F1B", 1)
    if not found:
        return {"error": f"{RECIPE}: 1F1B does not run {solver.pp} stages of {len(segs.units)} layers at m={m}"}, []
    price, ranges = found[0]
    row = {"step_time": price.step_time, "peak_memory": int(price.peak_memory),
           "fits": price.peak_memory <= solver.budget}
    return row, [Staged(price, ranges, m, planned, segs, order)]


__all__ = ["ACCUMULATION_COUNTS", "MICROBATCH_FACTORS", "PP_AXIS", "RECIPE", "UNPIPELINED_NOTE",
           "Estimate", "NotFaster", "Staged", "batch_size", "check_pipeline", "micro_inputs", "plan_pipelined",
           "stage_mesh", "wants_pipeline"]
