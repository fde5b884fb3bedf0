"""The projection of an op-level plan onto module-level styles, and its price.

A plan chooses a placement per op; DTensor's ``parallelize_module`` styles and FSDP2's ``fully_shard``
say only, per ``nn.Linear``, column-parallel, row-parallel or replicated on the tensor axis, and per
module whether its parameters are sharded over the data axes. ``styles`` reads those choices off the
plan and the model's graph; ``project`` fixes the parameters and inputs to them, completes the
activations as the styles run them (``passes.search.complete``, Megatron's activation rule on the
tensor axis, as the ``megatron_tp`` recipe is completed) and prices the result with the planner's
own evaluator, as a ``Plan`` beside the original.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from autopar.cost_model.mesh import Mesh
from autopar.errors import PlanError
from autopar.export import sequence as seq
from autopar.ir.attention import ATTN_FWD
from autopar.ir.fingerprint import graph_fingerprint, graph_info
from autopar.ir.graph import Graph
from autopar.ir.placement import B, Partial, Split, blocks_fit, parse
from autopar.passes.search import checkpoint, peak, recipes
from autopar.passes.search.complete import complete
from autopar.passes.search.problem import evaluate
from autopar.passes.search.strategies import output_placement
from autopar.planner.intra import Planned, run_passes
from autopar.planner.options import PlanOptions
from autopar.planner.report import build_plan
from autopar.plans.schema import Plan, graph_differences


@dataclass
class Styles:
    """What the module-level export applies: the mesh's ``tensor_axis`` (None: no tensor
    parallelism) and ``data_axes`` (FSDP2 shards over the last, replicates over the others), the
    Linear modules' ``linear`` style by module path (``"colwise"`` or ``"rowwise"``; the others are
    replicated on the tensor axis), the head-count attributes the split attention modules must read
    as their local counts (``local_heads``), the ``fully_shard`` units (layer instances, then the root ``""``)
    with ``reshard`` after forward per unit, and the recomputed layers (``checkpointed``)."""

    tensor_axis: Optional[str]
    data_axes: tuple[str, ...]
    linear: dict[str, str] = field(default_factory=dict)
    units: list[str] = field(default_factory=list)
    reshard: dict[str, bool] = field(default_factory=dict)
    checkpointed: dict[str, str] = field(default_factory=dict)
    #: attention modules split on the tensor axis: module path -> {head-count attribute: its local value}
    local_heads: dict[str, dict[str, int]] = field(default_factory=dict)
    #: sequence parallelism on the tensor axis: module path -> its role (``export.sequence``; empty: none)
    sequence: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _split_dim(text: str, axis: int) -> Optional[int]:
    """The dim placement ``text`` splits on mesh axis ``axis`` (None: not split there)."""
    p = parse(text)[axis]
    return p.dim if isinstance(p, Split) else None


def _tensor_axis(plan: Plan) -> Optional[int]:
    """The mesh axis the plan runs tensor parallelism on: where the most weight matrices are split
    and never gathered (used where they lie), if any."""
    # (``graph.shapes``: "dtype[rows, cols]" per parameter)
    mats = {fqn for fqn, shape in plan.graph.get("shapes", {}).items() if shape.count(",") == 1}
    gathered: dict[str, set[str]] = {}
    for r in plan.reshardings:
        if r.get("kind") == "param":
            gathered.setdefault(r.get("module", ""), set()).update(
                s["axis"] for s in r.get("steps", []) if s.get("kind") == "all_gather")
    counts = [0] * len(plan.axis_names)
    for fqn in mats:
        module = fqn.rpartition(".")[0]
        for a, axis in enumerate(plan.axis_names):
            if _split_dim(plan.placements.get(fqn, "B"), a) is not None and axis not in gathered.get(module, ()):
                counts[a] += 1
    best = max(range(len(counts)), key=lambda a: (counts[a], a)) if counts else 0
    return best if counts and counts[best] else None


def _attention_nodes(graph: Graph) -> set[str]:
    """The graph's attention ops (the device-neutral op, or an SDPA kernel captured as is)."""
    return {n.name for n in graph.ops() if n.op == ATTN_FWD or "scaled_dot_product" in n.op}


