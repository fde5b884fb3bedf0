"""The drivers ``autopar.plan`` and ``autopar.simulate``: each runs the engines below in order.

``plan``: ``passes.pipeline.run_passes`` (capture, fold, strategies, cost, merge, recipes, solve),
then ``passes.report.build_plan`` for the ``Plan``. ``simulate``: capture, ``passes.lower.resolve``
and ``lower`` for every device, then ``runtime.threads`` runs the programs as threads of this
process. ``autopar.compile`` (``parallel.py``) is the third driver.
"""

from __future__ import annotations

from typing import Optional

import torch

from autopar.cost_model.mesh import Mesh, require_mesh
from autopar.cost_model.precision import get_precision
from autopar.errors import ArgumentError, MeshError
from autopar.ir.capture import as_args, capture
from autopar.ir.graph import Graph
from autopar.ir.rules.proof.interp import device_coords
from autopar.ir.rules.random_ops import draw_seed
from autopar.passes.lower import lower, resolve
from autopar.passes.pipeline import run_passes
from autopar.passes.mesh_search import plan_mesh_search
from autopar.passes.pipelined import plan_pipelined, wants_pipeline
from autopar.passes.report import build_plan
from autopar.passes.search.recipes import NAMES
from autopar.passes.search.checkpoint import check_pin
from autopar.passes.search.kept import check_pin as check_kept_pin
from autopar.plans import Plan, load_plan
from autopar.runtime.accounting import predicted as predicted_collectives
from autopar.runtime.precision import execution_precision
from autopar.runtime.threads import gather_slots, placeholder_values, simulate_programs
from autopar.validate import (
    check_bool,
    check_choice,
    check_hints,
    check_keywords,
    check_kwargs,
    check_model,
    check_number,
    check_path,
    parse_size,
)

#: The keywords ``plan`` passes on to ``passes.pipeline.run_passes`` (its own are named in its signature).
PASS_KEYWORDS = ("precision", "optimizer", "recipe", "tensor_axis", "deterministic_time", "progress", "graph",
                 "checkpointing", "kept_gathers")
PLAN_KEYWORDS = ("training", "hints", "memory_budget", "time_limit", "search") + PASS_KEYWORDS


def check_plan_args(model, mesh, example_kwargs, kw: dict, where: str = "autopar.plan") -> dict:
    """``plan``'s arguments checked before any work (``compile`` checks them on every rank before
    rank 0 plans): ``kw`` with ``memory_budget`` read as bytes. An ``ArgumentError`` (a ``MeshError``
    for the mesh) names the argument."""
    check_model(model, f"{where}: model")
    require_mesh(mesh)
    check_kwargs(example_kwargs, f"{where}: example_kwargs")
    check_keywords(kw, PLAN_KEYWORDS, where)
    out = dict(kw)
    check_bool(kw.get("training", True), f"{where}: training")
    check_hints(kw.get("hints"), f"{where}: hints")
    if kw.get("memory_budget") is not None:
        out["memory_budget"] = parse_size(kw["memory_budget"], f"{where}: memory_budget", allow_inf=True)
    check_number(kw.get("time_limit"), f"{where}: time_limit (seconds)")
    check_number(kw.get("deterministic_time", 1.0), f"{where}: deterministic_time", allow_none=False)
    if kw.get("search", "ilp") not in ("ilp", "propagate"):
        raise ArgumentError(f"{where}: search={kw['search']!r}: choose 'ilp' (the cheapest plan) or 'propagate' "
                            "(the annotations spread GSPMD-style, the rest chosen locally)")
    if kw.get("progress") is not None:
        check_bool(kw["progress"], f"{where}: progress")
    try:
        get_precision(kw.get("precision"), mesh.hardware, kw.get("optimizer", "adamw"))
    except ValueError as e:
        raise ArgumentError(f"{where}: {e}") from None
    check_choice(kw.get("recipe"), NAMES, f"{where}: recipe", allow_none=True)
    check_pin(kw.get("checkpointing"), f"{where}: checkpointing")
    check_kept_pin(kw.get("kept_gathers"), f"{where}: kept_gathers")
    try:
        mesh.axis(kw.get("tensor_axis", -1))
    except MeshError as e:
        raise ArgumentError(f"{where}: tensor_axis: {e}") from None
    if kw.get("graph") is not None and not isinstance(kw["graph"], Graph):
        raise ArgumentError(f"{where}: graph must be a Graph from autopar.ir.capture.capture, got "
                            f"{type(kw['graph']).__name__}")
    return out


