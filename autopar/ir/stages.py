"""Where each op of a graph sits along the model's chain of layers: before the layer instances, in one
of them, or after them; the one rule the pipeline planner (``passes/search/pipeline_split.py``) and
the pipeline runtime (``runtime/pipeline/``) share, so stages are priced as they run; and the cut of a
graph's forward into stages along it (``cut_graph``), which the pipeline axis alone runs eagerly.

Layer instances are ``ir.layers``'s (folded or not), numbered in graph order. An op outside every
instance is *before* (``PRE``) when it is a forward op that runs before the first instance's first
op, or a backward op that runs after the first instance's last backward op (the embedding and its
gradient); otherwise *after* (``POST``: final norm, head, loss and their gradients). A placeholder
takes the region of its first reader (a parameter read both before and after the layers, a tied
embedding and head, is in both: ``Chain.both``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

from autopar.errors import ArgumentError
from autopar.ir.graph import Graph, Phase, Ref
from autopar.ir.layers import Key, layer_key, layers

PRE, POST = -1, -2  # the regions before and after the layer instances


@dataclass(frozen=True)
class Chain:
    """``keys``: the layer instances in graph order; ``region``: node name -> instance index, PRE or
    POST; ``both``: outside placeholders read before and after the layers; ``paths``: the module path
    of each instance (``"blocks.3"``)."""

    keys: tuple[Key, ...]
    region: dict[str, int]
    both: frozenset[str]
    paths: tuple[str, ...]


#: ``chain`` per graph (read by the split, each stage's read-back and the stage rule), with the node
#: count it was made at
_CHAINS: "weakref.WeakKeyDictionary[Graph, tuple[int, Chain]]" = weakref.WeakKeyDictionary()


def chain(graph: Graph) -> Chain:
    """The graph's layer chain (see the module docstring); made once per graph."""
    got = _CHAINS.get(graph)
    if got is not None and got[0] == len(graph.nodes):
        return got[1]
    made = _chain(graph)
    _CHAINS[graph] = (len(graph.nodes), made)
    return made


def _chain(graph: Graph) -> Chain:
    found = layers(graph)
    pos = {n.name: k for k, n in enumerate(graph.nodes)}
    keys = tuple(sorted(found.instances, key=lambda k: pos[found.instances[k][0]]))
    order = {k: i for i, k in enumerate(keys)}
    owner = {name: order[k] for k, names in found.instances.items() for name in names}
    fwd = [k for k, n in enumerate(graph.nodes) if n.name in owner and n.phase == Phase.FORWARD and not n.is_placeholder]
    bwd = [k for k, n in enumerate(graph.nodes) if n.name in owner and n.phase == Phase.BACKWARD]
    first_fwd = fwd[0] if fwd else len(graph.nodes)
    last_bwd = bwd[-1] if bwd else -1
    region: dict[str, int] = {}
    for k, n in enumerate(graph.nodes):
        if n.name in owner:
            region[n.name] = owner[n.name]
        elif n.is_placeholder:
            continue
        elif n.phase == Phase.FORWARD:
            region[n.name] = PRE if k < first_fwd else POST
        else:
            region[n.name] = PRE if k > last_bwd else POST
    users = graph.users()
    both = set()
    for n in graph.nodes:
        if n.is_placeholder and n.name not in region:
            regs = [region[u] for u in users[n.name] if u in region and graph.node(u).op != "output"]
            region[n.name] = regs[0] if regs else PRE
            if PRE in regs and POST in regs:
                both.add(n.name)
    paths = tuple(layer_key(f"{p}.{i}" if p else str(i)) or f"{p}.{i}" for p, i in keys)
    return Chain(keys, region, frozenset(both), paths)


def region_paths(graph: Graph, ch: Chain, r: int) -> list[str]:
    """The module paths of region ``r``'s forward ops, in graph order."""
    out: list[str] = []
    for n in graph.nodes:
        if ch.region.get(n.name) == r and n.phase == Phase.FORWARD and not n.is_placeholder and n.module_path:
            if n.module_path not in out:
                out.append(n.module_path)
    return out


