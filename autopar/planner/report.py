"""Report: turn the passes' result into a self-contained ``Plan`` — placements, per-op strategies,
every resharding with its collectives, bucketed collective predictions, per-module summaries with
alternatives, baselines and solver statistics."""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from autopar._torch_compat.trace import trace_artifact
from autopar.cost_model.buckets import BUCKET_SIZE, collective_calls, mark_grad_buckets
from autopar.cost_model.casting import cast_policy, transfer_bytes, transfer_role
from autopar.cost_model.comm import reshard_steps, step_axes
from autopar.cost_model.compute import model_flops, tokens_per_step
from autopar.cost_model.gathers import mark_param_groups
from autopar.cost_model.mesh import PP_AXIS, Mesh
from autopar.cost_model.pipeline_price import PipelinePrice
from autopar.cost_model.schedules import stage_ranks
from autopar.ir.fingerprint import graph_fingerprint, graph_info
from autopar.ir.graph import Ref
from autopar.ir.placement import B, format_placements
from autopar.ir.recompute import recomputed_ops
from autopar.ir.stages import boundary_carriers, param_stages, stage_rule
from autopar.ir.views import param_views
from autopar.passes.search.checkpoint import checkpointed_paths, group_figures
from autopar.passes.search.forms import form_report
from autopar.passes.search.kept import kept_figures, kept_reads
from autopar.passes.search.peak import peak_place, strategy_lookup
from autopar.passes.search.problem import MEMORY_KINDS, Repricer, incident_transfers, local_cost
from autopar.passes.search.strategies import input_placement, output_placement

if TYPE_CHECKING:
    from autopar.planner.intra import Planned
    from autopar.plans.entries import PipelineChoice

#: Alternatives kept per module in the plan (the cheapest other strategies of its ops).
ALTERNATIVES = 4


def _sha(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


@dataclass
class PipelineDecision:
    """What the pipeline planner (``planner/pipelined.py``) chose, for ``build_plan``: the pipeline's
    ``price`` at ``microbatches``, each stage's module paths, the whole ``mesh`` (with the ``pp``
    axis), every pipeline priced (``compared``: with whether it was estimated), the ops that couple
    the batch, and the plan's budget, baselines, source and phases."""

    price: PipelinePrice
    microbatches: int
    stages: list[list[str]]
    mesh: Mesh
    compared: list[tuple[PipelinePrice, bool]]
    batch_coupled: list[str]
    budget: float
    baselines: dict
    source: str
    phases: dict


def pipeline_entry(choice: PipelineDecision) -> "PipelineChoice":
    """``plan.pipeline``: the axis and the whole mesh, the schedule, the stages and the priced figures,
    as the plan file's record (validated as a file's entry is, so a key the schema lacks fails here)."""
    from autopar.plans.entries import PipelineChoice, record

    price, mesh, m = choice.price, choice.mesh, choice.microbatches
    pp = mesh.axis_size(PP_AXIS) if PP_AXIS in mesh.names else 1
    coupled = choice.batch_coupled
    return record(PipelineChoice, {
        "axis": PP_AXIS,
        "degree": pp,
        "mesh_names": list(mesh.names),
        "mesh_shape": [int(v) for v in mesh.shape],
        "schedule": price.schedule,
        "microbatches": m,
        "virtual_stages": price.virtual,
        "stages": choice.stages,
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
                          **({"estimated": True} if estimated else {}))
                     for p, estimated in sorted(choice.compared, key=lambda pe: (pe[0].step_time, pe[0].schedule,
                                                                                  pe[0].microbatches, pe[0].virtual,
                                                                                  pe[1]))],
        "batch_coupled": coupled,
        "reference": "micro-batched" if coupled and m > 1 else "whole-batch",
    })


