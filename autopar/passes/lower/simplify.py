"""Dropping ops that do nothing in a lowered program.

The captured joint graph keeps ops that only matter to autograd or cancel out: ``detach`` of
values saved for the backward, and a transpose of a transpose (a weight gradient computed as
``mm(t(g), x)``, transposed to the weight's layout and back). A lowered program runs without
autograd, one Python call per op, so each costs a dispatch (a few microseconds on CPU) every step
for nothing: ``detach`` there returns a view of the same storage, and ``t(t(x))`` is ``x`` with its
own strides. Both are replaced by their input; no other op is touched.
"""

from __future__ import annotations

import torch
import torch.fx as fx

_aten = torch.ops.aten
_IDENTITY = (_aten.detach.default, _aten.alias.default)


def drop_identities(graph: fx.Graph) -> int:
    """Replace ``detach``/``alias`` and ``t(t(x))`` by their input in ``graph``; returns how many
    nodes were removed."""
    removed = 0
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        src = None
        if n.target in _IDENTITY:
            src = n.args[0]
        elif n.target is _aten.t.default and isinstance(n.args[0], fx.Node) and n.args[0].target is _aten.t.default:
            src = n.args[0].args[0]
        if not isinstance(src, fx.Node):
            continue
        inner = n.args[0]
        n.replace_all_uses_with(src)
        graph.erase_node(n)
        removed += 1
        if inner is not src and not inner.users:  # the first transpose, now unused
            graph.erase_node(inner)
            removed += 1
    return removed


__all__ = ["drop_identities"]