def plan(model, mesh: Mesh, example_inputs=(), example_kwargs=None, *, training: bool = True, hints=None,
         memory_budget=None, time_limit=None, search: str = "ilp", pipeline=None, **kw):
    """Plan how to run ``model`` on ``mesh``: the cheapest strategy per op within the memory budget,
    never slower than the best hand-written recipe that fits (see ``autopar.Plan``).

    ``search="propagate"`` skips the ILP: the annotations (``hints``, ``autopar.hint``, DTensor
    parameters and inputs) spread through the graph and the rest takes the cheapest local choice
    (``passes/search/propagate.py``); the plan's ``source`` is then ``"propagate"`` and it may not fit.

    Further keywords (passed to ``passes.pipeline.run_passes``): ``precision`` (e.g. "bf16-mixed"),
    ``optimizer`` ("adamw", "sgd", ...: its state is priced), ``deterministic_time`` (CP-SAT's
    deterministic seconds, default 20), ``progress`` (print each phase's time; default: when
    stderr is a terminal), ``recipe`` and ``tensor_axis`` (a named recipe instead of the search, as
    ``autopar.recipes`` calls it), ``graph`` (an already captured graph of this model),
    ``checkpointing`` (which layer instances recompute their activations in the backward:
    ``"none"``, ``"full"``, ``"selective"`` for every repeated layer, or a dict from module-path
    globs to those, e.g. ``{"layers.[0-9]": "full"}``; default: the search recomputes the fewest
    layers that let the fastest plan fit, and nothing when the fastest plan fits as it is),
    ``kept_gathers`` (which layer instances keep their parameters gathered in the forward for the
    backward instead of gathering them again, FSDP's ``reshard_after_forward=False``: ``"none"``,
    ``"all"``, a list of module-path globs such as ``["layers.*"]``, or a dict from globs to
    True/False; default: the search keeps them per group of alike layers where that makes the step
    faster and the plan still fits; a named recipe keeps none unless asked).

    A mesh axis named ``pp`` pipelines (``passes/pipelined.py``): the planner splits the repeated
    layers into stages, picks the micro-batch count and the schedule (GPipe, 1F1B, Interleaved1F1B,
    ZBVZeroBubble) by replaying it, and says so in ``plan.pipeline``; ``pipeline`` pins some of
    ``{"schedule": ..., "microbatches": ..., "virtual_stages": ...}`` (without a ``pp`` axis: gradient
    accumulation over that many micro-batches).

    A mesh made by ``autopar.Mesh.devices(count, device=..., node_size=...)`` gives only a device
    count: the planner plans each sensible factorization into ``pp`` x ``dp`` x ``tp``
    (``passes/mesh_search.py``), keeps the fastest that fits, and lists what it compared in
    ``plan.mesh_search``.
    """
    kw = check_plan_args(model, mesh, example_kwargs, dict(kw, training=training, hints=hints,
                                                          memory_budget=memory_budget, time_limit=time_limit,
                                                          search=search))
    if getattr(mesh, "factorize", None) is not None:  # Mesh.devices: the planner chooses pp x dp x tp
        return plan_mesh_search(model, mesh, example_inputs, example_kwargs, pipeline=pipeline, **kw)
    if wants_pipeline(mesh, pipeline):
        return plan_pipelined(model, mesh, example_inputs, example_kwargs, pipeline=pipeline, **kw)
    planned = run_passes(model, mesh, example_inputs, example_kwargs, **kw)
    return build_plan(planned)