def _pipeline_figures(choice: PipelineDecision) -> dict:
    """A pipelined plan's step and memory: the pipeline's (its slowest rank's busy time as compute,
    the rest of the step as communication; the memory of its fullest rank)."""
    price = choice.price
    top = max(range(len(price.rank_memory)), key=lambda r: (price.rank_memory[r], -r))
    busy = max(price.replay.busy)
    return dict(step_time=price.step_time, compute_time=busy, comm_time=max(0.0, price.step_time - busy),
                peak_memory=int(price.peak_memory), memory={k: int(v) for k, v in price.rank_memory_kinds[top].items()},
                memory_budget=int(choice.budget) if choice.budget != math.inf else 0,
                peak_at=(f"pipeline rank {top}: its stages' state, its micro-batches' saved values and one "
                         f"micro-batch's temporaries"))


def build_plan(planned: "Planned", pipeline: Optional[PipelineDecision] = None):
    """The user's ``Plan`` from the passes' result: placements by FQN and input, every node's
    strategy, each resharding with its collectives (bucketed as the program runs them), per-module
    summaries with alternatives, the recipes' baselines and the solver's statistics.

    For a pipelined plan (``planner/pipelined.py``), ``planned`` is the layer plan of one
    micro-batch on the stage mesh and ``pipeline`` what was chosen on it: the plan's step, memory,
    baselines, source, phases and ``plan.pipeline`` are the pipeline's. What the stages recompute
    (the layer plan's own and each stage's) is the plan's ``checkpointing``: the reshardings their
    re-runs do again are listed, their parameter regathers not (a pipeline keeps every gathered
    copy for the step); gradient buckets stay within a stage, as each pipeline rank runs its own
    stages' reductions (``cost_model.buckets.grad_buckets``)."""
    from autopar.plans import Plan

    g, mesh, prob, folding = planned.graph, planned.mesh, planned.problem, planned.folding
    choice = planned.choice
    checkpointing, grad_stages = None, None
    if pipeline is not None:
        redo = {path: mode for mode, paths in pipeline.price.recomputed for path in paths}
        own = checkpointed_paths(planned.terms, planned.recompute) if planned.recompute else {}
        checkpointing = dict(sorted(dict(own, **redo).items()))
        grad_stages = param_stages(g, pipeline.stages)

    strat = strategy_lookup(prob, folding, choice)

    placements = {}
    for fqn, node in list(g.params.items()) + list(g.buffers.items()) + list(g.inputs.items()):
        placements[fqn] = format_placements(output_placement(strat(node), 0))
    for alias, canon in getattr(g, "aliases", {}).items():
        if canon in placements:
            placements[alias] = placements[canon]

    nodes = []
    texts: dict[int, tuple] = {}  # problem node -> its texts: a folded instance's are its representative's
    for n in g.ops():
        st = strat(n.name)
        i = prob.index[folding.representative(n.name)]
        got = texts.get(i)
        if got is None:
            got = texts[i] = (
                [str(s) for s in st], [s.tag for s in st],
                [format_placements(input_placement(st, k)) for k in range(len(n.inputs))],
                [None if o is None else format_placements(output_placement(st, j)) for j, o in enumerate(n.outputs)],
                prob.nodes[i].compute[choice[i]])
        strategy, tags, inputs, outputs, compute = got
        nodes.append({
            "name": n.name, "op": n.op, "module": n.module_path, "phase": n.phase.value,
            "strategy": list(strategy), "tags": list(tags), "inputs": list(inputs), "outputs": list(outputs),
            "compute": compute,
        })
    carried, stage_of = {}, None  # a pipeline's boundary gradients, sent back as their activations are placed
    if pipeline is not None:
        stage_of = stage_rule(g, pipeline.stages)
        carried = boundary_carriers(g, stage_of, lambda r: output_placement(strat(r.node), r.index))
    reshardings = _reshardings(planned, strat, checkpointing, carried, stage_of)
    mark_grad_buckets(g, reshardings, mesh, planned.precision, grad_stages)  # as the lowering groups them
    mark_param_groups(g, reshardings, mesh, planned.precision)
    mesh_dict = mesh.to_dict()
    cost = planned.cost
    flops, tokens = model_flops(g), tokens_per_step(g)
    devices = mesh.size
    peak = mesh.hardware.flops(planned.precision.compute_dtype or "float32")
    step = cost.step_time
    if pipeline is not None:  # the layer plan is one micro-batch's on the stage mesh: the step is the pipeline's
        flops, tokens = flops * pipeline.microbatches, tokens * pipeline.microbatches
        devices, step = pipeline.mesh.size, pipeline.price.step_time
    figures = (_pipeline_figures(pipeline) if pipeline is not None else
               dict(step_time=cost.step_time, compute_time=cost.compute_time, comm_time=cost.comm_time,
                    peak_memory=int(cost.peak_memory), memory={k: int(v) for k, v in cost.memory.items()},
                    memory_budget=int(prob.memory_budget) if prob.memory_budget != float("inf") else 0,
                    peak_at=peak_place(g, planned.peak)))
    return Plan(
        fingerprint={"graph": graph_fingerprint(g), "mesh": mesh.fingerprint(), "hardware": _sha(mesh.hardware.to_dict())},
        mesh=mesh_dict,
        precision=planned.precision.to_dict(),
        training=g.training,
        **figures,
        placements=placements,
        nodes=nodes,
        reshardings=reshardings,
        collectives=_collectives(reshardings),
        bucket_size=BUCKET_SIZE,
        baselines=planned.baselines if pipeline is None else pipeline.baselines,
        solver=dict(planned.solution.stats) if planned.solution else {"solver": "none (recipe)"},
        source=planned.source if pipeline is None else pipeline.source,
        modules=_modules(planned, strat, reshardings),
        phases=planned.phases if pipeline is None else pipeline.phases,
        graph=graph_info(g),
        checkpointing=(checkpointing if checkpointing is not None else
                       checkpointed_paths(planned.terms, planned.recompute) if planned.recompute else {}),
        kept_gathers=[p for paths in planned.kept_paths for p in paths],
        layer_groups=kept_figures(planned.kept_terms, planned.kept_paths, planned.problem, choice,
                                  group_figures(planned.unscaled, planned.terms, planned.recompute, choice)
                                  if planned.recompute and planned.unscaled is not None else []),
        model_flops=flops,
        mfu=flops / (step * devices * peak) if step > 0 else 0.0,
        tokens_per_step=tokens,
        tokens_per_second_per_device=tokens / (step * devices) if step > 0 else 0.0,
        pipeline=pipeline_entry(pipeline) if pipeline is not None else None,
    )


