"""Layers: the repeated blocks of a model, found from the graph, and the one membership every pass uses.

One rule serves every pass that needs layers, so they cannot disagree: ``fold`` folds agreeing
instances, the cast policy keeps layer ops in the compute dtype, and parameter gathers are grouped
per layer instance. Instances are anchored by their parameters and buffers: those whose FQN has a
numbered module (``layers.3.wq.weight``: instance 3 of ``layers``). Their ops are found from the
graph, whatever module ran them (docs/design/search.md, "Fold, merge, solve"):

- forward: instance i owns the forward ops from its first parameter use to its last, and the ops
  after its last up to instance i+1's first (residual adds, RoPE, attention, anything written in
  the parent's ``forward``, reads of shared buffers) up to a *cut*: the point of that gap where the
  fewest values cross (the residual stream alone; the latest such point on a tie), at the same
  offset in every gap; what follows the cut (a norm's statistics, computed before its weight is
  read) belongs to instance i+1. Instance 0 also owns the ops just before its first parameter use
  that agree one by one with those instance 1 owns before its own, and the last instance the ops
  after its last use that agree with those its predecessor owns after its own;
- backward: an op follows the forward op it differentiates (autograd's sequence number; where no
  forward op carries the number, as for an in-place op rewritten at capture, its module path's
  instance). A gradient
  accumulation (the sum of a tensor's gradients from its several uses) has none: it joins the
  lowest instance among its inputs', or the instance of the use whose gradient it adds
  (``_accumulation_owner``), or stays outside, whichever folds best (below);
- instances *agree* when their node sequences do, position by position (op, output shapes and
  dtypes, non-tensor arguments, phase, and wiring: an input made inside the instance by its
  position), or when one lacks only gradient accumulations the others have (``ir.agreement``);
  the largest set of agreeing instances of a prefix is what ``fold`` folds.

The module-path rule (a node belongs to the first numbered module on its module path; module-less
accumulations to the lowest instance among their inputs', or none) gives further candidates, for
graphs without autograd sequence numbers and prefixes whose instances' parameter uses interleave.
Of the candidates, a prefix takes the one that folds best (``agreement.score``): most nodes folded per added
layer, then most nodes folded.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from autopar.ir.agreement import Key, agreeing, group_by_key, is_accumulation, largest, score, signature
from autopar.ir.graph import Graph, Node, Phase, Ref


@functools.lru_cache(maxsize=1 << 16)
def layer_of(path: str) -> Optional[Key]:
    """``"model.layers.3.attn"`` -> ``("model.layers", 3)``: the first numbered module on the path
    (cached: every node of a module asks)."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i]), int(p)
    return None


def layer_key(path: str) -> Optional[str]:
    """``"model.layers.3.attn"`` -> ``"model.layers.3"``; ``"0.fc"`` -> ``"0"``: the layer's module path."""
    found = layer_of(path)
    if found is None:
        return None
    prefix, index = found
    return f"{prefix}.{index}" if prefix else str(index)


@dataclass(frozen=True)
class Layers:
    """The layer membership of a graph: ``instances[(prefix, i)]`` lists instance i's node names in
    graph order (parameter placeholders included); ``alike[prefix]`` the indices of the instances
    that agree node by node (two or more; absent when none do), which ``fold`` folds."""

    instances: dict[Key, tuple[str, ...]]
    alike: dict[str, tuple[int, ...]]
    owner: dict[str, Key] = field(default_factory=dict, repr=False)
    #: an agreeing instance that lacks some of the first's gradient accumulations (``agreement.align``):
    #: the position in the first instance of each of its nodes (absent: node k at position k)
    positions: dict[Key, tuple[int, ...]] = field(default_factory=dict)

    def of(self, name: str) -> Optional[Key]:
        """The instance node ``name`` belongs to, or None outside the layers."""
        return self.owner.get(name)

    def members(self) -> frozenset[str]:
        """Every node of every instance (agreeing or not)."""
        return frozenset(self.owner)


_CACHE: "weakref.WeakKeyDictionary[Graph, Layers]" = weakref.WeakKeyDictionary()


def layers(graph: Graph) -> Layers:
    """The graph's layer membership (computed once per graph)."""
    got = _CACHE.get(graph)
    if got is None:
        got = _CACHE[graph] = _find(graph)
    return got


def known_layers(graph: Graph) -> Optional[Layers]:
    """The graph's layer membership where it is made already, else None (nothing is computed)."""
    return _CACHE.get(graph)


def layer_members(graph: Graph) -> frozenset[str]:
    """Every node of a layer instance, as ``fold`` groups them."""
    return layers(graph).members()


