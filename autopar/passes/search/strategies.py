"""Strategies: the candidate SBP strategies of every node on a mesh, with the user's hints applied.

Op nodes take their rule's composed strategies; graph inputs (parameters, buffers, user inputs)
may take any placement that splits only dims at least as large as the pieces. A strategy whose
split would leave a device with an empty block is dropped: it never pays, and lowering it would
only waste a device. Hints (``autopar.hint`` in the graph, and the ``hints=`` argument) keep only
the strategies that produce the hinted placement.

An axis of size 1 (the one-device ``dp`` under a pipeline alone, or ``Mesh({"dp": 1, "tp": 2})``)
carries no communication: the search takes only strategies that replicate every tensor on it
(``search_strategies``), and hints and recipes there read as ``B`` (``unit_replicated``), so a plan
lists no collective on such an axis. ``node_strategies`` keeps every strategy, so that a plan made
before this rule still lowers.
"""

from __future__ import annotations

import fnmatch
import functools
import itertools
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import autopar.cost_model.balanced  # noqa: F401  (prices the reshardings of the balanced split Z it offers)
from autopar.cost_model.mesh import Mesh
from autopar.errors import HintError
from autopar.ir.graph import Graph, Node, Ref, Role, TensorSpec
from autopar.ir.attention import ATTN_FWD
from autopar.ir.placement import (B, Balanced, Placement, PlacementError, Placements, Split, balanced_fits, blocks_fit,
                                  format_placements, parse)
from autopar.ir.rules import op_call
from autopar.ir.rules import strategies as rule_strategies
from autopar.ir.rules.dimmap import Signature, Strategy
from autopar.ir.rules.ring import (RING_BALANCED, asks_balanced, balanced_lengths, balanced_offered, edge_balanced,
                                   offer_balanced, ring_axis)


def fits(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    """Every split dim is at least as large as the number of pieces it is cut into."""
    pieces: dict[int, int] = {}
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Split):
            if p.dim >= len(shape):
                return False
            pieces[p.dim] = pieces.get(p.dim, 1) * n
    return all(shape[d] >= k for d, k in pieces.items())


def input_placements(spec: TensorSpec, mesh_shape: Sequence[int], balanced: Sequence[int] = ()) -> list[Placements]:
    """Every placement a graph input may take: per axis B or a split of a dim that is large enough
    (and the balanced split ``Z`` of a dim as long as one of ``balanced``)."""
    per_axis = [[B] + [Split(d) for d in range(spec.ndim) if spec.shape[d] >= n]
                + [Balanced(d) for d in range(spec.ndim) if spec.shape[d] in balanced and spec.block_count(d) == 1]
                for n in mesh_shape]
    return [p for p in itertools.product(*per_axis) if fits(spec.shape, p, mesh_shape)
            and blocks_fit(spec.shape, p, mesh_shape, spec.blocks) and balanced_fits(spec.shape, p, mesh_shape)]


def graph_balanced_lengths(graph: Graph) -> tuple[int, ...]:
    """The sequence lengths on which the graph's ops offer the balanced split (``ring.balanced_lengths``),
    computed once per graph."""
    memo = _LENGTHS.get(graph)
    if memo is None or memo[0] != len(graph.nodes):
        memo = (len(graph.nodes), balanced_lengths(op_call(graph, n) for n in graph.nodes if n.op == ATTN_FWD))
        _LENGTHS[graph] = memo
    return memo[1]


_LENGTHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def balanced_search(passes: Callable[..., Any]) -> Callable[..., Any]:
    """The planning passes (``planner.intra.run_passes``) weighing the balanced split ``Z`` of a
    causal sequence around the attention where the options ask for it (a hint placing something
    ``Z``, ``attention=`` naming ``ring:balanced``), and otherwise in a second search only when the
    first runs some attention as balanced ring (on contiguous blocks, permuting at the op's edges,
    ``ir.rules.ring.edge_balanced``): the faster plan that fits wins, and either runs as planned.
    The first search weighs no ``Z`` anywhere, so plans whose attention runs another form search
    once, with the strategies they always had, and their plans and planning times stay as they were."""

    @functools.wraps(passes)
    def run(model, mesh: Mesh, example_inputs=(), example_kwargs=None, options=None):
        hints, attention = (options.hints, options.attention) if options is not None else (None, None)
        asked = asks_balanced(hints, attention)
        with offer_balanced(asked):
            first = passes(model, mesh, example_inputs, example_kwargs, options)
        if asked or options is None or options.recipe or not runs_balanced(first):
            return first
        with offer_balanced(True):
            second = passes(model, mesh, example_inputs, example_kwargs, replace(options, graph=first.graph))
        fits = second.peak is None or second.peak.peak <= options.budget(mesh)
        return second if fits and second.cost.step_time < first.cost.step_time else first

    return run