def stage_rule(graph: Graph, stages: list) -> Callable[[str], int]:
    """IR op name -> its pipeline stage: the chain rule above with a plan's stage lists (the module
    paths of the layer instances per stage); what runs before the layers is the first stage's, what
    runs after them the last's. Raises ``ArgumentError`` naming the layers no stage lists."""
    ch = chain(graph)
    of_unit = {}
    for s, paths in enumerate(stages):
        for p in paths:
            if p in ch.paths:
                of_unit[ch.paths.index(p)] = s
    missing = [p for u, p in enumerate(ch.paths) if u not in of_unit]
    if missing:
        raise ArgumentError(f"autopar pipeline: the plan's stages do not list the layer(s) {missing}; was the plan "
                            "made for this model?")
    last = len(stages) - 1

    def stage_of(name: str) -> int:
        r = ch.region.get(name, PRE)
        return 0 if r == PRE else last if r == POST else of_unit[r]
    return stage_of


def forward_readers(graph: Graph, stage_of) -> dict[str, set[int]]:
    """Parameter FQN -> the stages (``stage_of``: node name -> stage) whose forward ops read it, e.g.
    two for a tied embedding and head; empty for a parameter no forward op reads."""
    users = graph.users()
    return {fqn: {stage_of(u) for u in users[name] if graph.node(u).phase == Phase.FORWARD}
            for fqn, name in graph.params.items()}


def param_stages(graph: Graph, stages: list) -> dict[str, frozenset]:
    """Parameter FQN -> the pipeline stages whose forward ops read it (``stage_rule``'s,
    ``forward_readers``); a parameter no forward op reads is its gradient's stage's."""
    stage_of = stage_rule(graph, stages)
    out = {}
    for fqn, found in forward_readers(graph, stage_of).items():
        grad = graph.grads.get(fqn)
        out[fqn] = frozenset(found or ({stage_of(grad.node)} if grad is not None else {0}))
    return out


@dataclass(frozen=True)
class GraphCut:
    """A forward graph cut into stages (``cut_graph``)."""

    home: dict[str, int]  # op name -> its stage
    boundaries: list[list[Ref]]  # boundaries[s]: the gradient-carrying values sent from stage s to s + 1
    runs: list[set[str]]  # per stage: the names of its ops and of the gradient-free values it makes again


def _carries_gradient(graph: Graph, trainable: set[str]) -> dict[Ref, bool]:
    """Which values depend on a trainable parameter (``trainable``: placeholder names) through floats."""
    carries: dict[Ref, bool] = {}
    for n in graph.nodes:
        for j, spec in enumerate(n.outputs):
            if spec is None:
                continue
            if n.is_placeholder:
                c = n.name in trainable
            else:
                c = spec.dtype.is_floating_point and any(carries.get(r, False) for r in n.inputs)
            carries[Ref(n.name, j)] = c
    return carries


def cut_graph(graph: Graph, stage_of: Callable[[str], int], n_stages: int, trainable: set[str]) -> GraphCut:
    """``graph`` (a forward, its loss its first output) cut into ``n_stages`` stages by ``stage_of``:
    every value that carries gradient (depends on a ``trainable`` parameter placeholder) made in an
    earlier stage and read in a later one crosses each boundary in between (torch's schedules only
    talk to adjacent stages); a value that carries none is made again in every stage that reads it.
    An ``ArgumentError`` when a stage reads a gradient-carrying value that is not handed to it."""
    carries = _carries_gradient(graph, trainable)
    ops = [n for n in graph.nodes if not n.is_placeholder]
    home = {n.name: stage_of(n.name) for n in ops}
    readers: dict[Ref, set[int]] = {}
    for n in ops:
        for r in n.inputs:
            readers.setdefault(r, set()).add(home[n.name])
    loss = graph.outputs[0]
    readers.setdefault(loss, set()).add(n_stages)  # the loss leaves the last stage
    boundaries: list[list[Ref]] = [[] for _ in range(n_stages)]
    for n in ops:
        for j in range(len(n.outputs)):
            r = Ref(n.name, j)
            if not carries.get(r) or r not in readers:
                continue
            for s in range(home[n.name], max(readers[r]) if r != loss else home[n.name]):
                boundaries[s].append(r)
    by_name = {n.name: n for n in graph.nodes}
    runs = []
    for s in range(n_stages):
        own = {n.name for n in ops if home[n.name] == s}
        need = set(own)
        todo = [r.node for name in own for r in by_name[name].inputs]
        given = {r.node for r in boundaries[s - 1]} if s > 0 else set()
        while todo:  # values made elsewhere that carry no gradient: made again here
            name = todo.pop()
            if name in need or name in given:
                continue
            node = by_name[name]
            if not node.is_placeholder and any(carries.get(Ref(name, j)) for j in range(len(node.outputs))):
                raise ArgumentError(f"autopar pipelined: stage {s} reads {graph.user_name(Ref(name))} from a "
                                    "non-adjacent stage without its gradient path; this model does not cut cleanly")
            need.add(name)
            todo += [r.node for r in node.inputs]
        runs.append(need)
    return GraphCut(home, boundaries[:n_stages - 1], runs)


