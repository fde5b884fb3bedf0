"""Scheduling a lowered program: collectives issued early, waited late.

The lowering emits each collective right before its first consumer and waits at once; this pass
moves every collective up to where its inputs exist (a parameter gather: the start of the layer
before the one that uses it) and its ``wait`` down to the first use, so communication runs under
compute as the cost model's overlap groups assume.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from autopar.ir.layers import layer_key
from autopar.program import collectives as C


def _layer(node: fx.Node) -> Optional[str]:
    """The layer (``ir.layers``) whose module emitted this program node, if any."""
    if node.op not in ("call_function", "call_module"):
        return None
    return layer_key(node.meta.get("autopar_module", "") or "")


def schedule(graph: fx.Graph) -> None:
    """Issue every collective early and wait for it late, as the cost model's overlap assumes.

    A collective moves up to just after the values it reads exist; one that gathers a parameter
    (it reads a placeholder) no earlier than the start of the layer before the layer running when
    the weight is first used, so gathered weights are not all held at once. A cast that feeds only
    the collective (mixed precision: a parameter to bf16, a gradient to fp32) moves with it. Its ``wait`` moves
    down to just before the first node that reads the result. Gradient reductions thus start as
    soon as each gradient is ready, under the rest of the backward.
    """
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    starts: list[fx.Node] = []  # first node of each layer, in program order
    current: dict[fx.Node, int] = {}  # node -> index in ``starts`` of the layer running there
    seen: set[str] = set()
    for n in nodes:
        lay = _layer(n)
        if lay is not None and lay not in seen:
            seen.add(lay)
            starts.append(n)
        current[n] = len(starts) - 1
    last_placeholder = max((n for n in nodes if n.op == "placeholder"), key=pos.get, default=None)
    for w in nodes:
        if w.op != "call_function" or w.target is not C.wait:
            continue
        c = w.args[0]
        users = sorted(w.users, key=pos.get)
        producers = c.all_input_nodes
        after = max(producers, key=pos.get) if producers else last_placeholder
        # a cast the lowering made for this collective alone (a parameter to the compute dtype before
        # its gather, a gradient to fp32 before its reduction) moves with it
        cast = None
        if after is not None and after.meta.get("autopar_cast") and len(after.users) == 1:
            cast, after = after, max(after.all_input_nodes, key=pos.get)
        if after is not None and after.op == "placeholder" and users:
            k = current[users[0]]
            after = starts[max(k - 1, 0)].prev if k >= 0 else after  # a layer ahead of its use
        if after is not None and pos[after] < pos[c]:
            if cast is not None and pos[after] < pos[cast]:
                after.append(cast)
                after = cast
            after.append(c)
        if users and users[0].op == "call_function" and users[0].target in C.COLLECTIVES:
            c.append(w)  # the next step of the same reshard: keep the chain together, early
        elif users and users[0].op != "output":
            users[0].prepend(w)


__all__ = ["schedule"]
