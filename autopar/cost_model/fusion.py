"""What a compiled program fuses: chains of pointwise ops, priced as one kernel each.

Under ``autopar.compile(..., compile=True)`` Inductor fuses a pointwise op into the pointwise ops
that read it (through views, which launch nothing), so its result never goes through memory: the
producer writes nothing and launches no kernel of its own, and the consumer reads nothing for that
input. A value is kept in registers only when every reader (looking through views) is a pointwise op
of the same phase: a value the backward saves, a graph output, or one a matmul, reduction or
collective reads is written as in eager mode. Reductions, matmuls and attention are priced as in
eager mode (Inductor fuses some pointwise work into their prologues and epilogues too, which this
leaves out, so compiled prices err slow), and so is communication: Inductor leaves waits where the
program puts them unless its comm-reordering passes are switched on.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.ir.graph import Graph, Node
from autopar.ir.rules.generic import FIRST_LINEAR_POINTWISE, NONLINEAR_POINTWISE

#: Pointwise aten ops Inductor fuses (random ops are not among them: autopar draws them in a module
#: of its own, which a compiled program calls between graphs).
POINTWISE = frozenset(NONLINEAR_POINTWISE + FIRST_LINEAR_POINTWISE + [
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.where.self",
    "aten.masked_fill.Scalar", "aten.masked_fill.Tensor",
]) - {"autopar.hint.default"}


@dataclass(frozen=True)
class Fused:
    """How a pointwise op runs inside a fused kernel: which inputs it reads from registers (their
    producer fused into it), and whether its own result stays in registers (it is fused forward)."""

    inputs: tuple[bool, ...]
    output: bool


def _transparent(n: Node) -> bool:
    from autopar.cost_model.compute import is_free

    return n.is_placeholder is False and is_free(n.op) and n.op not in ("output", "get_attr")


def fused_ops(graph: Graph) -> dict[str, Fused]:
    """Every pointwise op of ``graph`` that a compiled program fuses with a neighbour, by node name."""
    users = graph.users()
    kept = {r.node for r in graph.outputs if r is not None}
    kept |= {r.node for r in graph.grads.values()} | {r.node for r in graph.mutations.values()}
    if graph.loss is not None:
        kept.add(graph.loss.node)

    def readers(name: str, seen: set) -> list[Node]:
        """The nodes that compute with ``name``'s value, looking through views of it."""
        out = []
        for u in users.get(name, []):
            if u in seen:
                continue
            seen.add(u)
            node = graph.node(u)
            if _transparent(node) and node.name not in kept:
                out += readers(u, seen)
            else:
                out.append(node)
        return out

    in_registers: set[str] = set()
    for n in graph.ops():
        if n.op not in POINTWISE or n.name in kept or len(n.outputs) != 1:
            continue
        rs = readers(n.name, set())
        if rs and all(r.op in POINTWISE and r.phase == n.phase for r in rs):
            in_registers.add(n.name)

    def source(name: str) -> str:
        """The computing node behind a chain of views."""
        node = graph.node(name)
        while _transparent(node) and node.inputs:
            node = graph.node(node.inputs[0].node)
        return node.name

    out: dict[str, Fused] = {}
    for n in graph.ops():
        if n.op not in POINTWISE:
            continue
        ins = tuple(source(r.node) in in_registers for r in n.inputs)
        if any(ins) or n.name in in_registers:
            out[n.name] = Fused(ins, n.name in in_registers)
    return out


__all__ = ["POINTWISE", "Fused", "fused_ops"]
