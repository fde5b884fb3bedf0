"""Which values a checkpointed layer instance keeps and which forward ops it re-runs in the backward.

One rule for the planner's prices and the lowering's program ("priced = executed"). For one layer
instance (``ir.layers``'s membership) and a mode:

- ``"full"``: the instance keeps only what leaves it (its forward values that any op outside the
  instance reads: the residual stream the next instance starts from); every forward op of the
  instance whose value the backward needs is re-run, from those kept values and the instance's
  inputs;
- ``"selective"``: as torchtitan's op-level policy: also keep the outputs of attention ops and of
  every other matmul (the 1st, 3rd, ... in forward order), so the re-run stops at them and the
  costly ops mostly do not run twice.

The instance's inputs (values made outside it: the previous instance's output, RoPE tables, masks)
are kept by their producers.
"""

from __future__ import annotations

import weakref
from typing import Optional

from autopar.ir.attention import ATTN_FWD
from autopar.ir.graph import Graph, Phase, Ref
from autopar.ir.layers import Key, Layers, layers
from autopar.ir.views import ALIASES, param_views, storage_shares

#: the checkpointing modes, as ``Plan.checkpointing`` names them
MODES = ("full", "selective")

#: matmuls: selective mode keeps every other one's output (counted per instance, forward order)
MATMULS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"})
#: attention: selective mode keeps every one's outputs
ATTENTION = frozenset({
    ATTN_FWD,
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "autopar.random_attention.default",
})


#: per graph: (its node count when made, (node order, ``graph.users()``, ``param_views(graph)``))
_SCANS: "weakref.WeakKeyDictionary[Graph, tuple[int, tuple]]" = weakref.WeakKeyDictionary()


#: per graph: (its node count, instance key, mode) -> the ops ``instance_plan`` re-runs (``recomputed_ops``)
_PLANS: "weakref.WeakKeyDictionary[Graph, dict]" = weakref.WeakKeyDictionary()


def _scan(graph: Graph) -> tuple[dict, dict, set]:
    """The graph's node order, readers and parameter views, made once per graph (every instance and
    mode the checkpointing search prices reads them; read only here)."""
    got = _SCANS.get(graph)
    if got is None or got[0] != len(graph.nodes):
        got = _SCANS[graph] = (len(graph.nodes), ({n.name: i for i, n in enumerate(graph.nodes)}, graph.users(),
                                                   param_views(graph)))
    return got[1]


def instance_plan(graph: Graph, membership: Layers, key: Key, mode: str, *, users: Optional[dict] = None,
                  views: Optional[set[str]] = None) -> tuple[frozenset[Ref], frozenset[str]]:
    """``(kept, recomputed)`` for instance ``key`` checkpointed in ``mode``: the instance's forward
    values it keeps for the backward, and the names of its forward ops the backward re-runs.
    ``users`` (``graph.users()``) and ``views`` (``views.param_views(graph)``): passed by a caller
    that asks for many instances, so the graph is scanned once, not once per instance."""
    if mode not in MODES:
        raise ValueError(f"checkpointing mode {mode!r}: expected one of {MODES}")
    names = membership.instances[key]
    inside = set(names)
    if views is None:
        views = _scan(graph)[2]  # the backward derives parameters' views again in any case
    if users is None:
        users = _scan(graph)[1]
    forward = [graph.node(n) for n in names if graph.node(n).phase == Phase.FORWARD
               and not graph.node(n).is_placeholder and n not in views]
    made = {n.name for n in forward}
    kept: set[Ref] = set()
    needed: set[Ref] = set()  # forward values of the instance the backward reads
    for src in made:
        for u in users[src]:
            n = graph.node(u)
            for r in n.inputs:
                if r.node != src:
                    continue
                if n.name not in inside:  # leaves the instance: kept (the next instance starts from it)
                    kept.add(r)
                elif n.phase == Phase.BACKWARD:
                    needed.add(r)
    policy: set[Ref] = set()  # the values selective mode keeps besides the boundary
    if mode == "selective":
        matmuls = 0
        for n in forward:
            if n.op in MATMULS:
                matmuls += 1
            if n.op in ATTENTION or (n.op in MATMULS and matmuls % 2 == 1):
                policy.update(Ref(n.name, j) for j, o in enumerate(n.outputs) if o is not None)
    # what the re-run must make: the needed values not kept, and recursively what they are made from
    stop = kept | policy
    redo: set[str] = set()
    todo = sorted((r for r in needed if r not in stop), key=lambda r: (r.node, r.index))
    while todo:
        r = todo.pop()
        if r.node in redo:
            continue
        redo.add(r.node)
        todo.extend(x for x in graph.node(r.node).inputs if x.node in made and x not in stop)
    # a policy value is kept only when the backward or the re-run reads it
    reads = {x for n in redo for x in graph.node(n).inputs} | needed
    kept |= {r for r in policy if r in reads}
    return frozenset(kept), frozenset(redo)


