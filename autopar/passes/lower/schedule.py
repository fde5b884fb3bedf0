"""Scheduling a lowered program: collectives issued early, waited late.

The lowering emits each collective right before its first consumer and waits at once; this pass
moves every collective up to where its inputs exist (a parameter gather: the start of the layer
before the one that uses it) and its ``wait`` down to the first use, so communication runs under
compute as the cost model's overlap groups assume.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from autopar.ir.layers import layer_key
from autopar.program import collectives as C

_aten = torch.ops.aten
#: Local layout ops (no data moves between devices) that may stand between a parameter and its gather.
_LOCAL_VIEWS = frozenset({_aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.view.default,
                          _aten._unsafe_view.default, _aten.reshape.default})


def _moves_with(node: fx.Node) -> bool:
    """A cast (mixed precision) or a local view (a weight's shard transposed before its gather)
    between a collective and its source: it moves up with the collective."""
    return (node.op == "call_function" and bool(node.all_input_nodes)
            and (bool(node.meta.get("autopar_cast")) or node.target in _LOCAL_VIEWS))


def _layer(node: fx.Node) -> Optional[str]:
    """The layer (``ir.layers``) whose module emitted this program node, if any."""
    if node.op not in ("call_function", "call_module"):
        return None
    return layer_key(node.meta.get("autopar_module", "") or "")


def schedule(graph: fx.Graph) -> None:
    """Issue every collective early and wait for it late, as the cost model's overlap assumes.

    A collective moves up to just after the values it reads exist; one that gathers a parameter
    (it reads a placeholder) no earlier than the start of the layer before the layer running when
    the weight is first used, so gathered weights are not all held at once. Casts and local views
    between a collective and its source (mixed precision: a parameter to bf16, a gradient to fp32;
    a weight's shard transposed before its gather) move up with it, so the gather of a transposed
    weight is a parameter gather too; views of the program's inputs cost nothing and go first.
    Its ``wait`` moves down to just before the first node that reads the result. Gradient
    reductions thus start as soon as each gradient is ready, under the rest of the backward.
    """
    top = max((n for n in graph.nodes if n.op == "placeholder"), default=None)
    if top is not None:  # views of the inputs first, out of the layers (they move no data)
        for n in list(graph.nodes):
            if (n.op == "call_function" and n.target in _LOCAL_VIEWS and n.all_input_nodes
                    and all(a.op == "placeholder" for a in n.all_input_nodes)):
                top.append(n)
                top = n
    nodes = list(graph.nodes)
    # first node of each layer, in program order: an anchor that stays (not a cast or view, which
    # may move up with a collective)
    starts: list[fx.Node] = []
    current: dict[fx.Node, int] = {}  # node -> index in ``starts`` of the layer running there
    seen: set[str] = set()
    for n in nodes:
        lay = None if _moves_with(n) else _layer(n)
        if lay is not None and lay not in seen:
            seen.add(lay)
            starts.append(n)
        current[n] = len(starts) - 1
    # fx nodes compare by their current place in the graph (``a < b``: a runs first), moves included
    for w in nodes:
        if w.op != "call_function" or w.target is not C.wait:
            continue
        c = w.args[0]
        users = sorted(w.users)
        producers = c.all_input_nodes
        after = max(producers) if producers else top
        # casts and local views the lowering made for this collective move with it
        chain: list[fx.Node] = []  # from the collective's input back towards its source
        while after is not None and _moves_with(after):
            chain.append(after)
            after = max(after.all_input_nodes)
        if after is not None and after.op == "placeholder" and users and current[users[0]] >= 0:
            after = starts[max(current[users[0]] - 1, 0)].prev  # a layer ahead of its use
            while after.op == "call_function" and (after.target is C.wait or _moves_with(after)):
                after = after.prev  # issued before the waits and casts that open that layer
        if after is not None and after < c:
            for n in reversed(chain):  # each reads the source (before ``after``) or the previous one
                if after < n:  # up, never down: a view may have other users
                    after.append(n)
                    after = n
            after.append(c)
        if users and users[0].op == "call_function" and users[0].target in C.COLLECTIVES:
            c.append(w)  # the next step of the same reshard: keep the chain together, early
        elif users and users[0].op != "output":
            users[0].prepend(w)


__all__ = ["schedule"]
