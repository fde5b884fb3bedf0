"""Activation checkpointing in the search: what recomputing layer instances saves and costs.

For each folded layer group (``fold.LayerGroup``: ``c`` alike instances) the search chooses how
many instances recompute (``k``, always the first ``k``, as Megatron's "block" method does) and in
which mode (``"full"`` or ``"selective"``, ``ir.recompute``). The problem is priced for a choice
by rescaling its nodes (``with_checkpointing``), so every solver and ``evaluate`` price it as they
price any problem:

- time: each forward op that a checkpointed instance recomputes runs ``c + k`` times instead of
  ``c``, and so do the activation reshardings feeding it (the recomputation re-runs its
  collectives, from the values the instance keeps);
- memory at the true peak: with the first ``k`` instances recomputed, ``(c - k) * S + k * I + R``,
  where ``S`` is what one instance saves for the backward, ``I`` what a recomputed one keeps (its
  outputs that later instances read, and in selective mode the values the policy saves) and
  ``R`` the most of its re-run values alive at once in its backward (``p * S``, ``p`` from
  ``ir.recompute.recompute_peak_share``: the backward re-runs ops where it first needs them and
  frees their values after their last reader). The program holds every saved value until its
  backward ends, so the peak is in the backward of a recomputed instance.

The outer search (``candidates``) runs the solver once per candidate choice; docs/design/checkpointing.md
says why the count is searched outside the ILP.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Union

from autopar.cost_model.memory import activation_bytes
from autopar.cost_model.mesh import Mesh
from autopar.cost_model.precision import Precision
from autopar.errors import ArgumentError
from autopar.ir.graph import Graph, Phase
from autopar.ir.layers import layers
from autopar.ir.recompute import MODES, instance_plan, recompute_peak_share
from autopar.ir.views import storage_shares
from autopar.passes.search.fold import Folding
from autopar.passes.search.problem import Problem, transfer_cost
from autopar.passes.search.strategies import output_placement

#: what ``checkpointing=`` accepts besides a dict of module-path globs
PINS = ("none", "full", "selective")

Pin = Union[None, str, Mapping[str, str]]


@dataclass(frozen=True)
class GroupTerms:
    """One folded group's pricing terms, per representative problem node (by index): per strategy,
    the bytes a recomputed instance keeps (``kept[mode][i]``); and which nodes it recomputes."""

    prefix: str
    count: int
    paths: tuple[str, ...]  # the instances' module paths, in instance order
    kept: dict[str, dict[int, list[float]]]
    recomputed: dict[str, frozenset[int]]
    forward: frozenset[int]  # the group's forward nodes (problem indices)
    peak_share: dict[str, float]  # per mode: re-run values alive at once, as a share of S


@dataclass(frozen=True)
class Choice:
    """Per folded group (in ``fold`` order): its mode and how many instances (the first) recompute."""

    modes: tuple[str, ...]
    counts: tuple[int, ...]

    @property
    def any(self) -> bool:
        """Whether anything recomputes."""
        return any(self.counts)


def group_terms(graph: Graph, folding: Folding, problem: Problem, mesh: Mesh, precision: Precision) -> list[GroupTerms]:
    """The terms of every folded group, from instance 0 (the representative)."""
    membership = layers(graph)
    out = []
    for g, group in enumerate(folding.groups):
        names = group.instances[0]
        forward = frozenset(problem.index[n] for n in names
                            if n in problem.index and graph.node(n).phase == Phase.FORWARD
                            and not graph.node(n).is_placeholder)
        kept: dict[str, dict[int, list[float]]] = {}
        recomputed: dict[str, frozenset[int]] = {}
        share: dict[str, float] = {}
        for mode in MODES:
            share[mode] = recompute_peak_share(graph, membership, (group.prefix, group.indices[0]), mode)
            saved, redo = instance_plan(graph, membership, (group.prefix, group.indices[0]), mode)
            recomputed[mode] = frozenset(problem.index[n] for n in redo if n in problem.index)
            per: dict[int, list[float]] = {}
            shares = storage_shares(graph, saved)
            for ref in saved:
                i = problem.index.get(ref.node)
                if i is None:
                    continue
                spec = graph.spec(ref)
                pn = problem.nodes[i]
                row = per.setdefault(i, [0.0] * len(pn.strategies))
                for s, strat in enumerate(pn.strategies):
                    row[s] += shares[ref] * float(activation_bytes(spec.shape, spec.dtype,
                                                                   output_placement(strat, ref.index), mesh, precision))
            kept[mode] = per
        paths = tuple(f"{group.prefix}.{i}" if group.prefix else str(i) for i in group.indices)
        out.append(GroupTerms(group.prefix, group.count, paths, kept, recomputed, forward, share))
    return out


def with_checkpointing(problem: Problem, terms: list[GroupTerms], choice: Choice) -> Problem:
    """``problem`` priced with ``choice``'s recomputation (a new Problem; ``problem`` is unchanged)."""
    if not choice.any:
        return problem
    nodes = list(problem.nodes)
    time_scale: dict[int, float] = {}
    kept_scale: dict[int, float] = {}  # a recomputed op's resharded inputs are not kept (only the others')
    for t, mode, k in zip(terms, choice.modes, choice.counts):
        if not k:
            continue
        c = t.count
        s_coef = (c - k + t.peak_share[mode]) / c  # per instance, of what one instance saves
        i_coef = k / c
        for i in t.forward:
            pn = nodes[i]
            act = pn.memory["activations"]
            kept = t.kept[mode].get(i)
            new_act = [s_coef * a + (i_coef * kept[s] if kept else 0.0) for s, a in enumerate(act)]
            scale = (c + k) / c if i in t.recomputed[mode] else 1.0
            if scale != 1.0:
                time_scale[i] = scale
                kept_scale[i] = s_coef
            # (a re-run op's transient is held again in the layers' backward: ``PNode.head``)
            nodes[i] = replace(pn, memory={**pn.memory, "activations": new_act}, head=pn.head and scale == 1.0,
                               compute=[x * scale for x in pn.compute], comm=[x * scale for x in pn.comm])
    # a resharding feeding a recomputed op runs again with it (from the saved value: the lowering
    # never saves a resharded copy for a re-run op): the transfer's edges (one resharding per target
    # placement) take the consumer's scale together
    edges = list(problem.edges)
    for ks in problem.transfers:
        first = problem.edges[ks[0]]
        if first.kind != "activation":
            continue
        scale = max((time_scale.get(problem.edges[k].dst, 1.0) for k in ks), default=1.0)
        if scale != 1.0:
            for k in ks:
                e = problem.edges[k]
                saved = e.saved
                if saved is not None and e.dst in kept_scale:
                    saved = [[b * kept_scale[e.dst] for b in row] for row in saved]
                edges[k] = replace(e, cost=[[x * scale for x in row] for row in e.cost], targets=None, saved=saved)
    return Problem(nodes, edges, problem.groups, problem.memory_budget, problem.overlap_slowdown)