def recomputed_ops(graph: Graph, checkpointing: dict[str, str]) -> frozenset[str]:
    """Every forward op the backward re-runs for ``checkpointing`` (``Plan.checkpointing``: module
    path of each recomputed layer instance -> mode); a ValueError names a path that is no layer
    instance of ``graph`` or an unknown mode."""
    if not checkpointing or not graph.training:  # (no backward: nothing to recompute)
        return frozenset()
    membership = layers(graph)
    paths = {(f"{prefix}.{i}" if prefix else str(i)): (prefix, i) for prefix, i in membership.instances}
    out: set[str] = set()
    _, users, views = _scan(graph)
    plans = _PLANS.setdefault(graph, {})
    for path, mode in sorted(checkpointing.items()):
        if path not in paths:
            known = ", ".join(sorted(paths)[:4]) or "none"
            raise ValueError(f"the plan checkpoints {path!r}, which is not a layer instance of this model "
                             f"(instances: {known} ...)")
        if mode not in MODES:
            raise ValueError(f"the plan checkpoints {path!r} in mode {mode!r}: expected one of {MODES}")
        key = (len(graph.nodes), paths[path], mode)
        if key not in plans:  # (a search walks many plans recomputing the same instances)
            plans[key] = instance_plan(graph, membership, paths[path], mode, users=users, views=views)[1]
        out |= plans[key]
    return frozenset(out)


def recompute_peak_share(graph: Graph, membership: Layers, key: Key, mode: str) -> float:
    """The most bytes of re-run values alive at once in instance ``key``'s backward, as a share of
    what the instance saves when it is not checkpointed (whole tensors, placements aside).

    The lowering re-runs a forward op where the backward first needs its value (or a re-run op
    needs it) and frees the value after its last reader, so a checkpointed instance never holds
    all of its recomputed values at once: its backward walks through them. Views allocate nothing
    and count for nothing, here and in the saved bytes (``views.storage_shares``)."""
    _, redo = instance_plan(graph, membership, key, mode)
    order, users, _ = _scan(graph)
    born: dict[str, int] = {}

    def readers(name: str) -> list[str]:
        return [u for u in users[name] if u in redo or graph.node(u).phase == Phase.BACKWARD]

    def birth(name: str) -> int:  # the backward op before which it is re-run (first need, maybe through re-run ops)
        if name not in born:
            born[name] = min((order[u] if u not in redo else birth(u) for u in readers(name)), default=len(order))
        return born[name]

    def moment(name: str) -> tuple[int, int, int]:  # a backward op runs after the re-runs it triggers
        return (birth(name), 0, order[name]) if name in redo else (order[name], 1, 0)

    events: list[tuple[tuple[int, int, int], int, int]] = []
    for name in sorted(redo, key=order.__getitem__, reverse=True):  # readers first: shallow recursion
        node = graph.node(name)
        if node.op in ALIASES:
            continue
        nbytes = sum(o.nbytes for o in node.outputs if o is not None)
        last = max((moment(u) for u in _through_views(graph, name, readers)), default=moment(name))
        events += [(moment(name), 0, nbytes), (last, 1, -nbytes)]  # freed after its last reader ran
    live = peak = 0
    for _, _, d in sorted(events):
        live += d
        peak = max(peak, live)
    saved = saved_bytes(graph, membership, key)
    return peak / saved if saved else 0.0


def _through_views(graph: Graph, name: str, readers) -> list[str]:
    """``readers(name)``, and the readers of any view of it (a view keeps its base's storage)."""
    out, todo = [], list(readers(name))
    while todo:
        u = todo.pop()
        out.append(u)
        if graph.node(u).op in ALIASES:
            todo.extend(readers(u))
    return out


def saved_bytes(graph: Graph, membership: Layers, key: Key) -> int:
    """Bytes of instance ``key``'s forward values that the backward reads (whole tensors; the
    parameters' views left out, each storage once and whole), as the cost model counts them."""
    views = param_views(graph)
    inside = set(membership.instances[key])
    backward = {n.name for n in graph.nodes if n.phase == Phase.BACKWARD}
    refs = [r for n in graph.nodes if n.name in backward for r in n.inputs
            if r.node in inside and r.node not in views and not graph.node(r.node).is_placeholder
            and graph.node(r.node).phase == Phase.FORWARD]
    shares = storage_shares(graph, set(refs))
    return int(sum(graph.spec(r).nbytes * k for r, k in shares.items()))


__all__ = ["ATTENTION", "MATMULS", "MODES", "instance_plan", "recompute_peak_share", "recomputed_ops", "saved_bytes"]