def _reshardings(planned: "Planned", strat, checkpointing: Optional[dict[str, str]] = None,
                 carried: Optional[dict] = None, stage_of=None) -> list[dict]:
    """One entry per resharding the plan does: per tensor and target placement (and phase, for
    parameter gathers, which run again in the backward), shared by every consumer that needs that
    placement — as ``problem.evaluate`` prices it and the lowering runs it. ``consumers`` lists
    them in graph order; ``consumer`` is the first (``module`` is its module). The loss handed
    back replicated is an entry of its own, as the evaluator prices it (a sink cost of its node).
    ``carried`` (a pipeline's ``ir.stages.boundary_carriers``, ``stage_of`` its stage rule): a
    backward value read by an earlier stage is resharded to its carrier's placement by its maker (an
    entry whose consumer is the maker), then from there by each reader (entries of their own), as
    the lowering runs it."""
    g, mesh, prec = planned.graph, planned.mesh, planned.precision
    policy = cast_policy(g, prec)  # activations move in the dtype the lowering gives them
    out = []
    seen: dict[tuple, dict] = {}

    def add(ref: Ref, consumer: str, kind: str, src, dst, module: str, phase=None, label=None):
        if tuple(src) == tuple(dst):
            return
        key = (ref, label or kind, tuple(dst), phase)
        if key in seen:
            seen[key]["consumers"].append(consumer)
            return
        spec = g.spec(ref)
        role = transfer_role(kind)
        eb = transfer_bytes(g, ref, role, prec, policy)
        steps = reshard_steps(spec.shape, src, dst, mesh, eb)
        seen[key] = {
            "tensor": str(ref), "consumer": consumer, "consumers": [consumer], "kind": label or kind,
            "from": format_placements(src), "to": format_placements(dst), "bytes": spec.numel * eb,
            "time": sum(s.time for s in steps),
            "steps": [{"kind": s.kind, "axis": "+".join(mesh.names[a] for a in step_axes(s)), "bytes": int(s.bytes), "time": s.time} for s in steps],
            "module": module,
        }
        if phase == "backward" and g.node(consumer).phase.value != phase:  # a re-run forward op's gather
            seen[key]["phase"] = phase
        out.append(seen[key])


    views = param_views(g)
    carried, sent_back = carried or {}, set()
    if checkpointing is not None:  # a pipeline's stages recompute; every gathered copy is kept for the step
        redo, regather = recomputed_ops(g, checkpointing), False
    else:
        redo = (recomputed_ops(g, checkpointed_paths(planned.terms, planned.recompute))
                if planned.recompute and planned.recompute.any else frozenset())
        regather = True
    # backward reads of kept instances' parameters served by the forward's gathered blocks: not gathered again
    served = kept_reads(g, strat, [p for paths in planned.kept_paths for p in paths], mesh, redo)
    # (ref, placement) read in the forward, and read again in the backward by a re-run op (or, for
    # a re-run value, by any backward op): the backward reshards it again (``passes/lower/emitter``)
    forward_reads: set[tuple] = set()
    again: dict[tuple, tuple[str, str]] = {}
    for n in g.ops():
        st = strat(n.name)
        for slot, r in enumerate(n.inputs):
            src = output_placement(strat(r.node), r.index)
            kind = "param" if r.node in views else "activation"
            dst = input_placement(st, slot)
            if r in carried and stage_of(n.name) < stage_of(r.node):  # sent back past a stage boundary
                maker = g.node(r.node)
                if (r, tuple(carried[r])) not in sent_back:
                    sent_back.add((r, tuple(carried[r])))
                    add(r, maker.name, kind, src, carried[r], maker.module_path)
                add(r, n.name, kind, carried[r], dst, n.module_path, "carried")
                continue
            if not (kind == "param" and n.phase.value == "backward" and (r, tuple(dst)) in served):
                add(r, n.name, kind, src, dst, n.module_path, n.phase.value if kind == "param" else None)
            if kind == "param" and regather and n.name in redo and (r, tuple(dst)) not in served:
                add(r, n.name, kind, src, dst, n.module_path, "backward")  # a re-run op reads its weight there
            if kind != "activation" or tuple(src) == tuple(dst):
                continue
            if n.phase.value == "forward":
                forward_reads.add((r, tuple(dst)))
            if n.name in redo or (r.node in redo and n.phase.value == "backward"):
                again.setdefault((r, tuple(dst)), (n.name, n.module_path))
    for (r, dst), (consumer, module) in again.items():
        if (r, dst) in forward_reads:
            add(r, consumer, "activation", output_placement(strat(r.node), r.index), dst, module, label="recompute")
    for fqn, gref in g.grads.items():
        dst = output_placement(strat(g.params[fqn]), 0)
        add(gref, f"param:{fqn}", "grad", output_placement(strat(gref.node), gref.index), dst,
            g.node(gref.node).module_path)
    if g.loss is not None:
        add(g.loss, "loss", "activation", output_placement(strat(g.loss.node), g.loss.index),
            tuple(B for _ in mesh.shape), g.node(g.loss.node).module_path, "sink")  # priced on its own
    return out


