"""Planning with a pipeline axis: the driver ``plan`` calls for a mesh with a ``pp`` axis (or a pinned
``pipeline=``), on top of the intra-op planning passes.

The model is planned by ``run_passes`` on the mesh without the pipeline axis at a micro-batch's
shape (the batch dimension of every input cut to ``B / m``): one folded solve, which every stage of
alike layers shares. That plan is read back per segment (``search/pipeline_split.py``), the layer
instances are split into stages, and every schedule torch 2.13 runs at that shape is priced by
replay (``cost_model/pipeline.py``). Only one micro-batch count is solved first (the pipelined
recipe's, whose shape is captured for the recipe anyway, when it is a candidate; else the middle one);
the others are priced from its segments with the per-micro-batch figures estimated so as to lean
optimistic (``search/pipeline_split.scaled``), and the count that estimate ranks best is then solved
exactly, until the best candidate is an exact one (one or two solves, not one per count). Each shape is
captured once (the recipe's solve reuses the capture of its shape). The intra-op
solve is first made without a memory budget (the fastest layer plan; a stage holds only its share
of the model); when no pipeline fits so, again within the budget (the leaner layer plan).

A mesh that names a ``pp`` axis asks for a pipeline: the plan pipelines on it, and the plain
(intra-op) plan of the same devices, where ``pp`` would be one more data or sharding axis, is not
planned (its recomputation search on every axis was most of the time of a large model's plan: 327 of
410 s for LLaMA-3.1-405B on 512 devices). ``baselines["unpipelined"]`` says so; the factorization
search (``Mesh.devices(count, pp=[1, ...])``, ``passes/mesh_search.py``) is where pipelined and
unpipelined shapes are compared. Without a ``pp`` axis, ``pipeline=`` asks for gradient
accumulation: one stage, ``m`` micro-batches, the parameters' gathers and reductions once per step.

A pipelined ``Plan``'s ``mesh`` is the stage mesh (the other axes, on which its placements,
reshardings and collectives are stated, per micro-batch); ``plan.pipeline`` holds the pipeline axis
and the whole mesh's axes, the schedule, the stages and the priced figures; ``step_time`` and
``peak_memory`` are the pipeline's (see ``cost_model/pipeline.py``).
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Mapping, Optional

import torch

from autopar.cost_model.mesh import Mesh
from autopar.cost_model.pipeline import p2p_time
from autopar.cost_model.schedules import SCHEDULES, stage_ranks
from autopar.errors import ArgumentError, InfeasibleError, RecipeError
from autopar.ir.capture import as_args
from autopar.ir.stages import param_stages
from autopar.passes.pipeline import DEFAULT_BUDGET_FRACTION, run_passes
from autopar.passes.search.peak import with_temporaries
from autopar.passes.report import build_plan
from autopar.passes.search.batch_coupled import batch_coupled
from autopar.passes.search.checkpoint import checkpointed_paths
from autopar.passes.search.pipeline_split import candidates, scaled, search, segments

#: the mesh axis name that pipelines
PP_AXIS = "pp"
#: ``baselines["unpipelined"]`` of a plan on a given ``pp`` mesh (see the module docstring)
UNPIPELINED_NOTE = "not planned: a given 'pp' axis pipelines; Mesh.devices(n, pp=[1, ...]) compares it"
#: keys of ``pipeline=``
PIN_KEYS = ("schedule", "microbatches", "virtual_stages")
#: micro-batch counts tried, as multiples of the pipeline degree (gradient accumulation: as counts)
MICROBATCH_FACTORS = (1, 2, 4)
ACCUMULATION_COUNTS = (2, 4, 8)


def wants_pipeline(mesh: Mesh, pipeline: Optional[Mapping]) -> bool:
    """Whether ``plan`` goes through this driver: a ``pp`` axis, or a pinned ``pipeline``."""
    return PP_AXIS in mesh.names or pipeline is not None


def check_pin(pipeline: Any, where: str = "autopar.plan") -> dict:
    """``pipeline=`` checked: a dict with some of ``schedule`` (one of torch's names in
    ``SCHEDULES``), ``microbatches`` (int >= 1), ``virtual_stages`` (int >= 1); {} for None."""
    if pipeline is None:
        return {}
    if not isinstance(pipeline, Mapping):
        raise ArgumentError(f"{where}: pipeline must be a dict such as {{'schedule': '1F1B', 'microbatches': 16}}, "
                            f"got {type(pipeline).__name__}")
    bad = [k for k in pipeline if k not in PIN_KEYS]
    if bad:
        raise ArgumentError(f"{where}: pipeline has unknown key(s) {bad}; it takes {list(PIN_KEYS)}")
    out = dict(pipeline)
    if "schedule" in out and out["schedule"] not in SCHEDULES:
        raise ArgumentError(f"{where}: pipeline schedule {out['schedule']!r} is not one of {list(SCHEDULES)}")
    for k in ("microbatches", "virtual_stages"):
        v = out.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ArgumentError(f"{where}: pipeline {k} must be an int >= 1, got {v!r}")
    return out


def stage_mesh(mesh: Mesh) -> Mesh:
    """The mesh without the ``pp`` axis (its links kept); a pipeline alone gets a one-device axis ``dp``."""
    names = [n for n in mesh.names if n != PP_AXIS]
    if not names:
        return Mesh({"dp": 1}, device=mesh.hardware)
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


def plan_pipelined(model, mesh: Mesh, example_inputs=(), example_kwargs=None, *, pipeline=None,
                   mesh_search: bool = False, graphs: Optional[dict] = None, **kw):
    """The ``Plan`` for a mesh with a ``pp`` axis or a pinned ``pipeline`` (see the module docstring);
    ``kw`` are ``plan``'s checked keywords. ``mesh_search``: called by the factorization search, which
    compares the unpipelined shapes itself (the plan then carries no note that they were not planned);
    ``graphs`` (rows per micro-batch -> a captured graph) shares captures across calls and is filled with
    this call's."""
    start = time.perf_counter()
    pin = check_pin(pipeline)
    if not kw.get("training", True):
        raise ArgumentError("autopar.plan: a pipeline (a 'pp' mesh axis or pipeline=) is planned for training only; "
                            "plan inference without the pp axis")
    for k in ("hints", "recipe", "graph"):
        if kw.get(k) is not None:
            raise ArgumentError(f"autopar.plan: {k}= is not supported with a pipeline yet (a 'pp' axis or pipeline=); "
                                f"plan without it")
    if kw.get("search", "ilp") != "ilp":
        raise ArgumentError("autopar.plan: a pipeline is planned with search='ilp' only")
    pp = mesh.axis_size(PP_AXIS) if PP_AXIS in mesh.names else 1
    sub = stage_mesh(mesh)
    link = mesh.link(PP_AXIS) if PP_AXIS in mesh.names else None
    args = as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    batch = batch_size(args, kwargs)
    budget = kw.get("memory_budget")
    budget = float(budget) if budget is not None else DEFAULT_BUDGET_FRACTION * mesh.hardware.memory
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
    passkw = {k: v for k, v in kw.items() if k not in ("memory_budget", "graph", "recipe")}
    graphs = {} if graphs is None else graphs  # rows per micro-batch -> the graph captured at that shape (once)
    inner_phases: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        inner_phases[name] = round(inner_phases.get(name, 0.0) + now - since, 4)
        return now

    def exact(m: int, bounded: bool, recipe: Optional[str] = None):
        """One intra-op plan on the stage mesh at ``m`` micro-batches, read back per segment."""
        t = time.perf_counter()
        margs, mkwargs = micro_inputs(args, kwargs, batch, m)
        planned = run_passes(model, sub, margs, mkwargs, memory_budget=budget if bounded else math.inf,
                             graph=graphs.get(batch // m), **dict(passkw, recipe=recipe))
        graphs.setdefault(batch // m, planned.graph)
        for k, v in planned.phases.items():
            if k != "total":
                inner_phases[k] = round(inner_phases.get(k, 0.0) + v, 4)
        t = lap("stage_plans", t)
        # per-stage recomputation is priced from the layer plan without any (the unbounded solve's)
        plain_layers = planned.recompute is None or not planned.recompute.any
        segs, pre, units, post = segments(planned.graph, planned.folding, planned.problem, planned.choice, sub,
                                          planned.precision, planned.terms if plain_layers and recipe is None else ())
        segs = with_temporaries(segs, planned.peak)  # what a micro-batch holds between its ops
        lap("split", t)
        if not segs.units:
            raise ArgumentError("autopar.plan: a pipeline splits the model's repeated layers (numbered modules such "
                                "as layers.0, layers.1, ...) into stages, and this model has none")
        return planned, segs, (pre, units, post)

    def priced(segs, m: int, schedule=None, virtual=None):
        t = time.perf_counter()
        hop = p2p_time(segs.boundary_bytes, link) if link is not None else 0.0
        out = search(segs, pp, m, hop, schedule, virtual, budget)
        lap("split", t)
        return out

    # One exact solve at a first micro-batch count; the other counts are priced from it with the
    # per-micro-batch figures scaled (``scaled``); the best count by that estimate is then solved
    # exactly, and so on until the best candidate is an exact one. Typically one or two solves.
    found = []  # exact candidates: (price, ranges, m, planned, paths, order)
    estimated: list = []  # (price, m) from a scaled solve
    # The pipelined recipe's count first when it is one of them: its shape is captured for the recipe
    # anyway, so a second capture is paid only if another count might win (a capture of LLaMA-3.1-405B
    # is about half its plan's time). Else the middle count. The estimates lean optimistic both ways
    # (``scaled``), so a count they rank worse than an exact candidate would not have won.
    recipe_m = _recipe_count(sub, batch, pp, counts) if not pin and pp > 1 else None
    first = recipe_m if recipe_m in counts else counts[len(counts) // 2]
    for bounded in (False, True):
        solved: set[int] = set()
        estimated = []
        m = first
        while m is not None:
            solved.add(m)
            try:
                planned, segs, paths = exact(m, bounded)
            except InfeasibleError:
                planned = None
            if planned is not None:
                for price, ranges in priced(segs, m, pin.get("schedule"), pin.get("virtual_stages")):
                    found.append((price, ranges, m, planned, paths, len(found)))
                estimated = [e for e in estimated if e[1] != m]
                if not estimated and len(solved) == 1:
                    for k in counts:
                        if k not in solved:
                            estimated += [(price, k) for price, _ in priced(scaled(segs, m / k), k, pin.get("schedule"),
                                                                            pin.get("virtual_stages"))]
            pool = [(f[0], f[2], True) for f in found] + [(e[0], e[1], False) for e in estimated if e[1] not in solved]
            fit = [c for c in pool if c[0].peak_memory <= budget]
            best_c = min(fit or pool, key=lambda c: (c[0].step_time, not c[2])) if pool else None
            m = best_c[1] if best_c is not None and not best_c[2] else None
            if planned is None and not found and not estimated:  # nothing to estimate from: the next count
                m = next((k for k in counts if k not in solved), None)
        if any(p.peak_memory <= budget for p, *_ in found):
            break
    tried = [f[0] for f in found] + [e[0] for e in estimated if e[1] not in {f[2] for f in found}]
    estimated_ids = {id(e[0]) for e in estimated if e[1] not in {f[2] for f in found}}
    if not found:
        raise ArgumentError(f"autopar.plan: no pipeline schedule runs {pp} stage(s) with micro-batch counts {counts}"
                            + (f" and {pin}" if pin else "") + " (1F1B needs m >= pp, ZBV and Interleaved1F1B two "
                            "stages per rank and at least two layers per rank)")
    recipe_row = None
    if not pin and pp > 1:  # the torchtitan-style pipelined recipe, priced like the search's pipelines
        t = time.perf_counter()
        recipe_row, recipe_found = _pp_recipe(exact, priced, sub, _recipe_count(sub, batch, pp, counts), pp, budget)
        lap("pp_recipe", t)
        found += [(*f[:5], len(found) + k) for k, f in enumerate(recipe_found)]
    fitting = [f for f in found if f[0].peak_memory <= budget]
    best = min(fitting or found, key=lambda f: (f[0].step_time, f[5]))
    if not fitting:
        raise InfeasibleError(
            f"no pipeline fits the memory budget of {budget / 2**30:.2f} GiB per device: the leanest pipelined plan "
            f"tried needs {min(p.peak_memory for p in tried) / 2**30:.2f} GiB per device (pp={pp}, micro-batches "
            f"{counts}); use more devices, more micro-batches, a smaller batch, or raise memory_budget")
    price, ranges, m, planned, (pre, units, post), _ = best
    stage_paths = []
    for s, (a, b) in enumerate(ranges):
        stage_paths.append((pre if s == 0 else []) + units[a:b] + (post if s == len(ranges) - 1 else []))
    # what the stages recompute (the layer plan's own, if its bounded solve recomputes, and each
    # stage's), as the lowering reads it: the plan lists the reshardings their re-runs do again;
    # gradient buckets stay within a stage, as each pipeline rank runs its own stages' reductions
    redo = {path: mode for mode, paths in price.recomputed for path in paths}
    own = checkpointed_paths(planned.terms, planned.recompute) if planned.recompute else {}
    plan = build_plan(planned, checkpointing=dict(sorted(dict(own, **redo).items())),
                      grad_stages=param_stages(planned.graph, stage_paths))
    rank_kinds = price.rank_memory_kinds
    top = max(range(len(price.rank_memory)), key=lambda r: (price.rank_memory[r], -r))
    busy = max(price.replay.busy)
    plan.step_time = price.step_time
    plan.compute_time = busy
    plan.comm_time = max(0.0, price.step_time - busy)
    plan.peak_memory = int(price.peak_memory)
    plan.memory = {k: int(v) for k, v in rank_kinds[top].items()}
    plan.peak_at = (f"pipeline rank {top}: its stages' state, its micro-batches' saved values and one "
                    f"micro-batch's temporaries")
    plan.memory_budget = int(budget) if budget != math.inf else 0
    # the recipes priced at the micro-batch's shape on the stage mesh do not compare with a step:
    # the baselines are the whole mesh's (the plain plan's recipes and the plain plan itself)
    plan.baselines = {} if recipe_row is None else {RECIPE: recipe_row}
    if best[3].source.startswith("recipe:"):
        plan.source = f"recipe:{RECIPE}"
    if pp > 1 and not mesh_search:  # said in the baselines (and so in the summary): what was not compared, and how to compare it
        plan.baselines = dict(plan.baselines, unpipelined={"error": UNPIPELINED_NOTE})
    plan.pipeline = {
        "axis": PP_AXIS,
        "degree": pp,
        "mesh_names": list(mesh.names),
        "mesh_shape": [int(v) for v in mesh.shape],
        "schedule": price.schedule,
        "microbatches": m,
        "virtual_stages": price.virtual,
        "stages": stage_paths,
        "stage_ranks": list(stage_ranks(price.schedule, pp, price.virtual)),
        "bubble": price.replay.bubble,
        "makespan": price.replay.makespan,
        "sync_time": price.sync,
        "p2p_time": price.p2p,
        "in_flight": list(price.replay.in_flight),
        "stage_times": [[st.forward, st.input_grad, st.weight_grad] for st in price.stages],
        "rank_memory": [int(x) for x in price.rank_memory],
        "recompute": [{"mode": mode, "layers": list(paths)} if paths else {"mode": "none", "layers": []}
                      for mode, paths in price.recomputed],
        "stage_buckets": True,  # (schema version 7) buckets within a stage, each rank its own reductions
        "compared": [dict({"schedule": p.schedule, "microbatches": p.microbatches, "virtual_stages": p.virtual,
                           "step_time": p.step_time, "peak_memory": int(p.peak_memory), "bubble": p.replay.bubble,
                           "recomputed": sum(len(c[1]) for c in p.recomputed)},
                          **({"estimated": True} if id(p) in estimated_ids else {}))
                     for p in sorted(tried, key=lambda p: (p.step_time, p.schedule, p.microbatches, p.virtual,
                                                           id(p) in estimated_ids))],
    }
    coupled = batch_coupled(planned.graph, batch // m)
    plan.pipeline["batch_coupled"] = coupled
    plan.pipeline["reference"] = "micro-batched" if coupled and m > 1 else "whole-batch"
    if coupled and m > 1:
        warnings.warn(f"autopar.plan: {len(coupled)} op(s) couple the whole batch ({', '.join(coupled[:3])}"
                      f"{', ...' if len(coupled) > 3 else ''}) and run per micro-batch in this pipeline ({m} "
                      f"micro-batches): the plan equals the single-device run of the same micro-batches one after "
                      f"the other, not of the whole batch (plan.pipeline['reference']); pin "
                      f"pipeline={{'microbatches': 1}} to keep the whole batch", stacklevel=3)
    plan.phases = dict(inner_phases, total=round(time.perf_counter() - start, 4))
    return plan


#: the pipelined baseline recipe: torchtitan's layout (pipeline over ``pp``, FSDP on the data axis and
#: Megatron TP on the tensor axis of each stage, 1F1B, torchtitan's default micro-batch of one sample per
#: data rank: ``_recipe_count``)
RECIPE = "pp_fsdp_tp"


def _recipe_count(sub: Mesh, batch: int, pp: int, counts: list[int]) -> int:
    """``RECIPE``'s micro-batch count: one sample per data rank and micro-batch (torchtitan's default
    micro-batch size of 1), i.e. the batch over the data axes (every stage-mesh axis but the last, the
    tensor axis, when there are two or more), when that divides the batch and is at least ``pp``; else
    the largest count tried."""
    data = math.prod(sub.shape[:-1]) if sub.ndim >= 2 else sub.size
    m = batch // data if batch % data == 0 else 0
    return m if m >= pp else max(counts)


def _pp_recipe(exact, priced, sub: Mesh, m: int, pp: int, budget: float) -> tuple[dict, list]:
    """``RECIPE`` priced at ``m`` micro-batches: its baseline row and its candidate (``found``'s layout),
    or an error row; ``exact`` and ``priced`` are ``plan_pipelined``'s (the capture at that shape is shared)."""
    inner = "fsdp_tp" if sub.ndim >= 2 else "fsdp"
    try:
        planned, segs, paths = exact(m, False, recipe=inner)
    except (RecipeError, InfeasibleError, ValueError) as e:
        return {"error": f"{RECIPE}: {e}"}, []
    found = priced(segs, m, "1F1B", 1)
    if not found:
        return {"error": f"{RECIPE}: 1F1B does not run {pp} stages of {len(segs.units)} layers at m={m}"}, []
    price, ranges = found[0]
    row = {"step_time": price.step_time, "peak_memory": int(price.peak_memory), "fits": price.peak_memory <= budget}
    return row, [(price, ranges, m, planned, paths)]


__all__ = ["PIN_KEYS", "PP_AXIS", "RECIPE", "UNPIPELINED_NOTE", "batch_size", "check_pin", "micro_inputs", "plan_pipelined", "stage_mesh",
           "wants_pipeline"]
