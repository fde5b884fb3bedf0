"""Views: ops that only relabel or copy their one input, and the parameters seen through them.

Resharding commutes with these ops, so the merge pass folds them into their producer, and a
resharding of a parameter or of a view of it is a parameter gather (which the cost model may
overlap with earlier compute, and the lowering issues a layer ahead).
"""

from __future__ import annotations

from autopar.ir.graph import Graph

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
    views it happens."""
    out = set(graph.params.values())
    for n in graph.nodes:
        if n.op in FOLLOWERS and len(n.inputs) == 1 and n.inputs[0].node in out:
            out.add(n.name)
    return out