def check_checkpointing(pin: Pin, where: str = "checkpointing") -> None:
    """An ``ArgumentError`` naming ``where`` unless ``pin`` is None, one of ``PINS`` or a dict from
    module-path globs to one of ``PINS``."""
    if pin is None:
        return
    if isinstance(pin, str):
        if pin not in PINS:
            raise ArgumentError(f"{where}={pin!r}: expected one of {', '.join(map(repr, PINS))} or a dict from "
                                f"module-path globs to one of them")
        return
    if not isinstance(pin, Mapping):
        raise ArgumentError(f"{where} must be a string or a dict, got {type(pin).__name__}")
    for glob, mode in pin.items():
        if not isinstance(glob, str) or mode not in PINS:
            raise ArgumentError(f"{where}[{glob!r}] = {mode!r}: a module-path glob maps to 'none', 'full' or "
                                f"'selective'")


def pinned_checkpointing(pin: Pin, terms: list[GroupTerms], where: str = "checkpointing") -> Optional[Choice]:
    """The choice a ``checkpointing=`` pin fixes (None: the search chooses). A dict maps module-path
    globs to modes; each group's matched instances must be its first ones and share one mode."""
    if pin is None:
        return None
    check_checkpointing(pin, where)
    if isinstance(pin, str):
        if pin != "none" and not terms:
            raise ArgumentError(f"{where}={pin!r}: the model has no repeated layers to checkpoint (autopar "
                                f"recomputes alike instances of a numbered module, such as layers.0, layers.1, ...)")
        mode = "full" if pin == "none" else pin
        return Choice(tuple(mode for _ in terms), tuple(0 if pin == "none" else t.count for t in terms))
    modes, counts = [], []
    used = set()
    for t in terms:
        picked = []
        for i, path in enumerate(t.paths):
            mode = "none"
            for glob, m in pin.items():
                if fnmatch.fnmatchcase(path, glob):
                    mode = m
                    used.add(glob)
            picked.append(mode)
        on = [i for i, m in enumerate(picked) if m != "none"]
        if on != list(range(len(on))):
            raise ArgumentError(f"{where}: in {t.prefix!r} the recomputed instances must be the first ones "
                                f"({', '.join(t.paths[i] for i in on)} asked)")
        kinds = sorted({picked[i] for i in on})
        if len(kinds) > 1:
            raise ArgumentError(f"{where}: the instances of {t.prefix!r} take one mode ({' and '.join(kinds)} asked)")
        modes.append(kinds[0] if kinds else "full")
        counts.append(len(on))
    unused = [g for g in pin if g not in used]
    if unused:
        known = ", ".join(p for t in terms for p in t.paths[:2]) or "none: no repeated layers were found"
        raise ArgumentError(f"{where}: {', '.join(map(repr, unused))} match no layer instance (instances: {known} ...)")
    return Choice(tuple(modes), tuple(counts))


