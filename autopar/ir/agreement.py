"""Agreement between layer instances: which instances of a prefix run the same node sequence, so
that ``fold`` can price one for all (the membership itself is ``ir.layers``'s).

Instances *agree* when their node sequences do, position by position: op, output shapes and
dtypes, non-tensor arguments, phase, and wiring (an input made inside the instance by its position,
one made outside as "outside"). Hashing these signatures per instance groups the agreeing ones.

An instance may also agree while *lacking* some gradient accumulations the others have: a value
made once and read by all L instances (T5's shared position bias, the encoder's output that every
decoder block's cross-attention reads) has its gradients summed by L - 1 accumulations, so one
instance always lacks its own. Such an instance joins the group when its nodes are the reference
instance's with only accumulations left out (``align``); each of its nodes takes the position of
the reference node it agrees with, and the missing positions count one instance fewer.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Optional

from torch.fx.node import map_aggregate

from autopar.ir.graph import Graph, Node, Ref

Key = tuple[str, int]


def is_accumulation(node: Node) -> bool:
    """A gradient accumulation (the sum of a tensor's gradients from its several uses)."""
    return bool(node.fx_node is not None and node.fx_node.meta.get("is_gradient_acc"))


_STATIC: "weakref.WeakKeyDictionary[Node, tuple]" = weakref.WeakKeyDictionary()


def signature(node: Node, members: dict[str, int]) -> tuple:
    """What must agree between instances, position by position, for them to fold: op, outputs,
    non-tensor arguments, phase, and the wiring (an input made inside the instance by its position,
    one made outside as "outside")."""
    static = _STATIC.get(node)
    if static is None:
        static = _static(node)
    wiring = tuple((members.get(r.node, -1), r.index) for r in node.inputs)
    return static, wiring


def _static(node: Node) -> tuple:
    """All of ``signature`` but the wiring: the same whatever the membership (computed once)."""
    args = map_aggregate(node.args, lambda a: "<tensor>" if isinstance(a, Ref) else a)
    kwargs = map_aggregate(node.kwargs, lambda a: "<tensor>" if isinstance(a, Ref) else a)
    static = _STATIC[node] = (node.op, tuple(node.outputs), repr(args), repr(kwargs), node.phase)
    return static


def group_by_key(graph: Graph, owner: dict[str, Key]) -> dict[Key, list[str]]:
    """Each instance's node names, in graph order."""
    out: dict[Key, list[str]] = defaultdict(list)
    for node in graph.nodes:
        key = owner.get(node.name)
        if key is not None:
            out[key].append(node.name)
    return out


def align(graph: Graph, ref: list[str], names: list[str]) -> Optional[tuple[int, ...]]:
    """The position in ``ref`` of each of ``names``' nodes, when ``names`` is ``ref``'s sequence
    with only gradient accumulations left out (each node agreeing with the reference node at its
    position, the wiring read through those positions); else None. An accumulation agrees with a
    reference accumulation whatever partial sums it adds (the first of a chain adds two gradients
    where the others add one to the sum so far): same op and shapes, so the same strategies, and
    its edges are priced as they are (``build``'s transfers group producers by the edges they
    feed). One pass in order: a reference node the next node does not agree with is skipped if it
    is an accumulation."""
    if len(names) >= len(ref):
        return None
    ref_pos = {n: k for k, n in enumerate(ref)}
    want = [signature(graph.node(n), ref_pos) for n in ref]
    acc = [is_accumulation(graph.node(n)) for n in ref]
    pos: dict[str, int] = {}
    out = []
    j = 0
    for n in names:
        node = graph.node(n)
        while True:
            if j >= len(ref):
                return None
            mine = signature(node, pos)
            if mine == want[j] or (acc[j] and mine[0] == want[j][0] and is_accumulation(node)):
                break
            if not acc[j]:
                return None
            j += 1
        pos[n] = j
        out.append(j)
        j += 1
    if not all(acc[j:]):
        return None
    return tuple(out)


def agreeing(graph: Graph, by_key: dict[Key, list[str]], prefix: str, seen: Optional[dict] = None
             ) -> tuple[list[list[int]], dict[int, tuple[int, ...]]]:
    """The instances of ``prefix`` grouped by their node sequences (agreeing instances together),
    and the positions of the instances that joined a group lacking accumulations (``align``,
    against the group's first instance, which they follow in index order). ``seen``: node
    sequences -> their signatures, shared by calls on candidate memberships of one graph (an
    instance most candidates draw alike is compared once)."""
    alike: dict[tuple, list[int]] = defaultdict(list)
    memo = {} if seen is None else seen
    for i in sorted(i for p, i in by_key if p == prefix):
        names = by_key[(prefix, i)]
        key = tuple(names)
        sig = memo.get(key)
        if sig is None:  # ``signature`` of each node, inlined: an instance's nodes are many
            get = {n: k for k, n in enumerate(names)}.get
            sigs = []
            for n in names:
                node = graph.node(n)
                static = _STATIC.get(node)
                sigs.append((_static(node) if static is None else static,
                             tuple([(get(r.node, -1), r.index) for r in node.inputs])))
            sig = memo[key] = tuple(sigs)
        alike[sig].append(i)
    classes = list(alike.values())
    positions: dict[int, tuple[int, ...]] = {}
    if len(classes) < 2:
        return classes, positions
    # the reference: the class covering the most nodes (its first instance the longest on a tie)
    ref = max(classes, key=lambda ix: (len(ix) * len(by_key[(prefix, ix[0])]), len(by_key[(prefix, ix[0])]), -ix[0]))
    merged = [ref]
    for ix in classes:
        if ix is ref:
            continue
        got = align(graph, by_key[(prefix, ref[0])], by_key[(prefix, ix[0])]) if ix[0] > ref[0] else None
        if got is None:
            merged.append(ix)
            continue
        ref.extend(ix)
        positions.update((i, got) for i in ix)
    ref.sort()
    merged.sort(key=lambda ix: ix[0])
    return merged, positions


def largest(by_key: dict[Key, list[str]], prefix: str, classes: list[list[int]]) -> tuple[int, ...]:
    """The class covering the most nodes (two instances or more), else ``()``."""
    best = max(classes, key=lambda ix: (len(ix) * len(by_key[(prefix, ix[0])]), -ix[0]), default=[])
    return tuple(best) if len(best) >= 2 else ()


def score(by_key: dict[Key, list[str]], prefix: str, classes: list[list[int]]) -> tuple[int, int]:
    """How well a candidate membership folds ``prefix``, larger better: first the nodes it folds per
    added layer (an instance's length, where the middle instances agree: then every added layer
    folds, and the problem does not grow with depth; the first and the last instance may differ,
    as they touch the embedding or the head), then the nodes it folds at this depth. With two
    instances there is no middle one: the shorter instance's length stands for it if they agree."""
    idx = sorted(i for p, i in by_key if p == prefix)
    ix = largest(by_key, prefix, classes)
    folded = (len(ix) - 1) * len(by_key[(prefix, ix[0])]) if ix else 0
    if len(idx) == 2:  # (when the two agree: two that differ fold nothing)
        return (min(len(by_key[(prefix, i)]) for i in idx) if ix else 0), folded
    middle = set(idx[1:-1])
    per_layer = next((len(by_key[(prefix, c[0])]) for c in classes if middle <= set(c) and len(c) >= 2), 0)
    return per_layer, folded


__all__ = ["Key", "agreeing", "align", "group_by_key", "is_accumulation", "largest", "score", "signature"]