def runs_balanced(planned: Any) -> bool:
    """Whether a planned problem's choice runs some attention as balanced ring."""
    return any((ring_axis(n.strategies[c]) or (0, ""))[1] == RING_BALANCED
               for n, c in zip(planned.problem.nodes, planned.choice))


def _as_strategy(placements: Placements) -> Strategy:
    return tuple(Signature((), (p,), str(p)) for p in placements)


def _strategy_fits(graph: Graph, node: Node, strat: Strategy, mesh_shape: Sequence[int]) -> bool:
    for i, r in enumerate(node.inputs):
        if not fits(graph.spec(r).shape, [s.inputs[i] for s in strat], mesh_shape):
            return False
    for j, spec in enumerate(node.outputs):
        if spec is not None and not fits(spec.shape, [s.outputs[j] for s in strat], mesh_shape):
            return False
    return True


def node_strategies(graph: Graph, node: Node, mesh: Mesh, balanced: bool = True) -> list[Strategy]:
    """The candidate strategies of one node (placeholders: one output placement each); ``balanced``:
    with the balanced split ``Z`` on the dims of a causal ring sequence's length (the balanced ring
    attention's own ``Z`` either way)."""
    lengths = graph_balanced_lengths(graph) if balanced else ()
    if node.is_placeholder:
        if node.roles[0] == Role.TANGENT or node.outputs[0] is None:
            return [_as_strategy(tuple(B for _ in mesh.shape))]
        lengths = lengths if node.roles[0] != Role.PARAMETER else ()
        return [_as_strategy(p) for p in input_placements(node.outputs[0], mesh.shape, lengths)]
    strats = rule_strategies(op_call(graph, node), mesh.shape, balanced=lengths)
    kept = [s for s in strats if _strategy_fits(graph, node, s, mesh.shape)]
    return kept or [s for s in strats if all(sig.tag == "B" for sig in s)]


def _replicated_on(strat: Strategy, axes: Sequence[int]) -> bool:
    return all(p is None or p == B for a in axes for p in strat[a].inputs + strat[a].outputs)


def search_strategies(graph: Graph, node: Node, mesh: Mesh) -> list[Strategy]:
    """The strategies the search weighs: ``node_strategies`` (the balanced split ``Z`` only where it
    is offered, ``ir.rules.ring.offer_balanced``; elsewhere the balanced ring attention runs on
    contiguous blocks, ``ir.rules.ring.edge_balanced``, and no strategy lays anything out ``Z``) less
    those that split or leave partial any tensor on an axis of size 1 (a split there is the whole
    tensor, and a collective over one device moves nothing, so such choices only list pointless
    collectives in the plan). Every strategy, as before, where a node has none replicated on those axes."""
    offered = balanced_offered()
    strats = [s for s in node_strategies(graph, node, mesh, balanced=offered)
              if (not edge_balanced(s) if offered else not _lays_balanced(s))]
    unit = [a for a, n in enumerate(mesh.shape) if n == 1]
    if not unit:
        return strats
    kept = [s for s in strats if _replicated_on(s, unit)]
    return kept or strats


def _lays_balanced(strat: Strategy) -> bool:
    """Whether some tensor of ``strat`` is laid out balanced (``Z``) on some axis."""
    return any(isinstance(p, Balanced) for sig in strat for p in (*sig.inputs, *sig.outputs))


def unit_replicated(placements: Placements, mesh_shape: Sequence[int]) -> Placements:
    """``placements`` with ``B`` on every axis of size 1 (where a split or a partial sum is the whole
    tensor: the same data, named as the search names it)."""
    return tuple(B if n == 1 else p for p, n in zip(placements, mesh_shape))


def output_placement(strat: Strategy, index: int) -> Placements:
    """Output ``index``'s placement on every mesh axis under strategy ``strat``."""
    return tuple(s.outputs[index] for s in strat)  # type: ignore[misc]


def input_placement(strat: Strategy, index: int) -> Placements:
    """The placement on every mesh axis in which strategy ``strat`` reads input ``index``."""
    return tuple(s.inputs[index] for s in strat)


# ---------------------------------------------------------------------------------------------
# Hints


