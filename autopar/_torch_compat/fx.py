"""fx internals: node-metadata annotation (``torch.fx.traceback``), the graph's code generator
(``Graph._codegen``) and torch's pytree (``torch.utils._pytree``), torch 2.13.

On a torch upgrade: check that ``torch.fx.traceback.annotate`` still puts its dict under
``node.meta["custom"]`` (capture reads it back), that ``preserve_node_meta`` still exists, that
``torch.fx.graph.CodeGen`` is the flat default code generator and ``Graph._codegen`` where a graph
keeps it, that ``torch.utils._pytree`` keeps ``tree_flatten``/``tree_map``/``keystr``, and that
``Node._rename`` still renames through the graph's namespace.
"""

from __future__ import annotations

import torch
import torch.fx.traceback as _fx_traceback
import torch.utils._pytree as pytree

#: ``with annotate({...}):`` — fx nodes traced inside carry the dict in ``node.meta["custom"]``.
annotate = _fx_traceback.annotate
#: ``with preserve_node_meta():`` — tracing keeps (and copies onto new nodes) the current node meta.
preserve_node_meta = _fx_traceback.preserve_node_meta

tree_flatten = pytree.tree_flatten
tree_unflatten = pytree.tree_unflatten
tree_map = pytree.tree_map
tree_leaves = pytree.tree_leaves


def use_flat_calling_convention(gm: torch.fx.GraphModule) -> None:
    """Make ``gm`` take its placeholders as flat positional arguments and return a flat tuple
    (the export's pytree in/out specs no longer hold once placeholders are removed)."""
    gm.graph._codegen = torch.fx.graph.CodeGen()


def rename_node(node: torch.fx.Node, candidate: str) -> str:
    """Name ``node`` ``candidate``, or ``candidate_N`` when the node's graph already has that name,
    through the graph's namespace, so later nodes fx names itself never take it (assigning
    ``node.name`` bypasses the namespace: a later ``slice_scatter`` fx names itself can then get the
    same name, and ``Graph.lint`` fails). Returns the name taken."""
    node._rename(candidate)
    return node.name


__all__ = ["annotate", "preserve_node_meta", "pytree", "rename_node", "tree_flatten", "tree_leaves", "tree_map",
           "tree_unflatten", "use_flat_calling_convention"]
