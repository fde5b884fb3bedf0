"""Parameter gather groups: which parameter gathers run together as one all-gather, as FSDP2 does.

A parameter (or a layout view of one) resharded for its consumer by all-gathers only (FSDP: one
all-gather; over two data axes, one per axis) joins a *group* of gathers with the same sequence of
axes, the same dtype and bytes per element, in the same phase (the backward gathers again) and of
the same layer instance (``ir.layers.layers``, the membership ``fold`` folds by: ``layers.3``); gathers of
parameters outside the layers fill groups of up to ``BUCKET_SIZE`` bytes (of their first
step) in the order the program first reads them. A group runs one all-gather per step on a packed
buffer, so it pays each collective's latency once. The plan's report (``mark_param_groups``) and
the lowering both call ``gather_groups``, so the collectives a plan predicts are the ones its
program runs; the cost model prices each gather at its bandwidth and its share of the group's
latency (``gather_time``; outside the numbered layers, the whole latency).
"""

from __future__ import annotations

from typing import Collection, Hashable, Mapping, Optional, Sequence

from autopar.cost_model.buckets import BUCKET_SIZE, shared_latency_time
from autopar.cost_model.comm import Step, reshard_steps
from autopar.cost_model.precision import element_bytes
from autopar.ir.graph import Graph, Ref
from autopar.ir.layers import layers
from autopar.ir.placement import parse
from autopar.ir.views import param_views


def gather_key(steps: Sequence[Step], dtype, elem_bytes: int) -> Optional[tuple]:
    """The key a gather shares a collective by (its axes, its dtype and bytes per element), or None
    when it cannot: a resharding with any step other than an all-gather."""
    if not steps or any(s.kind != "all_gather" for s in steps):
        return None
    return tuple(s.axis for s in steps), str(dtype), int(elem_bytes)


def param_of(graph: Graph, name: str, fqn_of: Optional[dict[str, str]] = None) -> Optional[str]:
    """The FQN of the parameter that node ``name`` is (or is a layout view of), else None
    (``fqn_of``: placeholder name -> FQN, when the caller has it)."""
    if fqn_of is None:
        fqn_of = {node: fqn for fqn, node in graph.params.items()}
    while name not in fqn_of:
        node = graph.node(name)
        if node.is_placeholder or len(node.inputs) != 1:
            return None
        name = node.inputs[0].node
    return fqn_of[name]


def gather_groups(graph: Graph, gathers: Sequence[tuple[Hashable, Ref, str, Sequence[Step]]],
                  elem_bytes: dict[Ref, int],
                  reads: Optional[Mapping[str, Collection[Hashable]]] = None) -> dict[Hashable, int]:
    """``{key: group index}`` for the parameter gathers that can share a collective. ``gathers``
    lists ``(key, ref, phase, steps)`` in the order the program first reads them (one entry per
    tensor, target placement and phase); ``elem_bytes`` gives each ref's bytes per element as it
    moves. ``reads`` maps an op's name to the gathers it reads: a gather whose tensor is made from
    a gathered value runs alone (``_without_chained``). Indices count groups in the order they
    open."""
    layer_of_ref: dict[str, Optional[tuple]] = {}
    fqn_of = {node: fqn for fqn, node in graph.params.items()}
    membership = layers(graph)
    open_group: dict[tuple, tuple[int, int]] = {}  # (phase, layer, key) -> (group index, bytes so far)
    out: dict[Hashable, int] = {}
    count = 0
    for key, ref, phase, steps in gathers:
        gkey = gather_key(steps, graph.spec(ref).dtype, elem_bytes[ref])
        if gkey is None:
            continue
        if ref.node not in layer_of_ref:
            fqn = param_of(graph, ref.node, fqn_of)
            layer_of_ref[ref.node] = membership.of(graph.params[fqn]) if fqn else None
        layer = layer_of_ref[ref.node]
        nbytes = steps[0].bytes
        cur = open_group.get((phase, layer, gkey))
        if cur is None or (layer is None and cur[1] and cur[1] + nbytes > BUCKET_SIZE):
            cur = (count, 0)
            count += 1
        out[key] = cur[0]
        open_group[(phase, layer, gkey)] = (cur[0], cur[1] + nbytes)
    return _without_chained(graph, gathers, out, reads or {})


