"""Scheduling a lowered program: collectives issued early, waited late.

The lowering emits each collective right before its first consumer and waits at once; this pass
moves every collective up to where its inputs exist (a parameter gather: the start of the layer
before the one that uses it) and its ``wait`` down to the first use, so communication runs under
compute as the cost model's overlap groups assume.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from autopar.ir.layers import layer_key
from autopar.program import collectives as C
from autopar.program import marks

_aten = torch.ops.aten
#: Local layout ops (no data moves between devices) that may stand between a parameter and its gather.
_LOCAL_VIEWS = frozenset({_aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.view.default,
                          _aten._unsafe_view.default, _aten.reshape.default})


def _moves_with(node: fx.Node) -> bool:
    """A cast (mixed precision), a local view (a weight's shard transposed before its gather) or a
    gather group's packing (and, between two steps, its cutting: ``passes/lower/gathers.py``)
    between a collective and its sources: it moves up with the collective."""
    return (node.op == "call_function" and bool(node.all_input_nodes)
            and (bool(node.meta.get("autopar_cast")) or bool(node.meta.get("autopar_pack"))
                 or node.target in _LOCAL_VIEWS))


def _feeding(c: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """The nodes that move with collective ``c`` (``_moves_with``, up from its input), and the
    values they start from, each in program order."""
    moving: set[fx.Node] = set()
    sources: set[fx.Node] = set()
    stack = list(c.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in moving or n in sources:
            continue
        if _moves_with(n):
            moving.add(n)
            stack.extend(n.all_input_nodes)
        else:
            sources.add(n)
    return sorted(moving), sorted(sources)


def _cut(node: fx.Node) -> bool:
    """A gather group's cutting of its gathered buffer, or one member taken from it."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return bool(node.meta.get("autopar_cut"))


def _first_reader(w: fx.Node) -> fx.Node:
    """The first node that uses the result of wait ``w``, past the rest of its resharding: the
    next steps' collectives and waits, and a gather group's packing and cutting (the first reader
    of any of its members)."""
    seen: set[fx.Node] = set()
    stack, reads = list(w.users), []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and (n.target is C.wait or n.target in C.COLLECTIVES
                                        or n.meta.get("autopar_pack") or _cut(n)):
            stack.extend(n.users)
        else:
            reads.append(n)
    return min(reads) if reads else min(w.users)


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
        # casts, local views and a group's packing the lowering made for this collective move with it
        chain, sources = _feeding(c)
        after = max(sources) if sources else top
        first = _first_reader(w) if users else None
        if after is not None and after.op == "placeholder" and first is not None and current[first] >= 0:
            after = starts[max(current[first] - 1, 0)].prev  # a layer ahead of its use
            while after.op == "call_function" and (after.target is C.wait or _moves_with(after) or _cut(after)):
                after = after.prev  # issued before the waits, casts and cuts that open that layer
        if after is not None and after < c:
            for n in chain:  # in program order: each reads a source (before ``after``) or an earlier one
                if after < n:  # up, never down: a view may have other users
                    after.append(n)
                    after = n
            after.append(c)
        if users and users[0].op == "call_function" and (users[0].target in C.COLLECTIVES
                                                         or users[0].meta.get("autopar_pack")):
            c.append(w)  # the next step of the same reshard or group: keep the chain together, early
        elif users and users[0].op != "output":
            users[0].prepend(w)


__all__ = ["schedule"]


def _recomputed(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]  # type: ignore[assignment]
    return bool(node.meta.get("autopar_recomputed"))


def mark_recomputation(graph: fx.Graph) -> None:
    """Bracket each run of re-executed forward ops in the backward ``graph`` with
    ``program.marks.recomputing(True)`` / ``(False)`` calls (nothing when nothing re-runs)."""
    inside = False
    for node in list(graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        now = _recomputed(node)
        if now != inside:
            with graph.inserting_before(node):
                graph.call_function(marks.recomputing, (now,))
            inside = now
    if inside:
        with graph.inserting_before(next(n for n in graph.nodes if n.op == "output")):
            graph.call_function(marks.recomputing, (False,))
