"""Kept gathers: a layer instance's parameters, gathered in the forward, kept for the backward.

By default a parameter sharded on a data axis (FSDP, ZeRO-3) is gathered before each use and the
gathered block freed after it, so the backward gathers it again. Keeping the forward's gathered
block until the backward (FSDP's ``reshard_after_forward=False``, ZeRO-2) saves the backward's
gathers and holds the gathered bytes from forward to backward. Per folded layer group the plan says
which instances keep (``Plan.kept_gathers``, module paths).

One rule (``kept_reads``) says, for the chosen placements, which backward reads of a kept
instance's parameters come from the forward's gathered blocks; the plan's reshardings, the prices
and the lowering all call it, so what the plan predicts is what the program runs:

- the forward's gathers of a kept instance are every (parameter or layout view ``v``, placement
  ``dst``) its forward ops read resharded;
- a backward read (``u``, ``want``) of a parameter view of the instance whose resharding moves data
  (any collective) comes from a kept block when ``u`` is ``v`` or a layout view of it (the backward
  reads ``t(t(w))`` where the forward read ``t(w)``): the view ops from ``v`` to ``u`` run again on
  the gathered block, each under the strategy that reads it as placed, and the result must be
  ``want`` or reach it by local slicing alone. Otherwise the backward gathers again.

Why a per-group choice after the solve, not a term of the ILP: the saving exists only when the
forward's and the backward's consumers of a weight agree on its placement, a term over pairs of
nodes the ILP does not have (its transfers are per tensor and phase). Once placements are chosen,
both prices are exact and cheap (``evaluate`` of the problem with the dropped gathers' chosen costs
zeroed, and the kept blocks' bytes), and keeping only adds memory and removes time: it can never
make a plan fit that did not, so the budget search (``checkpoint``) is unchanged, and a group keeps
when that makes the step faster and the peak still fits (``choose``: groups in order of seconds
saved per byte).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

from autopar.cost_model.casting import cast_policy, transfer_bytes
from autopar.cost_model.comm import reshard_steps
from autopar.cost_model.gathers import param_of
from autopar.cost_model.memory import local_numel
from autopar.cost_model.mesh import Mesh
from autopar.cost_model.precision import Precision
from autopar.errors import ArgumentError
from autopar.ir.dimflow import local_signature
from autopar.ir.graph import Graph, Phase, Ref
from autopar.ir.layers import layers
from autopar.ir.placement import Placements
from autopar.ir.rules.base import has_rule
from autopar.ir.rules.dimmap import Strategy
from autopar.ir.views import param_views
from autopar.passes.search.fold import Folding
from autopar.passes.search.problem import Problem, evaluate
from autopar.passes.search.strategies import input_placement, node_strategies, output_placement

#: what ``kept_gathers=`` accepts besides a list of module-path globs (or a dict glob -> bool)
PINS = ("none", "all")

Pin = Union[None, str, Sequence[str], Mapping[str, bool]]

#: reshard steps that move nothing between devices
LOCAL_STEPS = frozenset({"slice", "zero", "pad"})


@dataclass(frozen=True)
class Derived:
    """A backward read served by a kept block: the forward's gathered value ``source`` placed
    ``placed``, then the view ops ``replay`` (node name, strategy) run on it, then local slicing
    to the read's placement (none when ``replay`` already ends there)."""

    source: Ref
    placed: Placements
    replay: tuple[tuple[str, Strategy], ...] = ()


def instance_path(graph: Graph, name: str, membership=None, fqn_of=None) -> Optional[str]:
    """The module path of the layer instance (``layers.3``) whose parameter node ``name`` is or
    views; None outside the numbered layers."""
    fqn = param_of(graph, name, fqn_of)
    if fqn is None:
        return None
    at = (membership or layers(graph)).of(graph.params[fqn])
    if at is None:
        return None
    prefix, i = at
    return f"{prefix}.{i}" if prefix else str(i)


def _moves(shape, src, dst, mesh: Mesh) -> bool:
    return any(s.kind not in LOCAL_STEPS for s in reshard_steps(shape, src, dst, mesh, 1))