def simulate(model: torch.nn.Module, plan, example_inputs=(), example_kwargs: Optional[dict] = None, *,
             precision: str = "model", trace: Optional[dict] = None, measure_memory: bool = False,
             predicted: Optional[dict] = None, graph: Optional[Graph] = None, device=None):
    """Run ``plan``'s lowered program for every device of its mesh in this process.

    Returns ``(outputs, grads)``: for a training plan ``outputs`` is the loss and ``grads`` maps each
    parameter's FQN to its whole gradient; for an inference plan ``outputs`` is the tuple of the
    model's tensor outputs and ``grads`` is empty. Computes in the model's own dtypes unless
    ``precision="plan"``: the plan's precision, e.g. "bf16-mixed" (bf16 compute, parameters gathered
    in bf16, gradients reduced and returned in fp32, the loss in fp32; see ``cost_model.casting``). Pass a
    dict as ``trace`` to receive the collectives every device executed (``{coords: [Executed, ...]}``),
    and one as ``predicted`` to receive those the plan predicts for each device (``{coords: Counter}``
    per (kind, axis, bytes), ``runtime.accounting``; ``accounting.compare(predicted[c], trace[c])`` is
    empty when they are equal). A pipelined plan's device runs every stage of its stage-mesh
    coordinates: its trace also holds the point-to-point transfers (``send``/``recv`` on the pipeline
    axis) of the values handed between stages on different pipeline ranks.
    Random ops (dropout) draw from a seed taken from torch's default generator, the same whatever
    the plan's placements (``ir.rules.random_ops``), but not torch's own eager stream.

    With ``measure_memory=True`` it returns ``(outputs, grads, memory)``: ``memory`` maps each
    device's coordinates to its measured step (``runtime.memory``): ``peak``, ``params``,
    ``grads``, ``optimizer``, ``activations`` and ``temporaries`` in bytes, the peak of the
    distinct storages live during the step split by what they hold. Each device then holds its
    blocks as copies of its own and, as optimizer state, the plan's optimizer bytes per parameter
    element (what a step after the first holds), so the figures compare with ``plan.memory``.

    ``graph``: an already captured graph of this model on these inputs (as ``autopar.plan`` takes
    it), to skip the capture; unpipelined plans only (a pipelined plan captures one micro-batch).

    ``device`` (default: the device of the model's parameters): where every device's program runs,
    its blocks of the inputs and parameters moved there; ``"cuda"`` runs a whole mesh's programs, each
    rank a thread, on one GPU. Unpipelined plans only.
    """
    check_model(model, "autopar.simulate: model")
    check_kwargs(example_kwargs, "autopar.simulate: example_kwargs")
    check_choice(precision, ("model", "plan"), "autopar.simulate: precision")
    for what, given in (("trace", trace), ("predicted", predicted)):
        if given is not None and not isinstance(given, dict):
            raise ArgumentError(f"autopar.simulate: {what} must be a dict to fill (or None), got {type(given).__name__}")
    if not isinstance(measure_memory, bool):
        raise ArgumentError(f"autopar.simulate: measure_memory must be True or False, got {measure_memory!r}")
    if graph is not None and not isinstance(graph, Graph):
        raise ArgumentError(f"autopar.simulate: graph must be a Graph from autopar.ir.capture.capture, got "
                            f"{type(graph).__name__}")
    if not isinstance(plan, Plan):
        plan = load_plan(check_path(plan, "autopar.simulate: plan (a Plan or a saved plan's path)"))
    if plan.pipeline is not None:  # every stage-mesh device a thread, its stages in turn
        if precision != "model" or measure_memory or graph is not None or device is not None:
            raise ArgumentError("autopar.simulate: a pipelined plan runs at the model's precision, on the CPU, "
                                "without measure_memory and without a given graph so far")
        return _simulate_pipelined(model, plan, as_args(example_inputs), dict(example_kwargs or {}), trace, predicted)
    args = as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    if graph is None:
        graph = capture(model, args, kwargs, training=plan.training)
    elif graph.training != plan.training:
        raise ArgumentError(f"autopar.simulate: graph was captured with training={graph.training}, the plan "
                            f"has training={plan.training}: capture it again with the plan's")
    res = resolve(graph, plan)
    on = _simulation_device(model, device)
    run_prec = execution_precision(precision, plan.precision.get("name", "model"), on)
    programs = {c: lower(res, c, on, precision=run_prec) for c in device_coords(res.mesh.shape)}
    first = programs[(0,) * len(res.mesh.shape)]
    if first.random is not None:  # one seed for every device, from torch's generator; step 0
        seed = draw_seed()
        for prog in programs.values():
            prog.random.seed = seed  # type: ignore[union-attr]
    values = placeholder_values(first.inputs, model, args, kwargs)
    memory: Optional[dict] = {} if measure_memory else None
    results, executed = simulate_programs(programs, values, run_prec, memory=memory,
                                          optimizer_bytes=int(plan.precision.get("optimizer_bytes", 0)), device=on)
    if trace is not None:
        trace.update(executed)
    if predicted is not None:
        every = predicted_collectives(plan)  # the plan's prediction is the same for every device
        predicted.update({c: every.copy() for c in programs})
    shape = res.mesh.shape
    outs = gather_slots(first.outputs, {c: r.outputs for c, r in results.items()}, shape)
    kept = [o for o, s in zip(outs, first.outputs) if s.kind in ("loss", "output")]
    grads = {}
    if plan.training:
        whole = gather_slots(first.grads, {c: r.grads for c, r in results.items()}, shape)
        grads = {s.key: g for s, g in zip(first.grads, whole)}
        for alias, canon in graph.aliases.items():
            if canon in grads:
                grads[alias] = grads[canon]
        return (kept[0], grads, memory) if measure_memory else (kept[0], grads)
    return (tuple(kept), grads, memory) if measure_memory else (tuple(kept), grads)


def _simulation_device(model: torch.nn.Module, device) -> Optional[torch.device]:
    """The device ``simulate`` lowers for: ``device``, else the model's parameters'; None for the CPU
    (the programs then create their tensors where torch's default puts them)."""
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ArgumentError(f"autopar.simulate: device must be a torch device such as 'cpu' or 'cuda', got "
                            f"{device!r}") from e
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return None if device.type == "cpu" else device


def _simulate_pipelined(model, plan, args, kwargs, trace, predicted):
    """``runtime.pipeline_sim``'s step of a pipelined plan, lowered with ``passes.lower.tagged``."""
    from autopar.passes.lower.tagged import keeping_gathers, lower_tagged
    from autopar.runtime.pipeline_sim import simulate_pipelined

    return simulate_pipelined(model, plan, args, kwargs,
                              lambda g, c: lower_tagged(keeping_gathers(resolve(g, plan)), c, None, "model"), trace,
                              predicted)


__all__ = ["PLAN_KEYWORDS", "check_plan_args", "plan", "simulate"]