def _collectives(reshardings: list[dict]) -> list[dict]:
    """The collectives one device runs per step, per (what moves, collective, axis, bucketed): count
    and bytes per call (the average when calls differ); see ``buckets.collective_calls``."""
    calls: dict[tuple, list[int]] = defaultdict(list)
    for kind, coll, axis, nbytes, in_bucket in collective_calls(reshardings):
        calls[(kind, coll, axis, in_bucket)].append(nbytes)
    out = []
    for (kind, coll, axis, in_bucket), sizes in sorted(calls.items()):
        phase = {"grad": "backward", "param": "forward and backward"}.get(kind, "any")
        out.append({"kind": coll, "axis": axis, "bytes": sum(sizes) // len(sizes), "count": len(sizes),
                    "phase": phase, "bucketed": in_bucket})
    return out


def _modules(planned: "Planned", strat, reshardings: list[dict]) -> list[dict]:
    g, prob, folding, choice = planned.graph, planned.problem, planned.folding, planned.choice
    rows: dict[str, dict] = {}

    def row(path: str) -> dict:
        if path not in rows:
            rows[path] = {"path": path, "time": 0.0, "comm": 0.0, "bytes": 0, "memory": 0, "placements": {},
                          "alternatives": []}
        return rows[path]

    for fqn, node in g.params.items():
        path = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        r = row(path)
        r["placements"][fqn.rsplit(".", 1)[-1]] = format_placements(output_placement(strat(node), 0))
        i = prob.index[folding.representative(node)]
        r["memory"] += int(sum(prob.nodes[i].memory[k][choice[i]] for k in MEMORY_KINDS))
    alts: dict[str, list] = defaultdict(list)
    incident = incident_transfers(prob)
    reprice = Repricer(prob, choice)
    for n in g.ops():
        r = row(n.module_path)
        i = prob.index[folding.representative(n.name)]
        pn = prob.nodes[i]
        r["time"] += pn.compute[choice[i]]
        r["memory"] += int(pn.memory["activations"][choice[i]])
        if folding.representative(n.name) == n.name:
            alts[n.module_path].extend(_alternatives(planned, i, n, incident, reprice))
    for rs in reshardings:
        r = row(rs["module"])
        r["comm"] += rs["time"]
        r["bytes"] += int(sum(s["bytes"] for s in rs["steps"]))
    for path, items in alts.items():
        items.sort(key=lambda a: (a["delta"], a["name"]))
        rows[path]["alternatives"] = items[:ALTERNATIVES]
    for path, forms in form_report(g, planned.mesh, folding, prob, choice).items():
        row(path)["attention"] = forms
    return list(rows.values())