@dataclass(frozen=True)
class Constraint:
    """Output ``ref`` must have ``placements``; ``source`` says where the hint came from."""

    ref: Ref
    placements: Placements
    source: str


def resolve_hints(graph: Graph, mesh: Mesh, hints: Optional[dict[str, object]]) -> list[Constraint]:
    """The hard constraints of the graph's ``autopar.hint`` annotations and the ``hints=`` argument.

    Keys of ``hints``: a parameter or buffer FQN, with ``*`` wildcards (``"layers.*.wq.weight"``),
    ``"input:0"``, or a keyword input's name. Values: placement strings or DTensor placements.
    """
    out: list[Constraint] = []
    for h in graph.hints:
        out.append(Constraint(h.ref, _parse(h.placements, mesh, f"autopar.hint in {h.module_path or '<root>'}"), "hint"))
    names = dict(graph.params)
    names.update(graph.buffers)
    for alias, canon in getattr(graph, "aliases", {}).items():
        if canon in names:
            names[alias] = names[canon]
    for key, value in (hints or {}).items():
        where = f"hints[{key!r}]"
        pl = _parse(value, mesh, where)
        if key in graph.inputs:
            targets = [graph.inputs[key]]
        elif key.startswith("input:") or key in graph.constants:
            raise HintError(
                f"{where}: {key!r} is not a tensor input of the model; tensor inputs are {sorted(graph.inputs)}"
            )
        else:
            targets = sorted({names[f] for f in names if fnmatch.fnmatchcase(f, key)})
            if not targets:
                close = sorted(names)[:8]
                raise HintError(
                    f"{where}: no parameter, buffer or input matches {key!r}. Parameters look like {close}; "
                    f"inputs are {sorted(graph.inputs)}"
                )
        for t in targets:
            out.append(Constraint(Ref(t), pl, where))
    out = [_count_from_end(graph, c) for c in out]
    _check(graph, mesh, out)
    return [Constraint(c.ref, unit_replicated(c.placements, mesh.shape), c.source) for c in out]


def _count_from_end(graph: Graph, c: Constraint) -> Constraint:
    """``S(-1)`` splits the last dim, as ``torch.Tensor.size(-1)`` counts: negative dims counted
    from the end of the hinted tensor's shape."""
    if not any(isinstance(p, Split) and p.dim < 0 for p in c.placements):
        return c
    spec = graph.spec(c.ref)
    placements = []
    for p in c.placements:
        if isinstance(p, Split) and p.dim < 0:
            if p.dim < -spec.ndim:
                raise HintError(f"{c.source}: {format_placements(c.placements)} splits dim {p.dim}, but "
                                f"{graph.user_name(c.ref)} has only {spec.ndim} dims (shape {list(spec.shape)})")
            p = Split(p.dim + spec.ndim)
        placements.append(p)
    return Constraint(c.ref, tuple(placements), c.source)


def _parse(value: object, mesh: Mesh, where: str) -> Placements:
    try:
        return parse(value, axis_names=mesh.names, ndim=mesh.ndim)  # type: ignore[arg-type]
    except PlacementError as e:
        raise HintError(f"{where}: {e}") from None
    except TypeError:  # not a string, not a sequence
        raise HintError(f"{where}: {value!r} is not a placement; give a string such as 'dp=S(0)' or 'S(0), B'"
                        ) from None


def _check(graph: Graph, mesh: Mesh, constraints: list[Constraint]) -> None:
    seen: dict[Ref, Constraint] = {}
    for c in constraints:
        spec = graph.spec(c.ref)
        for p, n, name in zip(c.placements, mesh.shape, mesh.names):
            if isinstance(p, Split) and p.dim >= spec.ndim:
                raise HintError(f"{c.source}: {format_placements(c.placements)} splits dim {p.dim}, "
                                f"but {graph.user_name(c.ref)} has shape {list(spec.shape)}")
        if not fits(spec.shape, c.placements, mesh.shape):
            raise HintError(
                f"{c.source}: {format_placements(c.placements)} cannot split {graph.user_name(c.ref)} of shape "
                f"{list(spec.shape)} "
                f"over mesh {dict(zip(mesh.names, mesh.shape))}: a split dim is smaller than the number of devices "
                "it is cut over"
            )
        prev = seen.get(c.ref)
        if prev is not None and prev.placements != c.placements:
            raise HintError(
                f"contradictory hints for {graph.user_name(c.ref)}: {format_placements(prev.placements)} "
                f"({prev.source}) and "
                f"{format_placements(c.placements)} ({c.source})"
            )
        seen[c.ref] = c
