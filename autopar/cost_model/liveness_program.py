"""What the liveness walk (``cost_model.liveness.step_peak``) needs of the graph alone, made once per
graph and shared by every walk of a plan's search: the ops in order with their refs as int codes, the
moments as ints, and when each parameter gather is issued and each recomputed op runs again."""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Optional

from autopar.ir.graph import Graph, Phase, Ref
from autopar.ir.layers import layer_key
from autopar.ir.views import ALIASES, param_views

#: a moment of the walk, one int: ``time * W + sub + 2``, ordered as ``(time, sub)`` pairs (``sub``: -2 a
#: gather's issue, -1 a re-run, 0 the node itself, 1 + b bucket b's reduction after the ops, ``LAST`` the end)
W = 1 << 32
LAST = 1 << 30


def at(time: int, sub: int = 0) -> int:
    """The moment ``(time, sub)`` as one int."""
    return time * W + sub + 2


@dataclass
class Program:
    """What a walk needs of the graph alone, once per graph (every walk of a plan's search shares it):
    node order, the ops in order with their inputs and outputs as int codes, gather issue moments."""

    order: dict
    first_back: int
    views: set
    #: per op (not placeholders): (index, node, backward, ((input position, ref code, a parameter view's), ...),
    #: ((output index, ref code), ...), a view op's)
    ops: list
    issue: dict
    readers: Optional[dict]  # node name -> the names of the nodes reading it (``reader_names``)
    code: dict  # Ref -> int
    refs: list  # int -> Ref
    #: (mesh shape, precision) -> the walks' shared ``(placements by code, code by placements, bytes by
    #: (ref code, placement code, role))``: every walk of a search prices the same blocks
    sizes: dict = field(default_factory=dict)
    #: the node count of the program's order (its ``end`` moment is ``at(length, LAST)``)
    length: int = 0
    #: the placeholders: (node, its output's ref code), graph order
    placeholders: list = field(default_factory=list)
    #: what ``liveness_periodic`` finds of the graph and keeps per graph (its layer stack, its short programs)
    periodic: dict = field(default_factory=dict)
    #: per gradient: (parameter FQN, its gradient's ref code, its parameter's ref code)
    grads: list = field(default_factory=list)

    def reader_names(self) -> dict:
        """Node name -> the names of the nodes reading it (made on first use: only recomputation asks)."""
        if self.readers is None:
            readers = defaultdict(list)
            for _, n, _, ins, _, _ in self.ops:
                for _, rc, _ in ins:
                    readers[self.refs[rc].node].append(n.name)
            self.readers = dict(readers)
        return self.readers


#: per graph: (its node count when made, its ``Program``)
_PROGRAMS: "weakref.WeakKeyDictionary[Graph, tuple[int, Program]]" = weakref.WeakKeyDictionary()


def program(graph: Graph) -> Program:
    """``graph``'s ``Program``, made once per graph (held while the graph lives)."""
    got = _PROGRAMS.get(graph)
    if got is not None and got[0] == len(graph.nodes):
        return got[1]
    nodes = graph.nodes
    order = {n.name: i for i, n in enumerate(nodes)}
    views = param_views(graph)
    first_back = first_backward(nodes, graph.training)
    code: dict = {}
    refs: list = []

    def c(r: Ref) -> int:
        got = code.get(r)
        if got is None:
            got = code[r] = len(refs)
            refs.append(r)
        return got

    ops, held = [], []
    made: dict = {}  # node name -> {output index: ref code} (inputs found without hashing a Ref)
    backward = Phase.BACKWARD
    for i, n in enumerate(nodes):
        name = n.name
        outs = tuple((j, c(Ref(name, j))) for j, spec in enumerate(n.outputs) if spec is not None)
        made[name] = dict(outs)
        if n.op == "placeholder":
            if n.outputs[0] is not None:
                held.append((n, outs[0][1]))
            continue
        ins = []
        for k, r in enumerate(n.inputs):
            got = made.get(r.node, {}).get(r.index)
            ins.append((k, c(r) if got is None else got, r.node in views))
        ops.append((i, n, n.phase == backward, tuple(ins), outs, bool(n.op in ALIASES and n.inputs)))
    issue = {k: at(*v) for k, v in issue_times(nodes, order, first_back).items()}
    grads = [(fqn, code[r], code[Ref(graph.params[fqn], 0)]) for fqn, r in graph.grads.items()]
    prog = Program(order, first_back, views, ops, issue, None, code, refs, length=len(nodes), placeholders=held,
                   grads=grads)
    _PROGRAMS[graph] = (len(nodes), prog)
    return prog


def rerun_times(graph: Graph, redo: frozenset, order: dict, readers: Mapping[str, list]) -> dict:
    """The moment each recomputed op runs again: just before the first backward op (or re-run op)
    that reads what it makes (``readers``: node name -> the nodes reading it); ops nothing in the
    backward reads are not run again."""
    out: dict[str, int] = {}
    for name in sorted(redo, key=lambda x: -order[x]):
        ts = [order[m] for m in readers.get(name, ()) if graph.node(m).phase == Phase.BACKWARD]
        ts += [out[m] for m in readers.get(name, ()) if m in out]
        if ts:
            out[name] = min(ts)
    return out


def first_backward(nodes, training: bool) -> int:
    """The index of the first backward op in ``nodes`` (``len(nodes)`` without one)."""
    if training:
        for i, n in enumerate(nodes):
            if n.phase == Phase.BACKWARD and n.op != "placeholder":
                return i
    return len(nodes)


def issue_times(nodes, order: dict, first_back: int) -> dict:
    """(node, "f"|"b") -> the moment a parameter gather for that node is issued: the start of the
    layer before the node's layer in its phase, or the phase's start for a node outside the layers
    (``passes/lower/schedule``)."""
    out = {}
    for phase, lo, hi in (("f", 0, first_back), ("b", first_back, len(nodes))):
        starts: list[int] = []
        seen = set()
        current = -1
        for n in nodes[lo:hi]:
            if n.is_placeholder:
                continue
            lay = layer_key(n.module_path or "")
            if lay is not None and lay not in seen:
                seen.add(lay)
                starts.append(order[n.name])
            current = len(starts) - 1 if lay is not None else None
            if current is None:
                out[(n.name, phase)] = (lo, -2)
            else:
                out[(n.name, phase)] = (starts[max(current - 1, 0)], -2)
    return out


__all__ = ["LAST", "W", "Program", "at", "first_backward", "issue_times", "program", "rerun_times"]