def _alternatives(planned: "Planned", i: int, node, incident: dict, reprice: Repricer) -> list[dict]:
    """The other strategies of one op that look cheapest locally (its compute and reshardings,
    everything else held), re-priced exactly by the evaluator: ``delta`` is the change in step time."""
    prob, choice = planned.problem, planned.choice
    pn = prob.nodes[i]
    others = [s for s in range(len(pn.strategies))
              if s != choice[i] and (pn.allowed is None or s in pn.allowed)]
    others.sort(key=lambda s: (local_cost(prob, incident, choice, i, s), s))
    base = planned.cost.step_time
    out = []
    for s in others[:2]:
        step, compute, comm = reprice.with_strategy(i, s)
        out.append({"name": f"{node.name} ({node.op.replace('aten.', '')}) as " + " | ".join(str(x) for x in pn.strategies[s]),
                    "time": compute, "comm": comm, "delta": step - base})
    return out


def trace_plan(plan) -> None:
    """With torch's structured trace on (``TORCH_TRACE``), the plan as artifacts tlparse lists beside
    the compile: ``autopar_plan`` (the plan file's JSON), ``autopar_plan_phases`` (planning seconds
    per phase) and ``autopar_plan_summary`` (the summary table). Nothing is computed when it is off."""
    trace_artifact("autopar_plan", plan.to_json)
    trace_artifact("autopar_plan_phases", lambda: dict(plan.phases))
    trace_artifact("autopar_plan_summary", plan.summary, encoding="string")

