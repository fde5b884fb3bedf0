"""Views: ops that only relabel or copy their one input, and the parameters seen through them.

Resharding commutes with these ops, so the merge pass folds them into their producer, and a
resharding of a parameter or of a view of it is a parameter gather (which the cost model may
overlap with earlier compute, and the lowering issues a layer ahead).
"""

from __future__ import annotations

import weakref

from autopar.ir.graph import Graph, Ref

#: Ops that only relabel or copy their single input: resharding commutes with them.
FOLLOWERS = frozenset(
    {
        "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.t.default",
        "aten.transpose.int", "aten.permute.default", "aten.unsqueeze.default", "aten.squeeze.dim",
        "aten.squeeze.dims", "aten.squeeze.default", "aten.detach.default", "aten.alias.default",
        "aten.clone.default", "aten._to_copy.default", "aten.contiguous.default", "autopar.hint.default",
        "aten.lift_fresh_copy.default",
    }
)


def param_views(graph: Graph) -> set[str]:
    """Parameters and layout views of them (``t``, ``view``, casts): resharding one of these is a
    parameter gather, which may run ahead under the previous compute, wherever along the chain of
    views it happens. Found once per graph (the cost model, the walk and the checkpointing and
    kept-gather searches all ask); each caller gets its own set."""
    got = _VIEWS.get(graph)
    if got is None or got[0] != len(graph.nodes):
        out = set(graph.params.values())
        for n in graph.nodes:
            if n.op in FOLLOWERS and len(n.inputs) == 1 and n.inputs[0].node in out:
                out.add(n.name)
        got = _VIEWS[graph] = (len(graph.nodes), frozenset(out))
    return set(got[1])


#: per graph: (its node count when made, its ``param_views``)
_VIEWS: "weakref.WeakKeyDictionary[Graph, tuple[int, frozenset[str]]]" = weakref.WeakKeyDictionary()


#: Ops whose output is a view of their input's storage (the program allocates nothing for them).
#: ``reshape`` copies a block it cannot view; the lowering's blocks are dense, so it views them.
ALIASES = frozenset(
    {
        "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.t.default",
        "aten.transpose.int", "aten.permute.default", "aten.unsqueeze.default", "aten.squeeze.dim",
        "aten.squeeze.dims", "aten.squeeze.default", "aten.detach.default", "aten.alias.default",
        "aten.expand.default", "aten.slice.Tensor", "aten.select.int", "aten.unbind.int",
        "aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.narrow.default",
        "aten.view_as_real.default", "aten.view_as_complex.default", "aten.diagonal.default",
    }
)


def storage_root(graph: Graph, ref: Ref) -> Ref:
    """The value whose storage ``ref`` views: followed through ``ALIASES`` ops to the first value
    that is not a view (``ref`` itself when it is none)."""
    while True:
        n = graph.node(ref.node)
        if n.op not in ALIASES or not n.inputs:
            return ref
        ref = n.inputs[0]


def storage_shares(graph: Graph, refs) -> dict[Ref, float]:
    """Per ref of ``refs`` (values saved together), the bytes its storage adds as a multiple of its
    own bytes: a view keeps its whole base alive, so the first of ``refs`` (in graph order) on a
    storage counts the base's size (``numel(base) / numel(ref)``), and the others on it nothing."""
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    seen: set[Ref] = set()
    out: dict[Ref, float] = {}
    for r in sorted(refs, key=lambda r: (order[r.node], r.index)):
        root = storage_root(graph, r)
        if root in seen:
            out[r] = 0.0
        else:
            own, base = graph.spec(r).numel, graph.spec(root).numel
            out[r] = base / own if own else 1.0
        seen.add(root)
    return out