# ---------------------------------------------------------------------------------------------
# the candidate memberships


def _placeholder_layers(graph: Graph) -> dict[str, Key]:
    """Parameter and buffer placeholders of numbered modules -> their instance (by FQN)."""
    out = {}
    for fqn, name in list(graph.params.items()) + list(graph.buffers.items()):
        key = layer_of(fqn)
        if key is not None:
            out[name] = key
    return out


def _common_anchors(graph: Graph, anchors: dict[str, Key]) -> dict[str, Key]:
    """The anchors every instance of their prefix has (the same FQN below ``prefix.i.``). One an
    instance has alone (T5's relative position bias, in the first block only) anchors nothing: what
    it computes is made once and read by every instance (``_shared_out``)."""
    suffix: dict[str, str] = {}
    for fqn, name in list(graph.params.items()) + list(graph.buffers.items()):
        key = anchors.get(name)
        if key is not None:
            suffix[name] = fqn[len(f"{key[0]}.{key[1]}."):] if key[0] else fqn[len(f"{key[1]}."):]
    count: dict[tuple[str, str], set[int]] = defaultdict(set)
    for name, key in anchors.items():
        count[(key[0], suffix[name])].add(key[1])
    indices: dict[str, set[int]] = defaultdict(set)
    for key in anchors.values():
        indices[key[0]].add(key[1])
    return {name: key for name, key in anchors.items() if count[(key[0], suffix[name])] == indices[key[0]]}


def _shared_out(forward: list[Node], windows: list[list[int]], common: dict[str, Key]) -> list[list[int]]:
    """``windows`` without the ops an instance computes once for all of them: a value that depends
    on none of the instance's own parameters (common anchors) yet is read by another instance
    (T5's position bias and its mask, made in the first block and passed to the others), and the
    ops of the same kind that only it reads. They stay outside the instances, so the first
    instance agrees with the others."""
    at = {n.name: k for k, n in enumerate(forward)}
    window_of = {k: j for j, w in enumerate(windows) for k in w}
    readers: dict[int, list[int]] = defaultdict(list)
    for k, n in enumerate(forward):
        for r in n.inputs:
            if r.node in at:
                readers[at[r.node]].append(k)
    out = []
    for j, window in enumerate(windows):
        dep: dict[int, bool] = {}
        for k in window:
            dep[k] = any(r.node in common or dep.get(at.get(r.node, -1), False) for r in forward[k].inputs)
        excluded: set[int] = set()
        for k in reversed(window):
            if dep[k]:
                continue
            mine = [u for u in readers[k] if window_of.get(u) == j]
            if any(window_of.get(u, j) != j for u in readers[k]) or (mine and all(u in excluded for u in mine)):
                excluded.add(k)
        out.append([k for k in window if k not in excluded] if excluded else window)
    return out


def _seq_nr(node: Node) -> Optional[int]:
    meta = node.fx_node.meta if node.fx_node is not None else {}
    s = meta.get("seq_nr")
    return None if s is None or int(s) < 0 else int(s)


def _accumulate(graph: Graph, node: Node, owner: dict[str, Key]) -> Optional[Key]:
    """The lowest instance among a gradient accumulation's inputs' (one prefix only), else None."""
    keys = [owner[r.node] for r in node.inputs if r.node in owner]
    return min(keys) if keys and len({k[0] for k in keys}) == 1 else None


def _accumulation_owner(graph: Graph, node: Node, owner: dict[str, Key], users: dict[str, list[str]]) -> Optional[Key]:
    """A gradient accumulation adds the gradient of one use of a tensor to the sum of the others':
    it follows that use (the instance of the backward op that made the gradient). The first of a
    chain adds two uses' gradients and follows the first (autograd sums the latest use first). An
    input is a partial sum when it is an accumulation read by this one alone."""
    def partial(r: Ref) -> bool:
        return is_accumulation(graph.node(r.node)) and users[r.node] == [node.name]

    added = [r for r in node.inputs if not partial(r)]
    return owner.get(added[0].node) if added else None


def _by_module_path(graph: Graph, anchors: dict[str, Key], with_acc: bool) -> dict[str, Key]:
    """The module-path rule: the first numbered module on a node's module path; with ``with_acc``
    module-less gradient accumulations join the lowest instance among their inputs'."""
    owner: dict[str, Key] = {}
    for node in graph.nodes:
        if node.is_placeholder:
            key = anchors.get(node.name)
        else:
            key = layer_of(node.module_path) if node.module_path else None
            if key is None and with_acc and not node.module_path:
                key = _accumulate(graph, node, owner)
        if key is not None:
            owner[node.name] = key
    return owner