def boundary_carriers(graph: Graph, stage_of: Callable[[str], int], placed: Callable[[Ref], tuple]) -> dict[Ref, tuple]:
    """Backward values handed to an earlier stage whose own placement (``placed``: a value's
    placements where it is made) gives a local shape no activation crossing that boundary has ->
    the placements they cross in instead: those of a forward value that crosses each boundary they
    cross, of the same shape and dtype. Torch's stages send a stage's input gradients back in the
    slots (the local shapes) of its inputs, so a gradient crosses as its activation is placed
    (the lowering reshards it there before the boundary, ``passes.lower.tagged``)."""
    fwd = [n for n in graph.ops() if n.phase == Phase.FORWARD]
    bwd = [n for n in graph.ops() if n.phase == Phase.BACKWARD]
    param = set(graph.params.values())
    upstream: dict[str, bool] = {}  # forward ops with a parameter upstream (the values stages send)
    for n in fwd:
        upstream[n.name] = any(r.node in param or upstream.get(r.node, False) for r in n.inputs)

    def crossing(nodes, forward: bool) -> dict[Ref, range]:
        """Value -> the boundaries it crosses: (forward) made earlier and read later, the values a stage
        sends (those without a parameter upstream are made again where read); (backward) the reverse."""
        out: dict[Ref, range] = {}
        for n in nodes:
            here = stage_of(n.name)
            for r in n.inputs:
                src = graph.node(r.node)
                sends = (upstream.get(r.node, False) if forward
                         else src.phase == Phase.BACKWARD and not src.is_placeholder)
                if not sends:
                    continue
                made = stage_of(r.node)
                lo, hi = (made, here) if forward else (here, made)
                if lo < hi:
                    span = out.get(r)
                    out[r] = range(lo, hi) if span is None else range(min(span.start, lo), max(span.stop, hi))
        return out

    sent, back = crossing(fwd, True), crossing(bwd, False)
    if not back:
        return {}
    slots: dict[int, list[Ref]] = {}  # boundary b (stage b -> b + 1) -> the forward values crossing it
    for r, span in sent.items():
        for b in span:
            slots.setdefault(b, []).append(r)
    free = {b: list(refs) for b, refs in slots.items()}
    kind = {r: (graph.spec(r).shape, graph.spec(r).dtype) for r in list(sent) + list(back)}
    out: dict[Ref, tuple] = {}
    # a value whose own placement already fits a slot takes it first; the others are carried
    for r in sorted(back, key=lambda r: not all(any(kind[f] == kind[r] and placed(f) == placed(r) for f in
                                                    free.get(b, [])) for b in back[r])):
        options = [placed(f) for f in free.get(back[r].start, []) if kind[f] == kind[r]]
        options = [p for p in dict.fromkeys(options) if all(
            any(kind[f] == kind[r] and placed(f) == p for f in free.get(b, [])) for b in back[r])]
        if not options:
            continue  # nothing to pair with: the stage cut refuses it by name
        want = placed(r) if placed(r) in options else options[0]
        for b in back[r]:
            free[b].remove(next(f for f in free[b] if kind[f] == kind[r] and placed(f) == want))
        if want != placed(r):
            out[r] = want
    return out


__all__ = ["Chain", "GraphCut", "POST", "PRE", "boundary_carriers", "chain", "cut_graph", "forward_readers",
           "param_stages", "region_paths", "stage_rule"]