def _without_chained(graph: Graph, gathers, out: dict[Hashable, int],
                     reads: Mapping[str, Collection[Hashable]]) -> dict[Hashable, int]:
    """``out`` less the gathers whose tensor is made from a gathered value (a backward ``t(t(w))``
    whose ``t(w)`` is read at a gathered placement): a group's members are made where the program
    first needs the group, and making one must not need another group's collective (two such
    groups can wait on each other). Such a gather runs alone."""
    ref_of = {key: ref for key, ref, _, _ in gathers}
    chained: dict[str, bool] = {}

    def needs_gather(name: str) -> bool:
        if name not in chained:
            chained[name] = False  # a graph has no cycles; this only stops a revisit
            chained[name] = bool(reads.get(name)) or any(needs_gather(r.node) for r in graph.node(name).inputs)
        return chained[name]

    return {key: gid for key, gid in out.items() if not needs_gather(ref_of[key].node)}


def gather_shares(graph: Graph) -> dict[str, float]:
    """For every parameter and layout view of one (``ir.views.param_views``): the part of its
    group's latency its gather pays. A layer's parameters are gathered together: the share is the
    parameter's part of its layer instance's elements. Outside the numbered layers the whole
    latency: those groups are few (embedding, final norm, head), and a model without numbered
    layers may gather one weight alone (priced at a share, the ILP took gathers that ran alone for
    cheaper than the all-reduce they replaced)."""
    membership = layers(graph)
    totals: dict[Optional[tuple], int] = {}
    for fqn, node in graph.params.items():
        layer = membership.of(node)
        totals[layer] = totals.get(layer, 0) + graph.spec(Ref(node)).numel
    out: dict[str, float] = {}
    fqn_of = {node: fqn for fqn, node in graph.params.items()}
    for name in param_views(graph):
        fqn = param_of(graph, name, fqn_of)
        layer = membership.of(graph.params[fqn]) if fqn else None
        out[name] = graph.spec(Ref(name)).numel / totals[layer] if layer is not None else 1.0
    return out


def gather_time(shape, src, dst, mesh, elem_bytes: int, share: float = 1.0) -> float:
    """Seconds to gather a parameter from ``src`` to ``dst``. When its steps are all-gathers, its
    group pays each collective's latency once: the gather pays the bandwidth term of each step and
    its ``share`` of the latency (``gather_shares``). Otherwise the resharding's own time."""
    if tuple(src) == tuple(dst):
        return 0.0
    steps = reshard_steps(shape, src, dst, mesh, elem_bytes)
    if gather_key(steps, None, elem_bytes) is None:
        return sum(s.time for s in steps)
    return shared_latency_time(steps, min(1.0, share), mesh)


def mark_param_groups(graph: Graph, reshardings: list[dict], mesh, precision) -> None:
    """Set ``"bucket"`` (the group's index) on the plan's parameter gathers (``kind == "param"``)
    that share a collective, exactly as the lowering groups them; ``reshardings`` lists them in
    the order the program first reads them."""
    gathers, entry_of, eb, reads = [], {}, {}, {}
    for i, r in enumerate(reshardings):
        if r["kind"] != "param":
            continue
        name, _, index = r["tensor"].partition("[")
        ref = Ref(name, int(index[:-1]) if index else 0)
        spec = graph.spec(ref)
        eb[ref] = element_bytes(spec.dtype, "gather", precision)
        steps = reshard_steps(spec.shape, parse(r["from"], ndim=mesh.ndim), parse(r["to"], ndim=mesh.ndim), mesh,
                              eb[ref])
        # (a checkpointed layer's forward op, re-run in the backward, reads its weight there)
        gathers.append((i, ref, r.get("phase") or graph.node(r["consumer"]).phase.value, steps))
        entry_of[i] = r
        for consumer in r.get("consumers") or [r["consumer"]]:
            reads.setdefault(consumer, []).append(i)
    for i, b in gather_groups(graph, gathers, eb, reads).items():
        entry_of[i]["bucket"] = b


__all__ = ["gather_groups", "gather_key", "gather_shares", "gather_time", "mark_param_groups", "param_of"]