def _forward_windows(graph: Graph, anchors: dict[str, Key]) -> Optional[dict[str, Key]]:
    """The structural rule's forward part (module docstring): the anchors and the forward ops of
    each prefix's instances, or None without autograd sequence numbers (the backward could not
    follow). A prefix whose instances' parameter uses interleave is left out."""
    forward = [n for n in graph.nodes if not n.is_placeholder and n.phase == Phase.FORWARD]
    if not any(_seq_nr(n) is not None for n in forward):
        return None
    at = {n.name: k for k, n in enumerate(forward)}
    anchors = _common_anchors(graph, anchors)
    uses: dict[Key, list[int]] = defaultdict(list)
    reads_param = [False] * len(forward)
    last_read = list(range(len(forward)))  # forward position of each op's last forward reader
    for k, n in enumerate(forward):
        for r in n.inputs:
            key = anchors.get(r.node)
            if key is not None:
                uses[key].append(k)
                reads_param[k] = True
            elif r.node in at:
                last_read[at[r.node]] = k
    owner: dict[str, Key] = {}
    for prefix in sorted({p for p, _ in uses}):
        idx = sorted(i for p, i in uses if p == prefix)
        first = [min(uses[(prefix, i)]) for i in idx]
        last = [max(uses[(prefix, i)]) for i in idx]
        if len(idx) < 2 or any(last[j] >= first[j + 1] for j in range(len(idx) - 1)):
            continue
        owner.update((n, key) for n, key in anchors.items() if key[0] == prefix)
        cut = fewest_crossing_cut(first[0], last[0], first[1], last_read)
        bounds = [(min(last[j - 1] + 1 + cut, first[j]) if j else first[0], min(last[j] + 1 + cut, first[j + 1])
                   if j + 1 < len(idx) else last[j] + 1) for j in range(len(idx))]
        windows = _shared_out(forward, [list(range(a, b)) for a, b in bounds], anchors)
        # the first instance takes the ops before its weights that agree with what the second runs
        # before its own; the last, those after its weights that agree with what the one before runs
        ahead = list(range(bounds[1][0], first[1]))
        windows[0] = _matching(forward, windows[1], windows[0], ahead, reads_param, before=True) + windows[0]
        behind = list(range(last[-2] + 1, bounds[-2][1]))
        windows[-1] += _matching(forward, windows[-2], windows[-1], behind, reads_param, before=False)
        windows = _shared_out(forward, windows, anchors)
        for i, window in zip(idx, windows):
            for k in window:
                owner.setdefault(forward[k].name, (prefix, i))
    return owner


def fewest_crossing_cut(start: int, last: int, nxt: int, last_read: list[int]) -> int:
    """How many of the ops between an instance's last parameter use (``last``) and the next
    instance's first (``nxt``) stay with it: the cut where the fewest values made since ``start``
    cross (the residual stream alone, where the layer's own ops end), the latest such cut on a tie.
    One sweep: a value crosses cut ``c`` when it is made before ``c`` and read at ``c`` or later."""
    ends: dict[int, int] = defaultdict(int)
    for p in range(start, nxt):
        ends[last_read[p]] += 1
    crossing = sum(1 for p in range(start, last + 1) if last_read[p] > last)
    best, at = crossing, 0
    for c in range(last + 1, nxt):  # from cut c to cut c + 1: op c's value joins, values last read at c leave
        crossing += (last_read[c] > c) - (ends[c] - (last_read[c] == c))
        if crossing <= best:
            best, at = crossing, c - last
    return at


def _structural(graph: Graph, forward_owner: dict[str, Key]) -> dict[str, Key]:
    """The structural rule's backward part: an op follows the forward op it differentiates (same
    autograd sequence number); gradient accumulations stay outside (``_with_accumulations``)."""
    owner = dict(forward_owner)
    # a sequence number is the autograd op's that took it first: the ops after it that carry it too
    # (non-differentiable ones, such as a mask built after it) do not make its backward theirs
    seq_owner: dict[int, Optional[Key]] = {}
    for n in graph.nodes:
        if n.phase == Phase.FORWARD and not n.is_placeholder:
            s = _seq_nr(n)
            if s is not None:
                seq_owner.setdefault(s, owner.get(n.name))
    keys = set(forward_owner.values())
    for node in graph.nodes:
        if node.phase == Phase.BACKWARD and not node.is_placeholder and not is_accumulation(node):
            s = _seq_nr(node)
            if s is not None and seq_owner.get(s) is not None:
                owner[node.name] = seq_owner[s]
            elif s is not None and s not in seq_owner and node.module_path:
                # no forward op carries its number (an in-place op rewritten at capture: Mixtral's
                # ``routing_weights /= sum``): it follows its module path, if that names an instance
                key = layer_of(node.module_path)
                if key in keys:
                    owner[node.name] = key
    return owner


