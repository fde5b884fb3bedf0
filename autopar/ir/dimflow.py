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
    many single-seed ``spread`` calls would each recompute. Keys linked to nothing are absent."""
    from autopar.ir.rules.base import dimmap, op_call

    # keys as (node name, output, dim) while the sets are joined: plain tuples hash and compare in C
    parent: dict[tuple, tuple] = {}

    def find(k: tuple) -> tuple:
        root = k
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[k] != root:  # path compression
            parent[k], k = root, parent[k]
        return root

    for node in graph.nodes:
        dm = None if node.is_placeholder else dimmap(op_call(graph, node))
        if dm is None:  # placeholders, constants
            continue
        holders: dict = {}  # factor -> first key holding it
        for r, dims in _tensor_dims(node, dm):
            for d in range(len(dims)):
                key = (r.node, r.index, d)
                for f in _factors(dims, d, dm.sizes, False):
                    first = holders.setdefault(f, key)
                    if first != key:
                        a, b = find(first), find(key)
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

