"""The drivers ``autopar.plan`` and ``autopar.simulate``: each runs the engines below in order.

``plan``: ``planner.intra.run_passes`` (capture, fold, strategies, cost, merge, recipes, solve),
then ``planner.report.build_plan`` for the ``Plan``. ``simulate``: capture, ``passes.lower.resolve``
and ``lower`` for every device, then ``runtime.threads`` runs the programs as threads of this
process. ``autopar.compile`` (``parallel.py``) is the third driver. A pipelined plan's program is
prepared here for ``simulate`` and ``compile`` alike: ``capture_micro`` captures one micro-batch,
``stage_program`` lowers it for a device (tagged), dry-runs it and cuts it into stages
(``passes.lower.stages``); ``pipelined`` builds the module of the pipeline axis alone. The runtime
(``runtime.pipeline``) only runs what they hand it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from autopar.cost_model.mesh import Mesh, require_mesh
from autopar.errors import ArgumentError
from autopar.ir.capture import as_args
from autopar.ir.graph import Graph
from autopar.ir.placement import local_block
from autopar.ir.rules.proof.interp import device_coords
from autopar.ir.rules.random_ops import draw_seed
from autopar.ir.stages import stage_rule
from autopar.passes.lower import lower, resolve
from autopar.passes.lower.stages import cut, dry_run
from autopar.passes.lower.tagged import keeping_gathers, lower_tagged
from autopar.planner.captures import capture, capture_for_plan
from autopar.planner.factorize import plan_mesh_search
from autopar.planner.intra import run_passes
from autopar.planner.options import PlanOptions, plan_options
from autopar.planner.pipelined import plan_pipelined, wants_pipeline
from autopar.planner.report import build_plan, trace_plan
from autopar.plans import Plan, load_plan
from autopar.program.program import compile_backend
from autopar.program.staged import StagedProgram, compile_cut
from autopar.runtime.accounting import predicted as predicted_collectives
from autopar.runtime.outputs import step_result
from autopar.runtime.precision import execution_precision
from autopar.runtime.threads import gather_slots, placeholder_values, simulate_programs
from autopar.validate import check_choice, check_kwargs, check_model, check_path


def check_plan_args(model, mesh, example_kwargs, kw: dict, where: str = "autopar.plan",
                    pipeline=None) -> PlanOptions:
    """``plan``'s arguments checked before any work (``compile`` checks them on every rank before
    rank 0 plans), read into the planners' ``PlanOptions`` (``planner.options.plan_options``). An
    ``ArgumentError`` (a ``MeshError`` for the mesh) names the argument."""
    check_model(model, f"{where}: model")
    require_mesh(mesh)
    check_kwargs(example_kwargs, f"{where}: example_kwargs")
    return plan_options(mesh, kw, where, pipeline)


def plan(model, mesh: Mesh, example_inputs=(), example_kwargs=None, *, training: bool = True, hints=None,
         memory_budget=None, time_limit=None, search: str = "ilp", pipeline=None, **kw):
    """Plan how to run ``model`` on ``mesh``: the cheapest strategy per op within the memory budget,
    never slower than the best hand-written recipe that fits (see ``autopar.Plan``).

    ``search="propagate"`` skips the ILP: the annotations (``hints``, ``autopar.hint``, DTensor
    parameters and inputs) spread through the graph and the rest takes the cheapest local choice
    (``passes/search/propagate.py``); the plan's ``source`` is then ``"propagate"`` and it may not fit.

    Further keywords (``planner.options.PlanOptions``): ``precision`` (e.g. "bf16-mixed"),
    ``optimizer`` ("adamw", "sgd", ...: its state is priced), ``deterministic_time`` (CP-SAT's
    deterministic seconds, default 20), ``progress`` (print each phase's time; default: when
    stderr is a terminal), ``recipe`` and ``tensor_axis`` (a named recipe instead of the search, as
    ``autopar.recipes`` calls it; or a ``Layout`` of your own, ``autopar.recipes.dtensor_layout``),
    ``graph`` (an already captured graph of this model),
    ``checkpointing`` (which layer instances recompute their activations in the backward:
    ``"none"``, ``"full"``, ``"selective"`` for every repeated layer, or a dict from module-path
    globs to those, e.g. ``{"layers.[0-9]": "full"}``; default: the search recomputes the fewest
    layers that let the fastest plan fit, and nothing when the fastest plan fits as it is),
    ``kept_gathers`` (which layer instances keep their parameters gathered in the forward for the
    backward instead of gathering them again, FSDP's ``reshard_after_forward=False``: ``"none"``,
    ``"all"``, a list of module-path globs such as ``["layers.*"]``, or a dict from globs to
    True/False; default: the search keeps them per group of alike layers where that makes the step
    faster and the plan still fits; a named recipe keeps none unless asked), ``compiled`` (price the
    program as ``torch.compile``'s Inductor runs it, pointwise chains fused into one kernel each,
    ``cost_model/fusion.py``; ``autopar.compile(..., compile=True)`` plans so by itself), ``loss_fn``
    (for a model that returns logits: ``loss_fn(output, target)``, captured into the step with the
    model; the target is the keyword input ``target=``, which goes to ``loss_fn``, not to the model;
    ``loss_fn(output)`` without one; unpipelined plans only).

    A mesh axis named ``pp`` pipelines (``planner/pipelined.py``): the planner splits the repeated
    layers into stages, picks the micro-batch count and the schedule (GPipe, 1F1B, Interleaved1F1B,
    ZBVZeroBubble) by replaying it, and says so in ``plan.pipeline``; ``pipeline`` pins some of
    ``{"schedule": ..., "microbatches": ..., "virtual_stages": ...}`` (without a ``pp`` axis: gradient
    accumulation over that many micro-batches).

    A mesh made by ``autopar.Mesh.devices(count, device=..., node_size=...)`` gives only a device
    count: the planner plans each sensible factorization into ``pp`` x ``dp`` x ``tp``
    (``planner/factorize.py``), keeps the fastest that fits, and lists what it compared in
    ``plan.mesh_search``.
    """
    options = check_plan_args(model, mesh, example_kwargs, dict(kw, training=training, hints=hints,
                                                               memory_budget=memory_budget, time_limit=time_limit,
                                                               search=search), pipeline=pipeline)
    return plan_with(model, mesh, example_inputs, example_kwargs, options)


def plan_with(model, mesh: Mesh, example_inputs, example_kwargs, options: PlanOptions):
    """``plan`` with its arguments already checked into ``options`` (``check_plan_args``): the
    factorization search for a ``Mesh.devices`` mesh, the pipeline planner for a ``pp`` axis or a
    pinned ``pipeline``, else the intra-op planner (whose step returns the model's other outputs too)."""
    searched = getattr(mesh, "factorize", None) is not None
    pipelines = wants_pipeline(mesh, options.pipeline)
    if options.loss_fn is not None and (searched or pipelines):
        raise ArgumentError("autopar.plan: loss_fn= works with unpipelined plans: under a pipeline (a 'pp' axis, "
                            "pipeline=, or Mesh.devices, which may choose one) the model must return its loss")
    if searched:  # Mesh.devices: the planner chooses pp x dp x tp
        made = plan_mesh_search(model, mesh, example_inputs, example_kwargs, options)
    elif pipelines:
        made = plan_pipelined(model, mesh, example_inputs, example_kwargs, options)
    else:
        planned = run_passes(model, mesh, example_inputs, example_kwargs, replace(options, capture_outputs=True))
        made = build_plan(planned)
    trace_plan(made)  # with TORCH_TRACE set: the plan and its phases in torch's structured trace
    return made


def simulate(model: torch.nn.Module, plan, example_inputs=(), example_kwargs: Optional[dict] = None, *,
             precision: str = "model", trace: Optional[dict] = None, measure_memory: bool = False,
             predicted: Optional[dict] = None, graph: Optional[Graph] = None, loss_fn=None, device=None,
             compile=False):  # noqa: A002
    """Run ``plan``'s lowered program for every device of its mesh in this process.

    Returns ``(outputs, grads)``: ``outputs`` is what the model returns (a ``ModelOutput``, dict,
    dataclass, tuple or tensor: the loss in its place and every other tensor whole; with
    ``loss_fn``, as ``autopar.plan`` takes it, ``StepOutput(loss, output)``; a pipelined plan's is
    the loss alone), and ``grads`` maps each parameter's FQN to its whole gradient (empty for an
    inference plan). Computes in the model's own dtypes unless
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
    A pipelined plan's are per device of the whole mesh (the pipeline axis's coordinate its
    pipeline rank): each rank's own stages measured apart (``runtime.pipeline.memory``), in the
    simulator's GPipe order (every micro-batch in flight), so they compare with
    ``plan.pipeline.rank_memory`` of a GPipe plan.

    ``graph``: an already captured graph of this model on these inputs (as ``autopar.plan`` takes
    it), to skip the capture; unpipelined plans only (a pipelined plan captures one micro-batch).
    A training graph captured without ``outputs=True`` (``ir.capture.capture``) gives the loss alone.

    ``device`` (default: the device of the model's parameters): where every device's program runs,
    its blocks of the inputs and parameters moved there; ``"cuda"`` runs a whole mesh's programs, each
    rank a thread, on one GPU. Unpipelined plans only.

    ``compile``: as ``autopar.compile``'s, every device's programs (a pipelined plan: every stage's)
    run through ``torch.compile`` with that backend (True: Inductor).
    """
    check_model(model, "autopar.simulate: model")
    check_kwargs(example_kwargs, "autopar.simulate: example_kwargs")
    check_choice(precision, ("model", "plan"), "autopar.simulate: precision")
    for what, given in (("trace", trace), ("predicted", predicted)):
        if given is not None and not isinstance(given, dict):
            raise ArgumentError(f"autopar.simulate: {what} must be a dict to fill (or None), got {type(given).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise ArgumentError(f"autopar.simulate: loss_fn must be a callable loss_fn(output, target), got "
                            f"{type(loss_fn).__name__}")
    if not isinstance(measure_memory, bool):
        raise ArgumentError(f"autopar.simulate: measure_memory must be True or False, got {measure_memory!r}")
    torch_backend = compile_backend(compile, "autopar.simulate")
    if graph is not None and not isinstance(graph, Graph):
        raise ArgumentError(f"autopar.simulate: graph must be a Graph from autopar.ir.capture.capture, got "
                            f"{type(graph).__name__}")
    if not isinstance(plan, Plan):
        plan = load_plan(check_path(plan, "autopar.simulate: plan (a Plan or a saved plan's path)"))
    if plan.pipeline is not None:  # every stage-mesh device a thread, its stages in turn
        if precision != "model" or graph is not None or loss_fn is not None or device is not None:
            raise ArgumentError("autopar.simulate: a pipelined plan runs at the model's precision, on the CPU, "
                                "without a given graph or loss_fn= (it returns the loss alone) so far")
        memory: Optional[dict] = {} if measure_memory else None
        loss, grads = _simulate_pipelined(model, plan, as_args(example_inputs), dict(example_kwargs or {}), trace,
                                          predicted, torch_backend, memory)
        return (loss, grads, memory) if measure_memory else (loss, grads)
    args = as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    if graph is None:
        graph = capture_for_plan(model, args, kwargs, training=plan.training, fingerprint=plan.fingerprint.get("graph"),
                                 loss_fn=loss_fn)
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
    if torch_backend is not None:
        for prog in programs.values():
            prog.compile_with(torch_backend)
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
    loss = next((o for o, s in zip(outs, first.outputs) if s.kind == "loss"), None)
    result = step_result(graph.output_tree, loss, [o for o, s in zip(outs, first.outputs) if s.kind == "output"])
    grads = {}
    if plan.training:
        whole = gather_slots(first.grads, {c: r.grads for c, r in results.items()}, shape)
        grads = {s.key: g for s, g in zip(first.grads, whole)}
        for alias, canon in graph.aliases.items():
            if canon in grads:
                grads[alias] = grads[canon]
    return (result, grads, memory) if measure_memory else (result, grads)


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


def _simulate_pipelined(model, plan, args, kwargs, trace, predicted, torch_backend=None, memory=None):
    """A pipelined plan's step simulated: the driver captures one micro-batch, lowers and cuts the
    program of every stage-mesh device (every stage its own), and ``runtime.pipeline.simulate`` runs them."""
    from autopar.runtime.pipeline.simulate import simulate_staged

    graph, batch = capture_micro(model, plan, args, kwargs, True, "autopar.simulate")
    res = keeping_gathers(resolve(graph, plan))
    everything = range(len(plan.pipeline.stage_ranks))
    staged = {c: stage_program(model, plan, graph, batch, args, kwargs, coords=c, precision="model", local=everything,
                               resolved=res) for c in device_coords(plan.mesh_shape)}
    if torch_backend is not None:
        for st in staged.values():
            compile_cut(st.cut, torch_backend)
    return simulate_staged(model, plan, staged, args, kwargs, trace, predicted, memory,
                           int(plan.precision.get("optimizer_bytes", 0)))


def pipelined(model: torch.nn.Module, plan: Plan, example_inputs=(), example_kwargs: Optional[dict] = None,
              group=None, device: Optional[torch.device] = None):
    """``model`` run by ``plan`` (a pipelined plan over the pipeline axis alone) on this rank of ``group``
    (default: the world): its forward captured at the micro-batch's shape, run by ``runtime.pipeline``'s
    ``PipelinedModule`` on ``device`` (None: the CPU; the model is moved there); ``autopar.compile``
    builds it for such a plan."""
    from autopar.runtime.pipeline import PipelinedModule, check_alone

    check_alone(plan, group)
    args, kwargs = as_args(example_inputs), dict(example_kwargs or {})
    graph, batch = capture_micro(model, plan, args, kwargs, False, "autopar pipelined")
    return PipelinedModule(model, plan, graph, batch, group, device)


def capture_micro(model, plan, args: tuple, kwargs: dict, training: bool, where: str) -> tuple[Graph, int]:
    """``(graph, batch)``: ``model`` captured at the shape of one of ``plan``'s micro-batches (the
    first), and the whole batch's rows; an ``ArgumentError`` naming ``where`` for a batch the plan's
    micro-batch count does not divide or a model that updates buffers (a pipelined run refuses them)."""
    from autopar.runtime.pipeline.schedule import batch_size, micro_slices
    from autopar.runtime.pipeline.state import refuse_buffer_updates

    m = plan.pipeline.microbatches
    batch = batch_size(args, kwargs, m, where)
    micro = micro_slices(args, kwargs, batch, m)[0]
    graph = capture(model, tuple(micro[f"input:{i}"] for i in range(len(args))), {k: micro[k] for k in kwargs},
                    training=training)
    refuse_buffer_updates(graph, where)
    return graph, batch


def stage_program(model, plan, graph: Graph, batch: int, args: tuple, kwargs: dict, *, coords: tuple,
                  precision: str, local, checked: bool = True, resolved=None,
                  device: Optional[torch.device] = None) -> StagedProgram:
    """The staged program of the stage-mesh device at ``coords``: ``resolved`` (the plan on ``graph``,
    one micro-batch, its gathers kept for the step: ``keeping_gathers(resolve(graph, plan))``, made
    here when not given) lowered with its fx nodes tagged, run once without
    communication for every value's local shape (``dry_run``), and cut into the plan's stages
    (``passes.lower.stages.cut``); the static program computes what the ``local`` stages read.
    ``checked``: the state must hold real values of the plan's shapes (``placeholder_values``);
    without, meta tensors stand in (a model ``compile`` materializes later). ``device``: the one it
    is lowered for (``lower``'s; None: the CPU), where the dry run runs it."""
    from autopar.runtime.pipeline.schedule import micro_slices

    pl = plan.pipeline
    resolved = resolved if resolved is not None else keeping_gathers(resolve(graph, plan))
    stage_of = stage_rule(graph, pl.stages)
    program = lower_tagged(resolved, coords, device, precision, stage_of)
    micro = micro_slices(args, kwargs, batch, pl.microbatches)[0]
    margs, mkwargs = tuple(micro[f"input:{i}"] for i in range(len(args))), {k: micro[k] for k in kwargs}
    if checked:
        whole = placeholder_values(program.inputs, model, margs, mkwargs)
    else:
        state = dict(model.named_parameters(remove_duplicate=False))
        state.update(dict(model.named_buffers(remove_duplicate=False)))
        whole = [state[s.key].detach() if s.kind in ("param", "buffer") else
                 margs[int(s.key.split(":")[1])] if s.key.startswith("input:") else mkwargs[s.key]
                 for s in program.inputs]
    blocks = [local_block(t, s.placements, program.mesh_shape, coords, s.spec.blocks)
              for t, s in zip(whole, program.inputs)]
    if device is not None:  # (a meta tensor stays one: it has no values to move)
        blocks = [b if b.is_meta else b.to(device) for b in blocks]
    dry_run(program, blocks)
    cutting = cut(program, stage_of, len(pl.stage_ranks), local, split=pl.schedule == "ZBVZeroBubble", device=device)
    return StagedProgram(graph=graph, stage_of=stage_of, program=program, cut=cutting, batch=batch, local=list(local))


__all__ = ["capture_micro", "check_plan_args", "pipelined", "plan", "plan_with", "simulate", "stage_program"]