def kept_reads(graph: Graph, strategy_of: Callable[[str], Strategy], kept: Iterable[str], mesh: Mesh,
               recomputed: frozenset = frozenset()) -> dict[tuple[Ref, Placements], Derived]:
    """Every backward read ``(value, placement)`` of a parameter (or a view of one) of an instance
    in ``kept`` (module paths) that a forward gather's block serves, with how (``Derived``).
    ``strategy_of`` gives each node's chosen strategy; ``recomputed`` the forward ops a
    checkpointed instance runs again in the backward (they read their weights there too)."""
    kept = set(kept)
    if not kept or not graph.training:
        return {}
    views = param_views(graph)
    membership = layers(graph)
    fqn_of = {node: fqn for fqn, node in graph.params.items()}
    path_of: dict[str, Optional[str]] = {}

    def path(name: str) -> Optional[str]:
        if name not in path_of:
            path_of[name] = instance_path(graph, name, membership, fqn_of)
        return path_of[name]

    def reads(nodes) -> Iterable[tuple[Ref, Placements]]:
        for node in nodes:
            strat = None
            for slot, r in enumerate(node.inputs):
                if r.node not in views or path(r.node) not in kept:
                    continue
                if strat is None:
                    strat = strategy_of(node.name)
                src, dst = tuple(output_placement(strategy_of(r.node), r.index)), tuple(input_placement(strat, slot))
                if src != dst:
                    yield r, dst, src

    # the ops that read a parameter view of a kept instance, in graph order (the only ones ``reads`` yields for)
    users = graph.users()
    readers = {u for v in views if path(v) in kept for u in users[v]}
    ops = [n for n in graph.ops() if n.name in readers]
    gathered: dict[Ref, list[Placements]] = {}
    for r, dst, _ in reads(n for n in ops if n.phase == Phase.FORWARD):
        if dst not in gathered.setdefault(r, []):
            gathered[r].append(dst)
    out: dict[tuple[Ref, Placements], Derived] = {}
    later = [n for n in ops if n.phase == Phase.BACKWARD] + [n for n in ops if n.name in recomputed]
    known: dict[tuple, list[Strategy]] = {}  # the view ops' strategies, per local signature (alike layers: once)

    def strategies(node) -> list[Strategy]:
        # a node's strategies follow from what its DimMap is made of (and, for an op without a
        # rule, its module path: the warning that says so names it)
        key = (local_signature(graph, node), None if has_rule(node.op) else node.module_path)
        if key not in known:
            known[key] = node_strategies(graph, node, mesh)
        return known[key]

    for r, want, src in reads(later):
        if (r, want) in out or not _moves(graph.spec(r).shape, src, want, mesh):
            continue
        found = _derive(graph, r, want, gathered, mesh, strategies)
        if found is not None:
            out[(r, want)] = found
    return out


def _derive(graph: Graph, r: Ref, want: Placements, gathered: dict, mesh: Mesh,
            strategies: Callable) -> Optional[Derived]:
    """How ``r`` at ``want`` comes from a forward-gathered block of itself or of a value it is a
    view of (nearest first), or None. ``strategies(node)``: the node's ``node_strategies``."""
    chain: list[str] = []  # view ops from the ancestor (exclusive) down to r (inclusive)
    at = r
    while True:
        for placed in gathered.get(at, ()):
            cur, replay = placed, []
            for name in reversed(chain):
                node = graph.node(name)
                fits = [s for s in strategies(node) if tuple(input_placement(s, 0)) == tuple(cur)]
                if not fits:
                    break
                replay.append((name, fits[0]))
                cur = tuple(output_placement(fits[0], 0))
            else:
                if cur == want or not _moves(graph.spec(r).shape, cur, want, mesh):
                    return Derived(at, placed, tuple(replay))
        node = graph.node(at.node)
        if node.is_placeholder or len(node.inputs) != 1 or at.index != 0:
            return None
        chain.append(at.node)
        at = node.inputs[0]


def kept_sources(derived: Mapping) -> list[tuple[Ref, Placements]]:
    """The forward blocks the program keeps for ``derived``'s reads (each once, in a stable order)."""
    return sorted({(d.source, d.placed) for d in derived.values()}, key=lambda k: (k[0].node, k[0].index, str(k[1])))