def _with_accumulations(graph: Graph, base: dict[str, Key], accumulate: str) -> dict[str, Key]:
    """``base`` with the gradient accumulations joined by ``accumulate`` ("min": the lowest
    instance among their inputs', "added": ``_accumulation_owner``)."""
    owner = dict(base)
    users = graph.users() if accumulate == "added" else {}
    for node in graph.nodes:
        if node.phase == Phase.BACKWARD and is_accumulation(node):
            key = (_accumulate(graph, node, owner) if accumulate == "min"
                   else _accumulation_owner(graph, node, owner, users))
            if key is not None:
                owner[node.name] = key
    return owner


def _matching(forward: list[Node], other: list[int], mine: list[int], ref: list[int], reads_param: list[bool],
              before: bool) -> list[int]:
    """The ops right after (``before``: right before) ``mine`` that agree one by one with ``ref``
    (the same stretch of the ``other`` instance, positions in ``other``): the longest such run that
    reads no parameter. After: it stops at the first op that differs; before: the longest agreeing
    run ending where ``mine`` starts."""
    if not ref:
        return []
    ref_pos = {forward[k].name: j for j, k in enumerate(other)}
    want = [signature(forward[k], ref_pos) for k in ref]
    if before:
        for m in range(len(ref), 0, -1):
            cand = list(range(mine[0] - m, mine[0]))
            if cand[0] < 0 or any(reads_param[c] for c in cand):
                continue
            pos = {forward[k].name: j + len(ref) - m for j, k in enumerate(cand + mine)}
            if [signature(forward[c], pos) for c in cand] == want[len(ref) - m:]:
                return cand
        return []
    pos = {forward[k].name: j for j, k in enumerate(mine)}
    taken: list[int] = []
    for j, k in enumerate(ref):
        c = mine[-1] + 1 + j
        if c >= len(forward) or reads_param[c]:
            break
        pos[forward[c].name] = len(mine) + j
        if signature(forward[c], pos) != want[j]:
            break
        taken.append(c)
    return taken


def _find(graph: Graph) -> Layers:
    """Per prefix, the candidate membership that folds best (``agreement.score``; the structural
    rule first on ties)."""
    anchors = _placeholder_layers(graph)
    windows = _forward_windows(graph, anchors)
    structural = []
    if windows is not None:
        base = _structural(graph, windows)
        structural = [_with_accumulations(graph, base, "added"), _with_accumulations(graph, base, "min"), base]
    fallback = group_by_key(graph, _by_module_path(graph, anchors, True))
    grouped = [group_by_key(graph, c) for c in structural] + [
        fallback, group_by_key(graph, _by_module_path(graph, anchors, False))]
    instances: dict[Key, tuple[str, ...]] = {}
    alike: dict[str, tuple[int, ...]] = {}
    positions: dict[Key, tuple[int, ...]] = {}
    owner: dict[str, Key] = {}
    seen: dict[tuple, tuple] = {}  # an instance's node sequence -> its signatures (``agreeing``)
    for prefix in sorted({p for p, _ in fallback}):
        best, best_score, classes, where = fallback, None, [], {}
        for by_key in grouped:
            lengths = [len(names) for (p, _), names in by_key.items() if p == prefix]
            if not lengths:
                continue
            # no score can pass (longest instance, every other instance folded at that length):
            # a candidate that cannot beat the best so far is not compared node by node
            if best_score is not None and (max(lengths), (len(lengths) - 1) * max(lengths)) <= best_score:
                continue
            got_classes, got_where = agreeing(graph, by_key, prefix, seen)
            got = score(by_key, prefix, got_classes)
            if best_score is None or got > best_score:
                best, best_score, classes, where = by_key, got, got_classes, got_where
        mine = {}
        for key in sorted(k for k in best if k[0] == prefix):
            mine[key] = [n for n in best[key] if n not in owner]  # a node another prefix took stays there
            instances[key] = tuple(mine[key])
            owner.update((n, key) for n in mine[key])
        if any(len(mine[k]) != len(best[k]) for k in mine):
            classes, where = agreeing(graph, mine, prefix, seen)
        ix = largest(mine, prefix, classes)
        if ix:
            alike[prefix] = ix
            positions.update(((prefix, i), where[i]) for i in ix if i in where)
    return Layers(instances, alike, owner, positions)


__all__ = ["Layers", "fewest_crossing_cut", "known_layers", "layer_key", "layer_members", "layer_of", "layers"]