def levels(terms: list[GroupTerms], mode: str, level: int) -> Choice:
    """Every group at ``mode`` with ``level`` of the deepest group's count recomputing (scaled to each
    group's count, rounded up)."""
    top = max((t.count for t in terms), default=0)
    return Choice(tuple(mode for _ in terms),
                  tuple(0 if top == 0 else math.ceil(level * t.count / top) for t in terms))




def group_figures(problem: Problem, terms: list[GroupTerms], recompute: Choice, choice: list[int]) -> list[dict]:
    """Per folded group, at ``choice`` on the problem priced without recomputation: the bytes one
    instance saves, what a recomputed one keeps instead and the seconds its re-run adds (its
    recomputed ops and the activation reshardings feeding them), in its chosen mode (``"full"``
    when nothing recomputes)."""
    out = []
    for t, mode, k in zip(terms, recompute.modes, recompute.counts):
        redo = t.recomputed[mode]
        saved = sum(problem.nodes[i].memory["activations"][choice[i]] for i in t.forward)
        kept = sum(row[choice[i]] for i, row in t.kept[mode].items())
        seconds = sum(problem.nodes[i].compute[choice[i]] + problem.nodes[i].comm[choice[i]] for i in redo)
        for ks in problem.transfers:
            first = problem.edges[ks[0]]
            if first.kind == "activation" and any(problem.edges[j].dst in redo for j in ks):
                seconds += transfer_cost([problem.edges[j] for j in ks], choice) * first.mult / t.count
        out.append({"prefix": t.prefix, "count": t.count, "paths": list(t.paths), "checkpointed": k,
                    "mode": mode if k else "none", "saved_bytes": int(saved), "input_bytes": int(kept),
                    "recompute_time": seconds, "kept_gathers": False})
    return out


def checkpointed_paths(terms: list[GroupTerms], recompute: Choice) -> dict[str, str]:
    """``Plan.checkpointing``: each recomputed instance's module path -> its mode."""
    return {path: mode for t, mode, k in zip(terms, recompute.modes, recompute.counts) for path in t.paths[:k]}


__all__ = ["Choice", "GroupTerms", "MODES", "PINS", "check_checkpointing", "checkpointed_paths", "group_figures", "group_terms", "levels",
           "pinned_checkpointing", "with_checkpointing"]