def _head_attributes(model, path: str, sizes: set[int], degree: int) -> Optional[dict[str, int]]:
    """The local values of the head-count attributes of the attention module at ``path`` (int
    attributes named ``*head*``, not ``*dim*``/``*size*``, whose value is a size the split dim takes
    in the graph and divides by ``degree``); None when it has none, or one that does not divide."""
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    found = {k: v for k, v in sorted(vars(module).items()) if type(v) is int and "head" in k.lower()
             and "dim" not in k.lower() and "size" not in k.lower() and v in sizes}
    if not found or any(v % degree for v in found.values()):
        return None
    return {k: v // degree for k, v in found.items()}


def _is_linear(model, path: str) -> bool:
    """Whether ``model`` (None: not known) has an ``nn.Linear`` at ``path``, which the styles split."""
    try:
        return model is not None and isinstance(model.get_submodule(path), torch.nn.Linear)
    except AttributeError:
        return False


_FOUND = object()  # ``styles``'s default: the tensor axis read off the plan


def styles(plan: Plan, graph: Optional[Graph], model=None, tensor_axis=_FOUND,
           sequence_parallel: Optional[bool] = None, loss_parallel: Optional[bool] = None) -> Styles:
    """The module-level choices closest to ``plan`` on ``graph`` (the plan's model, captured).

    On the tensor axis a pair of weights Megatron would split together (``recipes.tensor_layout``:
    ``fc`` column-, ``proj`` row-parallel) is split when the plan splits either of them there and
    nothing between them needs the whole dim, and every one is an ``nn.Linear``. A pair through attention (``wq``..``wo``) is split
    only when ``model``'s attention module holds its head counts in attributes (``n_heads``,
    ``num_key_value_heads``: ``_head_attributes``), which the exported code sets to the local counts
    (a module style hands the attention its local heads), and no weight of the pair is fused
    (``qkv`` as blocks: a contiguous column split would mix them); else it stays replicated.
    Without the graph (``None``) the axes are found, not the styles. ``tensor_axis`` (an index, or
    None for none) overrides the axis read off the plan. ``sequence_parallel``: None adds sequence
    parallelism (``export.sequence``) where the plan splits the norms' activations along the tokens
    on the tensor axis, True wherever the model's shape lets the styles say it, False never;
    ``loss_parallel`` likewise for the output head's vocabulary split (``_vocabulary``)."""
    t = _tensor_axis(plan) if tensor_axis is _FOUND else tensor_axis
    names = plan.axis_names
    out = Styles(names[t] if t is not None else None, tuple(a for i, a in enumerate(names) if i != t))
    for g in plan.layer_groups:
        for p in g.get("paths", []):
            out.units.append(p)
            out.reshard[p] = p not in plan.kept_gathers
    out.units.append("")
    out.reshard[""] = False  # FSDP2 keeps the root's parameters gathered from forward to backward
    out.checkpointed = dict(plan.checkpointing)
    if t is None or graph is None:
        return out
    fqn_of = {node: fqn for fqn, node in graph.params.items()}
    layout, regions = recipes.tensor_layout(graph), recipes.regions_of(graph)
    pairs = regions.pairs()
    attention = _attention_nodes(graph)
    seen: set[str] = set()
    for node, d in sorted(pairs.items()):
        if node in seen:
            continue
        reach = regions.reach(node, d)
        members = sorted({ref.node for ref, _ in reach if ref.node in pairs})
        seen.update(members)
        modules = sorted({fqn_of[m].rpartition(".")[0] for m in members if m in fqn_of})
        split = any(_split_dim(plan.placements.get(fqn_of.get(m, ""), "B"), t) is not None for m in members)
        if not split:
            continue
        others = [m for m in modules if not _is_linear(model, m)]
        if others:  # a style splits nn.Linear modules only
            out.notes.append(f"{', '.join(modules)}: replicated on {names[t]!r} ({', '.join(others)} "
                             "not an nn.Linear)")
            continue
        if any(ref.node in attention for ref, _ in reach):
            sizes = {graph.node(ref.node).outputs[ref.index].shape[d] for ref, d in reach
                     if graph.node(ref.node).outputs[ref.index] is not None}
            kept = []
            for parent in sorted({m.rpartition(".")[0] for m in modules}):  # each attention module
                mine = [m for m in members if fqn_of.get(m, "").startswith(parent + ".")]
                heads = None
                if model is not None and not any(graph.node(m).out.blocks for m in mine):
                    heads = _head_attributes(model, parent, sizes, plan.mesh_shape[t])
                if heads is None:
                    out.notes.append(f"{parent or 'the model'}: replicated on {names[t]!r} (its projections run "
                                     "through attention, and it has no head-count attribute to localize, "
                                     "or a fused weight)")
                    continue
                out.local_heads[parent] = heads
                kept += mine
            members = kept
        for m in members:
            if m in fqn_of and fqn_of[m].endswith(".weight"):
                out.linear[fqn_of[m].rpartition(".")[0]] = "colwise" if layout.get(m, pairs[m]) == 0 else "rowwise"
    alone = sorted(fqn_of[p].rpartition(".")[0] for p in layout if p not in pairs and p in fqn_of
                   and graph.node(p).out.ndim == 2 and _split_dim(plan.placements.get(fqn_of[p], "B"), t) is not None)
    if sequence_parallel is not False and model is not None:
        found, reason = seq.sequence_modules(model, out.units, out.linear)
        if found and (sequence_parallel or seq.token_split(plan.nodes, found, t)):
            out.sequence = found
            _vocabulary(plan, graph, model, out, t, loss_parallel)
        elif sequence_parallel and reason:
            out.notes.append(seq.why_not(reason, names[t]))
    alone = [m for m in alone if m not in out.linear]
    if alone:  # the output head, the token embedding
        out.notes.append(f"{', '.join(alone)}: replicated on {names[t]!r} (the output head is split on the "
                         "vocabulary with sequence parallelism and one cross-entropy computed under loss_parallel; "
                         "the token embedding's table is not split)")
    return out


def _vocabulary(plan: Plan, graph: Graph, model, st: Styles, t: int, loss_parallel: Optional[bool]) -> None:
    """With sequence parallelism, the output head split on the vocabulary (column-parallel, the
    loss computed on the split logits under ``loss_parallel``) where the plan splits its weight's
    rows on the tensor axis (``loss_parallel`` None) or always (True) and the model's loss allows
    it (``sequence.loss_head``); a note says why not when asked for."""
    if loss_parallel is False:
        return
    head = next(p for p, role in st.sequence.items() if role == seq.EXIT)
    why = seq.loss_head(graph, model, head)
    if not why and (loss_parallel or _split_dim(plan.placements.get(head + ".weight", "B"), t) == 0):
        st.sequence[head], st.linear[head] = seq.VOCAB, "colwise"
    elif loss_parallel:
        st.notes.append(f"{head}: replicated on {plan.axis_names[t]!r} ({why})")


def _placements(graph: Graph, mesh: Mesh, st: Styles) -> dict[str, list[tuple]]:
    """The projected placements of the graph's parameters and inputs, as completion constraints."""
    names = list(mesh.names)
    t = names.index(st.tensor_axis) if st.tensor_axis else None
    shard = names.index(st.data_axes[-1]) if st.data_axes else None
    data = [names.index(a) for a in st.data_axes]
    allowed: dict[str, list[tuple]] = {}
    for fqn, node in graph.params.items():
        spec = graph.node(node).out
        base: list = [B] * mesh.ndim
        module, _, leaf = fqn.rpartition(".")
        style = st.linear.get(module)
        if t is not None and style == "colwise":
            base[t] = Split(0)
        elif t is not None and style == "rowwise" and leaf == "weight":
            base[t] = Split(1)
        # FSDP2 shards dim 0 of each rank's tensor-parallel shard (a strided shard when the tensor
        # axis splits dim 0 too): a column-parallel weight is priced with the data axis on dim 1,
        # which gathers and reduces the same bytes over the data axis alone
        dims = (1, 0) if t is not None and base[t] == Split(0) and spec.ndim == 2 else (0,)
        for d in dims if shard is not None and spec.ndim else ():
            trial = list(base)
            trial[shard] = Split(d)
            if spec.shape[d] >= math.prod(mesh.shape[a] for a, p in enumerate(trial) if p == Split(d)) \
                    and blocks_fit(spec.shape, trial, mesh.shape, spec.blocks):
                base = trial
                break
        allowed[node] = [tuple(base)]
    pieces = math.prod(mesh.shape[a] for a in data)
    for key, node in graph.inputs.items():
        spec = graph.node(node).out
        if spec.ndim == 0:
            continue
        if spec.shape[0] % pieces:
            raise PlanError(f"export: input {key!r} has batch {spec.shape[0]}, not a multiple of the {pieces} "
                            f"devices of the data axes {list(st.data_axes)}")
        allowed[node] = [tuple(Split(0) if a in data else B for a in range(mesh.ndim))]
    return allowed


def unit_of(units: list[str], module: str) -> str:
    """The ``fully_shard`` unit holding ``module``'s parameters (the root ``""`` when no layer does)."""
    return max((u for u in units if u and (module == u or module.startswith(u + "."))), key=len, default="")


def _no_partial_outside(planned: Planned, plan: Plan, st: Styles, t: int) -> dict[str, list[tuple]]:
    """Output constraints for the ops outside the tensor-parallel Linear modules: no partial sums on
    the tensor axis there, since a row-parallel module's output and a column-parallel module's input
    gradient are all-reduced at the module's boundary (the style's ``Replicate`` layouts)."""
    module = {n["name"]: n.get("module", "") for n in plan.nodes}
    skip = set(planned.graph.params.values()) | set(planned.graph.inputs.values())
    out = {}
    for n in planned.merged.problem.nodes:
        if n.name in skip or module.get(n.name, "") in st.linear:
            continue
        places = list(dict.fromkeys(output_placement(s, 0) for s in n.strategies))
        ok = [p for p in places if p is not None and not isinstance(p[t], Partial)]
        if ok and len(ok) < len(places):
            out[n.name] = ok
    return out


@dataclass
class Projection:
    """The projected plan (``plan``: priced by the planner's evaluator, as a ``Plan``), the styles
    it applies, the ops whose placements it changed (``(node, module, original, projected)``) and
    the step time of each projection compared (``tried``: by its tensor axis, None for none)."""

    plan: Plan
    styles: Styles
    changed: list[tuple[str, str, str, str]]
    tried: dict[Optional[str], float] = field(default_factory=dict)


def project(plan: Plan, model, example_inputs=(), example_kwargs=None,
            tensor_parallel: Optional[bool] = None, sequence_parallel: Optional[bool] = None,
            loss_parallel: Optional[bool] = None) -> Projection:
    """Project ``plan`` (made for ``model`` with these inputs) onto module-level styles and price it:
    the styles with the tensor axis read off the plan and those without tensor parallelism are
    both priced, and the faster that fits the plan's budget is the projection (its ``styles.notes``
    give the other's price). ``tensor_parallel`` True keeps the plan's tensor axis, False drops it;
    ``sequence_parallel`` and ``loss_parallel`` as ``styles`` takes them."""
    if plan.pipeline is not None:
        raise PlanError("export: pricing the projection of a pipelined plan is not supported; export its "
                        "stages' layout from a plan of one stage (autopar.plan without a pp axis)")
    mesh = Mesh.from_dict(plan.mesh)
    # (a plan written without a budget has 0 there)
    opts = PlanOptions(training=plan.training, memory_budget=plan.memory_budget or math.inf, search="propagate",
                       precision=plan.precision.get("name"), optimizer=plan.precision.get("optimizer", "adamw"),
                       checkpointing=dict(plan.checkpointing) or "none", kept_gathers=list(plan.kept_gathers),
                       progress=False, capture_outputs=True)
    planned = run_passes(model, mesh, example_inputs, example_kwargs, opts)
    _check_same_graph(plan, planned.graph)
    found = _tensor_axis(plan)
    # the styles with the plan's tensor axis, and without tensor parallelism: the faster that fits
    axes = {None: [found, None], True: [found], False: [None]}[tensor_parallel]
    tried = [_priced(plan, planned, styles(plan, planned.graph, model, t, sequence_parallel, loss_parallel),
                     mesh) for t in dict.fromkeys(axes)]
    fits = [p for p in tried if p.plan.fits] or tried
    best = min(fits, key=lambda p: p.plan.step_time)
    best.tried = {p.styles.tensor_axis: p.plan.step_time for p in tried}
    for other in tried:
        if other is not best:
            axis = other.styles.tensor_axis
            how = f"tensor-parallel on {axis!r}" if axis else "without tensor parallelism"
            best.styles.notes.append(f"the styles {how} price at {other.plan.step_time * 1e3:.4g} ms"
                                     f"{'' if other.plan.fits else ' and do not fit'}")
    return best


def _check_same_graph(plan: Plan, graph: Graph) -> None:
    """A PlanError listing the differences unless ``graph`` is the graph ``plan`` was made for."""
    want = plan.fingerprint.get("graph")
    if want in (graph_fingerprint(graph), graph_fingerprint(graph, legacy=True)):
        return
    lines = graph_differences(plan.graph, graph_info(graph)) or ["the graphs' fingerprints differ"]
    raise PlanError("export: the model (or its example inputs) is not the one the plan was made for: "
                    + "; ".join(lines) + "; pass the plan's model and example inputs")


def _priced(plan: Plan, planned: Planned, st: Styles, mesh: Mesh) -> Projection:
    """The styles ``st`` as an op-level assignment on ``planned``'s problem, priced."""
    graph = planned.graph
    t = [list(mesh.names).index(st.tensor_axis)] if st.tensor_axis else []
    allowed = _placements(graph, mesh, st)
    regions = recipes.regions_of(graph) if t else None
    if t:
        allowed.update(_no_partial_outside(planned, plan, st, t[0]))
    if t and st.sequence:  # in the layers, DTensor carries partial sums to the sequence's reduce-scatters
        vocab = seq.VOCAB in st.sequence.values()  # the loss's ops then take the split logits' partial sums
        inside = {n["name"] for n in plan.nodes if unit_of(st.units, n.get("module", ""))
                  or n.get("module", "") in st.sequence or (vocab and not n.get("module", ""))}
        fixed = set(graph.params.values()) | set(graph.inputs.values())  # the styles' own placements
        allowed = {k: v for k, v in allowed.items() if k not in inside or k in fixed}
        residual = seq.residual_placements(planned.merged.problem, graph, plan.nodes, st.sequence, st.units,
                                           st.linear, t[0])
        allowed.update(residual)
        for head, role in st.sequence.items():
            if role == seq.VOCAB:
                allowed.update(seq.loss_placements(planned.merged.problem, graph, plan.nodes, head, t[0]))
        regions = seq.SequenceRegions(regions, set(residual))
    choice = complete(planned.merged, planned.problem, allowed, t, exact=True, regions=regions,
                      label=graph.user_name)
    # priced as ``run_passes`` prices its chosen plan: the evaluator's figures with the walked peak
    rc = planned.recompute
    redo = checkpoint.checkpointed_paths(planned.terms, rc) if rc is not None and rc.any else None
    kept = [p for ps in planned.kept_paths for p in ps]
    top = peak.choice_peak(graph, mesh, planned.precision, planned.folding, planned.problem, choice, redo, kept)
    cost = peak.with_peak(evaluate(planned.problem, choice), top)
    projected = build_plan(replace(planned, choice=choice, cost=cost, source="projection", solution=None, peak=top))
    return Projection(projected, st, changed_ops(plan, projected))


def changed_ops(a: Plan, b: Plan) -> list[tuple[str, str, str, str]]:
    """The parameters and inputs, then the ops, whose placements differ between ``a`` and ``b``."""
    out = [(fqn, fqn.rpartition(".")[0], a.placements[fqn], b.placements[fqn]) for fqn in a.placements
           if fqn in b.placements and a.placements[fqn] != b.placements[fqn]]
    before = {n["name"]: n for n in a.nodes}
    for n in b.nodes:
        old = before.get(n["name"])
        if old is not None and old.get("outputs") != n.get("outputs"):
            out.append((n["name"], n.get("module", ""), "; ".join(old.get("outputs", [])),
                        "; ".join(n.get("outputs", []))))
    return out


__all__ = ["Projection", "Styles", "changed_ops", "project", "styles", "unit_of"]