# -- pricing -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupKept:
    """What keeping costs and saves for one folded group, at the chosen placements, per instance:
    the bytes held from forward to backward, and the problem's backward gather edges it drops
    (``edges``: edge indices), whose seconds (``seconds``: their transfers' at the chosen placements,
    each target once) ``evaluate`` no longer counts."""

    paths: tuple[str, ...]
    bytes: float
    edges: tuple[int, ...]
    seconds: float
    holder: int  # a problem node of the group whose memory row carries the kept bytes


def group_kept(graph: Graph, folding: Folding, problem: Problem, choice: Sequence[int], mesh: Mesh,
               precision: Precision, recomputed: frozenset = frozenset()) -> list[GroupKept]:
    """Per folded group (``fold`` order): what keeping its instances' gathers would cost and save,
    from instance 0 (every instance is alike)."""
    policy = cast_policy(graph, precision)

    def strategy_of(name: str) -> Strategy:
        i = problem.index[folding.representative(name)]
        return problem.nodes[i].strategies[choice[i]]

    out = []
    for group in folding.groups:
        paths = tuple(f"{group.prefix}.{i}" if group.prefix else str(i) for i in group.indices)
        derived = kept_reads(graph, strategy_of, [paths[0]], mesh, recomputed)
        nbytes, holder = 0.0, -1
        for ref, placed in kept_sources(derived):
            eb = transfer_bytes(graph, ref, "gather", precision, policy)
            nbytes += local_numel(graph.spec(ref).shape, placed, mesh) * eb
            holder = problem.index[folding.representative(ref.node)]
        dropped, paid = [], {}
        wanted = {(folding.representative(r.node), r.index, want) for r, want in derived}
        for k, e in enumerate(problem.edges):
            if e.kind != "param" or graph.node(problem.nodes[e.dst].name).phase != Phase.BACKWARD:
                continue
            col = e.dst_place[choice[e.dst]]
            if (problem.nodes[e.src].name, e.src_out, tuple(e.places_in[col])) in wanted:
                dropped.append(k)
                c = e.cost[e.src_place[choice[e.src]]][col] * e.mult / len(paths)
                paid[(e.share, col)] = max(paid.get((e.share, col), 0.0), c)
        out.append(GroupKept(paths, nbytes, tuple(dropped), sum(paid.values()), holder))
    return out


def with_kept(problem: Problem, terms: Sequence[GroupKept], counts: Sequence[int], choice: Sequence[int]) -> Problem:
    """``problem`` priced at ``choice`` with ``counts[g]`` instances of each group keeping their
    gathers: the dropped edges' chosen cost scaled by the instances that still gather, the kept
    bytes added to the group's memory. Exact at ``choice`` only (other cells keep their prices)."""
    if not any(counts):
        return problem
    nodes, edges = list(problem.nodes), list(problem.edges)
    for t, k in zip(terms, counts):
        if not k or t.holder < 0:
            continue
        c = len(t.paths)
        for j in t.edges:
            e = edges[j]
            row, col = e.src_place[choice[e.src]], e.dst_place[choice[e.dst]]
            cost = [list(x) for x in e.cost]
            cost[row][col] *= (c - k) / c
            edges[j] = replace(e, cost=cost, targets=None)
        pn = nodes[t.holder]
        act = list(pn.memory["activations"])
        act[choice[t.holder]] += t.bytes * k / pn.mult
        nodes[t.holder] = replace(pn, memory={**pn.memory, "activations": act})
    return Problem(nodes, edges, problem.groups, problem.memory_budget, problem.overlap_slowdown)


