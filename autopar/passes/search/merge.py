"""Merge: fold ops that can simply follow their producer into it, so the ILP has fewer nodes.

A node ``v`` follows its producer ``u`` when it is a layout op (a view, transpose, alias, copy:
it moves no data between devices and preserves the tensor's size), it has exactly one incoming
edge, and for every placement ``u`` may give that tensor, ``v`` has a strategy that takes it as
is. Then ``v``'s strategy is a function of ``u``'s (the cheapest such strategy), and a resharding
that the optimum would do before ``v`` can be done after it at the same cost (the same bytes move
the same way), so merging loses nothing. ``u`` takes over ``v``'s costs and outgoing edges.

A tensor is resharded once per target placement and shared by all its consumers (a transfer,
``problem.py``), so the edge ``u -> v`` must also be its tensor's only edge in its transfer:
were ``v`` to follow while another consumer ``w`` of the same tensor remained, a resharding that
``v``'s consumers and ``w`` could share (done once, before ``v``) would have to be done twice
(after ``v``, and before ``w``), and the merged problem would overprice that choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autopar.ir.views import FOLLOWERS
from autopar.passes.search.problem import MEMORY_KINDS, PEdge, PNode, Problem


@dataclass
class Merged:
    """The smaller problem and how to expand its choice back to the original's."""

    problem: Problem
    keep: list[int]  # original index of each merged-problem node
    follow: dict[int, tuple[int, list[int]]] = field(default_factory=dict)  # v -> (u, strategy of v per strategy of u)

    def expand(self, choice: list[int], n_original: int) -> list[int]:
        """A choice for the original problem's ``n_original`` nodes from a choice for the merged one:
        kept nodes as chosen, followers as their producer's choice maps them."""
        out = [-1] * n_original
        for k, i in enumerate(self.keep):
            out[i] = choice[k]
        # followers were merged in order, so a follower's producer is resolved before it
        for v in sorted(self.follow, key=lambda v: self._depth(v)):
            u, f = self.follow[v]
            out[v] = f[out[u]]
        return out

    def _depth(self, v: int) -> int:
        d = 0
        while v in self.follow:
            v = self.follow[v][0]
            d += 1
        return d


def merge(problem: Problem, ops: dict[str, str]) -> Merged:
    """Merge every follower (``ops`` maps node name -> op) into its producer, repeatedly."""
    nodes = [_copy(n) for n in problem.nodes]
    edges = list(problem.edges)
    alive = [True] * len(nodes)
    follow: dict[int, tuple[int, list[int]]] = {}
    changed = True
    while changed:
        changed = False
        incoming: dict[int, list[int]] = {}
        shared: dict[int, int] = {}  # transfer id -> its number of edges
        for k, e in enumerate(edges):
            incoming.setdefault(e.dst, []).append(k)
            if e.share >= 0:
                shared[e.share] = shared.get(e.share, 0) + 1
        for v in range(len(nodes)):
            if not alive[v] or ops.get(nodes[v].name) not in FOLLOWERS or nodes[v].allowed is not None:
                continue
            ins = incoming.get(v, [])
            if len(ins) != 1:
                continue
            e = edges[ins[0]]
            u = e.src
            if e.dst_slot != 0 or not alive[u] or nodes[u].mult != nodes[v].mult or nodes[u].group != nodes[v].group:
                continue
            if u == v or (e.share >= 0 and shared[e.share] > 1):
                continue
            f = _follow_map(nodes[u], nodes[v], e)
            if f is None:
                continue
            _absorb(nodes[u], nodes[v], f)
            follow[v] = (u, f)
            alive[v] = False
            edges = [_resource(x, v, u, f, nodes) for k, x in enumerate(edges) if k != ins[0]]
            changed = True
            break
    keep = [i for i in range(len(nodes)) if alive[i]]
    new_index = {old: new for new, old in enumerate(keep)}
    kept_edges = [replace(e, src=new_index[e.src], dst=new_index[e.dst]) for e in edges]
    merged = Problem([nodes[i] for i in keep], kept_edges, problem.groups, problem.memory_budget,
                     problem.overlap_slowdown)
    return Merged(merged, keep, follow)


def _copy(n: PNode) -> PNode:
    return PNode(n.name, list(n.strategies), n.mult, n.group, list(n.compute), list(n.comm),
                 {k: list(v) for k, v in n.memory.items()}, None if n.allowed is None else list(n.allowed),
                 None if n.transient is None else list(n.transient),
                 None if n.pending is None else list(n.pending), n.head,
                 None if n.deferred is None else list(n.deferred))


def _follow_map(u: PNode, v: PNode, e: PEdge) -> list[int] | None:
    """For each strategy of u, the cheapest strategy of v that takes u's placement as is."""
    best_for_place: dict[int, int] = {}
    for p in set(e.src_place):
        target = e.places_out[p]
        cands = [s for s in range(len(v.strategies)) if e.places_in[e.dst_place[s]] == target]
        if not cands:
            return None
        best_for_place[p] = min(cands, key=lambda s: (v.compute[s] + v.comm[s], s))
    return [best_for_place[e.src_place[s]] for s in range(len(u.strategies))]


def _absorb(u: PNode, v: PNode, f: list[int]) -> None:
    if v.transient and not v.head:  # the larger transient, held after the layers' backward began
        u.head = False
    for s in range(len(u.strategies)):
        u.compute[s] += v.compute[f[s]]
        u.comm[s] += v.comm[f[s]]
        for k in MEMORY_KINDS:
            u.memory[k][s] += v.memory[k][f[s]]
        if v.pending:  # unreduced gradients: both are held
            u.pending = u.pending or [0.0] * len(u.strategies)
            u.pending[s] += v.pending[f[s]]
        if v.deferred:  # (both are made in the layers' backward)
            u.deferred = u.deferred or [0.0] * len(u.strategies)
            u.deferred[s] += v.deferred[f[s]]
        if v.transient:  # the two run one after the other: the larger is what is held at once
            u.transient = u.transient or [0.0] * len(u.strategies)
            u.transient[s] = max(u.transient[s], v.transient[f[s]])


def _resource(e: PEdge, v: int, u: int, f: list[int], nodes: list[PNode]) -> PEdge:
    """Re-express an edge leaving (or entering) the merged node v in terms of u's strategies."""
    n_u = len(nodes[u].strategies)
    if e.src == v:
        e = replace(e, src=u, src_place=[e.src_place[f[s]] for s in range(n_u)])
    if e.dst == v:
        e = replace(e, dst=u, dst_place=[e.dst_place[f[s]] for s in range(n_u)])
    return e
