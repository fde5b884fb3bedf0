"""Spreading a property of tensor dims through the ops that share their factors.

Two analyses use it: ``ir.blocks`` (dims made of equal blocks: the fused ``qkv`` output) and
``recipes.TensorRegions`` (the dims Megatron tensor parallelism may split activations along: those
that come from a weight's split dim). A property at ``(tensor, dim)`` moves, within every op
that reads or writes the tensor, to the other tensors' dims that hold the same factor of the op's
``DimMap``: only a dim made of that one factor (``whole``; a block count does not survive a merge
with other factors) or any dim that holds it.
"""

from __future__ import annotations

from typing import Hashable, Optional

from autopar.ir.graph import Graph, Node, Ref

Key = tuple[Ref, int]  # (tensor, dim)


def _tensor_dims(node: Node, dm) -> list[tuple[Ref, list]]:
    """``(tensor, its dims' factors)`` for every tensor input and output of ``node``."""
    out = []
    for r, dims in zip(node.inputs, dm.inputs):
        if dims is not None:
            out.append((r, dims))
    for j, dims in enumerate(dm.outputs):
        if dims is not None and node.outputs[j] is not None:
            out.append((Ref(node.name, j), dims))
    return out


def _factors(dims: list, d: int, sizes: dict, whole: bool) -> frozenset:
    real = [f for f in dims[d] if sizes[f] != 1]
    if whole:
        return frozenset(real) if len(real) == 1 else frozenset()
    return frozenset(real)


def spread(graph: Graph, seeds: dict[Key, Hashable], *, whole: bool,
           partners: Optional[dict[Ref, list[Ref]]] = None) -> tuple[dict[Key, Hashable], set[Key]]:
    """Every ``(tensor, dim)`` the seeds' values reach, and those reached with two different values
    (left out of the spread from there on). ``partners``: tensors laid out alike whatever the ops
    say (a parameter and its gradient). Deterministic: a worklist in graph order."""
    from autopar.ir.rules.base import dimmap, op_call

    marks = dict(seeds)
    conflict: set[Key] = set()
    users = graph.users()
    dms: dict[str, object] = {}

    def dm_of(node: Node):
        if node.name not in dms:
            dms[node.name] = None if node.is_placeholder else dimmap(op_call(graph, node))
        return dms[node.name]

    def mark(key: Key, value) -> None:
        if key in conflict:
            return
        if key not in marks:
            marks[key] = value
            work.append(key)
        elif marks[key] != value:
            conflict.add(key)

    order = {n.name: i for i, n in enumerate(graph.nodes)}
    work = sorted(marks, key=lambda k: (order[k[0].node], k[0].index, k[1]))
    while work:
        ref, d = work.pop(0)
        if (ref, d) in conflict:
            continue
        value = marks[(ref, d)]
        for other in (partners or {}).get(ref, []):
            mark((other, d), value)
        for node in [graph.node(ref.node)] + [graph.node(u) for u in users[ref.node]]:
            dm = dm_of(node)
            if dm is None:
                continue
            tensors = _tensor_dims(node, dm)
            for r, dims in tensors:
                if r != ref or d >= len(dims):
                    continue
                fs = _factors(dims, d, dm.sizes, whole)
                if not fs:
                    continue
                for r2, dims2 in tensors:
                    for d2 in range(len(dims2)):
                        if (r2, d2) != (ref, d) and fs & _factors(dims2, d2, dm.sizes, whole):
                            mark((r2, d2), value)
    return marks, conflict


def linked_dims(graph: Graph) -> dict[Key, tuple[Key, ...]]:
    """For every ``(tensor, dim)`` that shares a factor with another, every key its property would
    reach (``spread`` from it alone with ``whole=False`` and one value: its connected component,
    since sharing a factor is symmetric), sorted in graph order. One pass over the graph: what
    many single-seed ``spread`` calls would each recompute. Keys linked to nothing are absent.

    Which dims of a node's tensors its op links depends only on what the op's ``DimMap`` sees (op,
    non-tensor arguments, tensor specs, which inputs are the same tensor): worked out once per such
    signature (``_links``), so the alike ops of a deep stack's layers cost a lookup each."""
    # keys as (node name, output, dim) while the sets are joined: plain tuples hash and compare in C
    parent: dict[tuple, tuple] = {}

    def find(k: tuple) -> tuple:
        root = k
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[k] != root:  # path compression
            parent[k], k = root, parent[k]
        return root

    patterns: dict[tuple, tuple] = {}
    for node in graph.nodes:
        if node.is_placeholder:
            continue
        sig = _local_signature(graph, node)
        links = patterns.get(sig)
        if links is None:
            links = patterns[sig] = _links(graph, node)
        if not links:
            continue
        tensors = list(node.inputs) + [Ref(node.name, j) for j in range(len(node.outputs))]
        for (sa, da), (sb, db) in links:
            ra, rb = tensors[sa], tensors[sb]
            a, b = find((ra.node, ra.index, da)), find((rb.node, rb.index, db))
            if a != b:
                parent[b] = a
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    groups: dict[tuple, list[tuple]] = {}
    for k in parent:
        groups.setdefault(find(k), []).append(k)
    out: dict[Key, tuple[Key, ...]] = {}
    for members in groups.values():
        members.sort(key=lambda k: (order[k[0]], k[1], k[2]))
        ordered = tuple((Ref(k[0], k[1]), k[2]) for k in members)
        for k in ordered:
            out[k] = ordered
    return out


def _local_signature(graph: Graph, node: Node) -> tuple:
    """What an op's ``DimMap`` is made of, without the names of the tensors it reads: the op, its
    non-tensor arguments (tensors as their input slot: repeats show), the specs of its inputs and
    outputs."""
    slot: dict[Ref, int] = {}
    for r in node.inputs:
        slot.setdefault(r, len(slot))

    def plain(a):
        if isinstance(a, Ref):
            return ("<ref>", slot[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__,) + tuple(plain(x) for x in a)
        if isinstance(a, dict):
            return ("<dict>",) + tuple((k, plain(v)) for k, v in a.items())
        return (type(a).__name__, a) if isinstance(a, (int, float, bool, str, type(None))) else repr(a)

    return (node.op, plain(node.args), plain(node.kwargs), tuple(graph.spec(r) for r in node.inputs),
            tuple(node.outputs))


def _links(graph: Graph, node: Node) -> tuple:
    """The unions ``linked_dims`` makes for ``node``: ``((slot, dim), (slot, dim))`` pairs, a slot an
    index into the node's inputs followed by its outputs; each factor's holders joined to its first."""
    from autopar.ir.rules.base import dimmap, op_call

    dm = dimmap(op_call(graph, node))
    if dm is None:  # constants and ops without a rule
        return ()
    slots = {r: k for k, r in enumerate(node.inputs)}
    out = []
    holders: dict = {}  # factor -> first (tensor, dim) holding it
    for r, dims in _tensor_dims(node, dm):
        s = len(node.inputs) + r.index if r.node == node.name else slots[r]
        for d in range(len(dims)):
            key = (r.node, r.index, d)
            for f in _factors(dims, d, dm.sizes, False):
                first = holders.setdefault(f, (key, (s, d)))
                if first[0] != key:
                    out.append((first[1], (s, d)))
    return tuple(out)
