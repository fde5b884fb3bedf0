"""Spreading a property of tensor dims through the ops that share their factors.

Two analyses use it: ``ir.blocks`` (dims made of equal blocks: the fused ``qkv`` output) and
``recipes.TensorRegions`` (the dims Megatron tensor parallelism may split activations along: those
that come from a weight's split dim). A property at ``(tensor, dim)`` moves, within every op
that reads or writes the tensor, to the other tensors' dims that hold the same factor of the op's
``DimMap``: only a dim made of that one factor (``whole``; a block count does not survive a merge
with other factors) or any dim that holds it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Hashable, Optional

from autopar.ir.graph import Graph, Node, Ref
from autopar.ir.layers import known_layers

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
    #: node name -> its tensors with each dim's factors (``_factors``), None without a DimMap: worked out
    #: once per node, however many of its keys the worklist visits
    tensors_of: dict[str, Optional[list]] = {}
    #: the same as slots (an index into the node's inputs, then its outputs), per ``local_signature``:
    #: the alike ops of a deep stack's layers work out one DimMap
    patterns: dict[tuple, Optional[list]] = {}

    def tensors(node: Node) -> Optional[list]:
        if node.name in tensors_of:
            return tensors_of[node.name]
        if node.is_placeholder:
            tensors_of[node.name] = None
            return None
        sig = local_signature(graph, node)
        if sig not in patterns:
            dm = dimmap(op_call(graph, node))
            slots = {r: k for k, r in enumerate(node.inputs)}
            patterns[sig] = None if dm is None else [
                (len(node.inputs) + r.index if r.node == node.name else slots[r],
                 [_factors(dims, d, dm.sizes, whole) for d in range(len(dims))]) for r, dims in _tensor_dims(node, dm)]
        held, n_in = patterns[sig], len(node.inputs)
        got = tensors_of[node.name] = None if held is None else [
            (node.inputs[s] if s < n_in else Ref(node.name, s - n_in), factors) for s, factors in held]
        return got

    def mark(key: Key, value) -> None:
        if key in conflict:
            return
        if key not in marks:
            marks[key] = value
            work.append(key)
        elif marks[key] != value:
            conflict.add(key)

    order = {n.name: i for i, n in enumerate(graph.nodes)}
    work = deque(sorted(marks, key=lambda k: (order[k[0].node], k[0].index, k[1])))
    while work:
        ref, d = work.popleft()
        if (ref, d) in conflict:
            continue
        value = marks[(ref, d)]
        for other in (partners or {}).get(ref, []):
            mark((other, d), value)
        for node in [graph.node(ref.node)] + [graph.node(u) for u in users[ref.node]]:
            held = tensors(node)
            if held is None:
                continue
            for r, factors in held:
                if r != ref or d >= len(factors):
                    continue
                fs = factors[d]
                if not fs:
                    continue
                for r2, factors2 in held:
                    for d2, fs2 in enumerate(factors2):
                        if (r2, d2) != (ref, d) and fs & fs2:
                            mark((r2, d2), value)
    return marks, conflict


class Links(Mapping):
    """``linked_dims``' answer: ``(tensor, dim)`` -> its component, the keys linked to it in graph order
    (one tuple object per component). Keys are held as plain ``(node, output, dim)`` tuples and a
    component's ``(Ref, dim)`` tuple is made when first asked for: a deep stack's residual stream
    is one component of most of the graph, and the recipes ask for the parameters' few."""

    def __init__(self, root: dict[tuple, tuple], members: dict[tuple, list[tuple]]):
        self._root = root  # (node, output, dim) -> its component's root
        self._members = members  # root -> its keys in graph order
        self._made: dict[tuple, tuple[Key, ...]] = {}

    def _component(self, root: tuple) -> tuple[Key, ...]:
        got = self._made.get(root)
        if got is None:
            refs: dict[tuple, Ref] = {}
            got = self._made[root] = tuple(
                (refs.get((n, i)) or refs.setdefault((n, i), Ref(n, i)), d) for n, i, d in self._members[root])
        return got

    def __getitem__(self, key: Key) -> tuple[Key, ...]:
        ref, d = key
        root = self._root.get((ref.node, ref.index, d))
        if root is None:
            raise KeyError(key)
        return self._component(root)

    def __iter__(self) -> Iterator[Key]:
        for root in self._members:
            yield from self._component(root)

    def __len__(self) -> int:
        return len(self._root)