def choose(problem: Problem, terms: Sequence[GroupKept], choice: Sequence[int]) -> list[int]:
    """Per group, how many instances keep (all or none): those whose keeping makes the step faster,
    best seconds per byte first, while the peak fits the budget."""
    counts = [0] * len(terms)
    base = evaluate(problem, choice)
    gains = []
    for g, t in enumerate(terms):
        if not t.edges or t.holder < 0:
            continue
        trial = [0] * len(terms)
        trial[g] = len(t.paths)
        saved = base.step_time - evaluate(with_kept(problem, terms, trial, choice), choice).step_time
        if saved > 0:
            gains.append((-saved / max(t.bytes * len(t.paths), 1.0), g))
    for _, g in sorted(gains):
        trial = list(counts)
        trial[g] = len(terms[g].paths)
        cost = evaluate(with_kept(problem, terms, trial, choice), choice)
        if cost.peak_memory <= problem.memory_budget and cost.step_time < evaluate(
                with_kept(problem, terms, counts, choice), choice).step_time:
            counts = trial
    return counts


def kept_figures(terms: Sequence[GroupKept], kept: Sequence[Sequence[str]], problem: Problem,
                 choice: Sequence[int], figures: list[dict]) -> list[dict]:
    """``Plan.layer_groups`` (``figures``, from ``checkpoint.group_figures``) with each group's kept
    gathers: whether any instance keeps (``kept_gathers``), how many (``kept``), the bytes one kept
    instance holds from forward to backward (``kept_bytes``) and the seconds of backward gathers it
    does not run (``kept_time``), at the chosen placements."""
    out = []
    for g, row in enumerate(figures):
        t = terms[g] if g < len(terms) else None
        paths = kept[g] if g < len(kept) else []
        out.append({**row, "kept_gathers": bool(paths), "kept": len(paths),
                    "kept_bytes": int(t.bytes) if t else 0, "kept_time": t.seconds if t else 0.0})
    return out


# -- pins ---------------------------------------------------------------------------------------------

def check_kept_gathers(pin: Pin, where: str = "kept_gathers") -> None:
    """An ``ArgumentError`` naming ``where`` unless ``pin`` is None, ``"none"``, ``"all"``, a list of
    module-path globs or a dict from globs to booleans."""
    if pin is None:
        return
    if isinstance(pin, str):
        if pin not in PINS:
            raise ArgumentError(f"{where}={pin!r}: expected 'none', 'all', a list of module-path globs (e.g. "
                                f"['layers.*']) or a dict from globs to True/False")
        return
    if isinstance(pin, Mapping):
        for glob, on in pin.items():
            if not isinstance(glob, str) or not isinstance(on, bool):
                raise ArgumentError(f"{where}[{glob!r}] = {on!r}: a module-path glob maps to True or False")
        return
    if isinstance(pin, (list, tuple)) and all(isinstance(g, str) for g in pin):
        return
    raise ArgumentError(f"{where} must be 'none', 'all', a list of module-path globs or a dict from globs to "
                        f"True/False, got {type(pin).__name__}")


def pinned_kept_gathers(pin: Pin, paths: Sequence[Sequence[str]], where: str = "kept_gathers") -> Optional[list[list[str]]]:
    """Per group (``paths``: each group's instance paths), the instances a pin keeps; None: the
    search chooses. Globs are matched against instance paths; the last matching entry of a dict
    wins."""
    if pin is None:
        return None
    check_kept_gathers(pin, where)
    if isinstance(pin, str):
        if pin == "all" and not paths:
            raise ArgumentError(f"{where}='all': the model has no repeated layers whose gathers could be kept "
                                f"(autopar keeps the gathers of numbered layer instances, such as layers.0)")
        return [list(p) if pin == "all" else [] for p in paths]
    rules = list(pin.items()) if isinstance(pin, Mapping) else [(g, True) for g in pin]
    used, out = set(), []
    for group in paths:
        keep = []
        for p in group:
            on = False
            for glob, value in rules:
                if fnmatch.fnmatchcase(p, glob):
                    on = value
                    used.add(glob)
            if on:
                keep.append(p)
        out.append(keep)
    unused = [g for g, _ in rules if g not in used]
    if unused:
        known = ", ".join(p for group in paths for p in group[:2]) or "none: no repeated layers were found"
        raise ArgumentError(f"{where}: {', '.join(map(repr, unused))} match no layer instance (instances: {known} ...)")
    return out


__all__ = ["Derived", "GroupKept", "PINS", "check_kept_gathers", "choose", "group_kept", "instance_path", "kept_reads",
           "kept_figures", "kept_sources", "pinned_kept_gathers", "with_kept"]
