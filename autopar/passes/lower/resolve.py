"""Resolve: match every node of a captured graph with the strategy a plan chose for it.

The lookup is by the strategy's text and tags among what the rules offer, so a plan made for another
graph or another rule set is a loud ``LoweringError``, never a silently different program. The
result (``Resolved``) is the rank-independent half of lowering; ``lower`` writes each rank's program
from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from autopar.cost_model.casting import CastPolicy, cast_policy
from autopar.cost_model.mesh import Mesh
from autopar.cost_model.precision import Precision
from autopar.errors import LoweringError
from autopar.ir.fingerprint import graph_fingerprint, graph_info
from autopar.ir.graph import Graph, Node, Role
from autopar.ir.placement import B, format_placements
from autopar.ir.recompute import recomputed_ops
from autopar.ir.rules import op_call
from autopar.ir.rules.base import OpCall
from autopar.ir.rules.dimmap import Signature, Strategy
from autopar.ir.rules.random_ops import RANDOM_BASES, unsupported_random
from autopar.ir.stages import param_stages
from autopar.passes.search.kept import instance_path, kept_reads
from autopar.passes.search.strategies import node_strategies, output_placement

#: Ops whose values depend on a random stream (names without overload); ``ir.rules.random_ops``
#: draws the supported ones placement-independently, capture refuses the others.
RANDOM_OPS = tuple(sorted(RANDOM_BASES))

@dataclass
class Resolved:
    """The rank-independent part of lowering: every node's strategy and the plan's facts."""

    graph: Graph
    mesh: Mesh
    precision: Precision
    strategies: dict[str, Strategy]
    calls: dict[str, OpCall]
    #: forward ops the backward runs again (``plan.checkpointing``'s instances, ``ir.recompute``)
    recomputed: frozenset[str] = frozenset()
    #: backward reads of parameters that the forward's kept gathered blocks serve (``plan.kept_gathers``,
    #: ``passes.search.kept``): (value, placement) -> how it is derived; never gathered again
    kept: dict = field(default_factory=dict)
    #: a pipelined plan's: parameter FQN -> the stages that read it (``ir.stages.param_stages``), so that
    #: gradient buckets stay within a stage (``cost_model.buckets.grad_buckets``); None otherwise
    grad_stages: Optional[dict] = None
    _casts: dict = field(default_factory=dict, repr=False)

    def cast(self, precision: str) -> Optional[CastPolicy]:
        """The casts of a program run at ``precision`` (``cost_model.casting``; None: captured dtypes)."""
        if precision not in self._casts:
            self._casts[precision] = cast_policy(self.graph, precision)
        return self._casts[precision]


def resolve(graph: Graph, plan) -> Resolved:
    """Every node's chosen strategy, looked up in the rules by the plan's text; checks the plan
    was made for this graph first."""
    fingerprint = graph_fingerprint(graph)
    if plan.fingerprint.get("graph") not in (fingerprint, None) and plan.fingerprint.get("graph") == (
            legacy := graph_fingerprint(graph, legacy=True)):
        fingerprint = legacy  # a plan of schema version 1-7: attention under its captured CPU name
    plan.check_graph(fingerprint, graph_info(graph))
    mesh = Mesh.from_dict(plan.mesh)
    precision = Precision.from_dict(plan.precision)
    by_name = {n["name"]: n for n in plan.nodes}
    strategies: dict[str, Strategy] = {}
    calls: dict[str, OpCall] = {}
    for node in graph.nodes:
        if node.is_placeholder:
            strategies[node.name] = _placeholder_strategy(graph, node, plan, mesh)
            continue
        entry = by_name.get(node.name)
        if entry is None:
            raise LoweringError(f"the plan has no strategy for {graph.user_name(node)}: plan again for this model")
        want = (list(entry["strategy"]), list(entry["tags"]))
        offered = node_strategies(graph, node, mesh)
        found = [s for s in offered if ([str(x) for x in s], [x.tag for x in s]) == want] or [
            s for s in offered if (_legacy_text(node, s), [x.tag for x in s]) == want]
        if not found:
            raise LoweringError(
                f"the plan's strategy {' | '.join(want[0])} for {graph.user_name(node)} is not one autopar's rules "
                "allow (a plan from another autopar version?): plan again"
            )
        strategies[node.name] = found[0]
        calls[node.name] = op_call(graph, node)
        if unsupported_random([node.op]):  # capture refuses these; a graph built otherwise stops here
            raise LoweringError(
                f"{graph.user_name(node)} draws random numbers with {node.op}, which autopar cannot draw the same "
                "on every placement: set its probability to 0 (or call model.eval()) before compiling"
            )
    try:
        redo = recomputed_ops(graph, plan.checkpointing)
    except ValueError as e:
        raise LoweringError(f"{e}: plan again for this model") from None
    kept = list(getattr(plan, "kept_gathers", []) or [])
    if kept:
        known = {instance_path(graph, node) for node in graph.params.values()} - {None}
        unknown = [p for p in kept if p not in known]
        if unknown:
            raise LoweringError(f"the plan keeps the gathered parameters of {unknown[0]!r}, which is no layer instance "
                                f"of this model (instances: {', '.join(sorted(known)[:4]) or 'none'} ...): plan again")
    derived: dict = kept_reads(graph, strategies.__getitem__, kept, mesh, redo) if kept else {}
    pipeline = getattr(plan, "pipeline", None)
    # a pipelined plan's buckets stay within a stage (schema version 7; an older one's as it lists them)
    stages = param_stages(graph, pipeline.stages) if pipeline is not None and pipeline.stage_buckets else None
    return Resolved(graph, mesh, precision, strategies, calls, redo, derived, stages)


def _legacy_text(node: Node, strategy: Strategy) -> Optional[list[str]]:
    """A strategy's text in the other form plans of schema version 9 may record, where there is one: an
    unweighted ``nll_loss_backward`` with a fifth input, a ``B`` after its target, names the same choice."""
    if node.op != "aten.nll_loss_backward.default" or len(node.inputs) != 4:
        return None
    return [str(Signature(sig.inputs[:3] + (B,) + sig.inputs[3:], sig.outputs, sig.tag)) for sig in strategy]


def _placeholder_strategy(graph: Graph, node: Node, plan, mesh: Mesh) -> Strategy:
    key = placeholder_key(graph, node)
    if key is None:  # the tangent: every device holds the seed
        return node_strategies(graph, node, mesh)[0]
    text = plan.placements.get(key[1])
    if text is None:
        raise LoweringError(f"the plan does not place {key[0]} {key[1]!r}: plan again for this model")
    for s in node_strategies(graph, node, mesh):
        if format_placements(output_placement(s, 0)) == text:
            return s
    raise LoweringError(f"the plan places {key[0]} {key[1]!r} as {text!r}, which does not fit its shape {node.out}")


def placeholder_key(graph: Graph, node: Node) -> Optional[tuple[str, str]]:
    """``("param" | "buffer" | "input", key)`` naming a placeholder as the plan does; None for the tangent."""
    role = node.roles[0]
    if role == Role.TANGENT:
        return None
    table = {Role.PARAMETER: ("param", graph.params), Role.BUFFER: ("buffer", graph.buffers),
             Role.INPUT: ("input", graph.inputs)}
    kind, names = table[role]
    return kind, next(k for k, v in names.items() if v == node.name)


__all__ = ["RANDOM_OPS", "Resolved", "resolve"]