def linked_dims(graph: Graph) -> Links:
    """For every ``(tensor, dim)`` that shares a factor with another, every key its property would
    reach (``spread`` from it alone with ``whole=False`` and one value: its connected component,
    since sharing a factor is symmetric), sorted in graph order. One pass over the graph: what
    many single-seed ``spread`` calls would each recompute. Keys linked to nothing are absent.

    Which dims of a node's tensors its op links depends only on what the op's ``DimMap`` sees (op,
    non-tensor arguments, tensor specs, which inputs are the same tensor): worked out once per such
    signature (``_links``), so the alike ops of a deep stack's layers cost a lookup each. Where the
    graph's layers are known (``ir.layers``, made by the fold), an op of an agreeing instance that
    reads only its own instance's values has its representative's links (``_alike_ops``)."""
    # keys as (node name, output, dim) while the sets are joined: plain tuples hash and compare in C
    parent: dict[tuple, tuple] = {}

    def find(k: tuple) -> tuple:
        root = parent.get(k)
        if root is None:
            parent[k] = k
            return k
        if root == k:
            return k
        while parent[root] != root:
            root = parent[root]
        while parent[k] != root:  # path compression
            parent[k], k = root, parent[k]
        return root

    patterns: dict[tuple, tuple] = {}
    alike, mine = _alike_ops(graph), {}  # an op -> its representative; a representative's links

    def links_of(node: Node) -> tuple:
        got = mine.get(node.name)
        if got is None:
            sig = local_signature(graph, node)
            got = patterns.get(sig)
            if got is None:
                got = patterns[sig] = _links(graph, node)
            mine[node.name] = got
        return got

    for node in graph.nodes:
        if node.is_placeholder:
            continue
        rep = alike.get(node.name)
        links = links_of(node if rep is None else graph.node(rep))
        if not links:
            continue
        ins, name = node.inputs, node.name
        n_in = len(ins)
        for (sa, da), (sb, db) in links:
            ra = (ins[sa].node, ins[sa].index, da) if sa < n_in else (name, sa - n_in, da)
            rb = (ins[sb].node, ins[sb].index, db) if sb < n_in else (name, sb - n_in, db)
            # ``find`` inlined where it returns at once (a new key, or a root)
            a = parent.get(ra)
            if a is None:
                parent[ra] = a = ra
            elif a != ra:
                a = find(ra)
            b = parent.get(rb)
            if b is None:
                parent[rb] = b = rb
            elif b != rb:
                b = find(rb)
            if a != b:
                parent[b] = a
    by_node: dict[str, list[tuple]] = {}
    for k in parent:
        by_node.setdefault(k[0], []).append(k)
    root: dict[tuple, tuple] = {}
    members: dict[tuple, list[tuple]] = {}
    for node in graph.nodes:  # graph order: each component's keys come out sorted
        keys = by_node.get(node.name)
        if keys is None:
            continue
        keys.sort()
        for k in keys:
            r = root[k] = k if parent[k] == k else find(k)
            members.setdefault(r, []).append(k)
    return Links(root, members)


def _alike_ops(graph: Graph) -> dict[str, str]:
    """Op -> the op at its position in the first instance of its agreeing layer instances, for the
    ops of the other instances (those lacking none of the first's nodes) that read only values of
    their own instance; empty where the graph's layers are not known yet. Such an op and its
    representative have what their ``DimMap`` is made of alike, so the same links: agreeing
    instances agree position by position in op, outputs and non-tensor arguments (by their
    ``repr``: the same values; ``agreement.signature``) and in their wiring, each input made at the
    same position of its instance, where the ops agree too, so with the same spec; and inputs are
    the same tensor in one where they are in the other."""
    found = known_layers(graph)
    out: dict[str, str] = {}
    for prefix, ix in (found.alike.items() if found is not None else ()):
        first = found.instances[(prefix, ix[0])]
        for i in ix[1:]:
            if (prefix, i) in found.positions:
                continue
            names = found.instances[(prefix, i)]
            members = set(names)
            for n, rep in zip(names, first):
                if all(r.node in members for r in graph.node(n).inputs):
                    out[n] = rep
    return out


def local_signature(graph: Graph, node: Node) -> tuple:
    """What an op's ``DimMap`` (and so its strategies) is made of, without the names of the tensors
    it reads: the op, its non-tensor arguments (tensors as their input slot: repeats show), the
    specs of its inputs and outputs. Ops with one signature have one DimMap."""
    slot: dict[Ref, int] = {}
    for r in node.inputs:
        slot.setdefault(r, len(slot))
    return (node.op, _plain(node.args, slot), _plain(node.kwargs, slot) if node.kwargs else ("<dict>",),
            tuple(graph.spec(r) for r in node.inputs), tuple(node.outputs))


_SCALARS = (int, float, bool, str, type(None))


def _plain(a, slot: dict[Ref, int]):
    """An argument as ``local_signature`` holds it: a tensor as its input slot, a scalar with its type."""
    kind = type(a)
    if kind is Ref:
        return "<ref>", slot[a]
    if kind in _SCALARS:
        return kind.__name__, a
    if isinstance(a, (list, tuple)):
        return (kind.__name__,) + tuple(_plain(x, slot) for x in a)
    if isinstance(a, dict):
        return ("<dict>",) + tuple((k, _plain(v, slot)) for k, v in a.items())
    return (kind.__name__, a) if isinstance(a, _SCALARS) else repr(a)


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
