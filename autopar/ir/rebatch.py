"""One capture for every batch size: a graph captured at a probe batch, re-shaped to another batch.

The pipeline search plans the model at several micro-batch sizes, the factorization search at the
whole batch and at those; capturing each size costs a full trace of the model. Instead the model is
captured once with its batch dimension at ``P`` rows, ``P`` a prime far larger than any other
dimension (``probe_rows``), and ``rebatch`` re-shapes that graph to ``rows``: every integer of the
graph (a tensor's dimension, an op's argument: a ``view`` shape, an ``expand`` size, an ``arange``
end, a mean's divisor) that is a multiple ``k * P`` becomes ``k * rows``, and a float that is such
a multiple, or one over it (a mean loss's ``1 / numel``), is scaled alike.

Why that is exact: a value that does not depend on the batch is made of the model's other sizes,
whose prime factors are all below ``P``, so it is never a multiple of ``P``; a value the model
computes linearly from the batch (``B``, ``B * S``, ``B * S * D``) is one, with the same cofactor at
every batch. What is not linear is refused, and the caller captures that batch afresh: an integer
that is no multiple of ``P`` but at least ``P / SPREAD`` (above every size of the model: ``B // 2``,
``B * S - 1``, an MoE capacity ``ceil(1.3 * B * S * k / E)``), an integral float at least ``P``
that is no multiple, and a target of one row (torch treats size-1 dimensions apart: broadcasting,
contiguity). Not seen: a batch-derived integer below ``P / SPREAD`` (``min(B, 4)``, ``B // 128``),
a float from the batch that is neither a multiple nor one over it, and a sum of the model's sizes
that happens to be a multiple of ``P`` (one chance in ``P``, ``P`` above a million). The tests compare
re-shaped graphs with fresh captures (``graph_fingerprint``) on built-in, torchtitan-style and
Hugging Face models.

The re-shaped ``Graph`` is for planning: its nodes keep the probe's fx nodes (planning reads only
their batch-free metadata) and it has no ``gm``, so nothing lowers it by mistake (lowering captures
the model itself).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterable, Optional

from autopar.ir.graph import Graph, Node, TensorSpec

#: how far below the probe a non-multiple integer is still taken as batch-derived (``B // 64``)
SPREAD = 64
#: the smallest probe: well clear of every small constant of a model (head counts, kernel sizes, ...)
MIN_PROBE = 1 << 20
#: the integers ops use as "to the end" / "no limit" (a slice's end): never batch-derived
SENTINELS = frozenset({2 ** 63 - 1, -(2 ** 63), 2 ** 31 - 1, -(2 ** 31), 2 ** 32, 2 ** 64})


class Unproven(Exception):
    """A value of the graph the re-shape cannot prove linear in the batch (the message says which)."""


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % p for p in range(3, math.isqrt(n) + 1, 2))


def probe_rows(sizes: Iterable[int]) -> int:
    """The probe batch for a model whose other sizes (parameters' and inputs' dimensions, integer
    inputs) are ``sizes``: the first prime at least ``SPREAD`` times one more than the largest, and
    at least ``MIN_PROBE``."""
    n = max([MIN_PROBE] + [SPREAD * (abs(int(s)) + 1) for s in sizes])  # (so ``n // SPREAD`` exceeds every size)
    while not _is_prime(n):
        n += 1
    return n


class _Scale:
    """Integers and floats of the probe's graph mapped to the target batch's (see the module docstring)."""

    def __init__(self, probe: int, rows: int):
        self.probe, self.rows, self.floor = probe, rows, probe // SPREAD

    def int(self, v: int, where: str) -> int:
        if v % self.probe == 0:
            return v // self.probe * self.rows
        if abs(v) >= self.floor and v not in SENTINELS:
            raise Unproven(f"{where} holds {v}, which is no multiple of the probe batch {self.probe}: a size "
                           f"computed from the batch other than by multiplying it")
        return v

    def float(self, v: float, where: str) -> float:
        if not math.isfinite(v) or v == 0:
            return v
        if v.is_integer():
            if int(v) % self.probe == 0:
                return float(int(v) // self.probe * self.rows)
            if abs(v) >= self.probe and abs(v) < 1e30:
                raise Unproven(f"{where} holds {v}, no multiple of the probe batch {self.probe}")
            return v
        n = round(1 / v)
        if n != 0 and n % self.probe == 0 and 1 / n == v:  # a mean's 1 / numel
            return 1 / (n // self.probe * self.rows)
        return v

    def value(self, v, where: str):
        if isinstance(v, bool) or v is None:
            return v
        if isinstance(v, int):
            return self.int(v, where)
        if isinstance(v, float):
            return self.float(v, where)
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return tuple(self.value(x, where) for x in v)
        if isinstance(v, list):
            return [self.value(x, where) for x in v]
        if isinstance(v, dict):
            return {k: self.value(x, where) for k, x in v.items()}
        return v  # Refs, dtypes, devices, layouts, strings: no sizes

    def spec(self, s: Optional[TensorSpec], where: str) -> Optional[TensorSpec]:
        if s is None:
            return None
        return replace(s, shape=tuple(self.int(d, where) for d in s.shape))


def rebatch(graph: Graph, probe: int, rows: int) -> Graph:
    """``graph`` (captured with ``probe`` rows, ``probe_rows``) as captured with ``rows`` rows: every
    batch-derived size and argument re-scaled (see the module docstring). Raises ``Unproven`` naming
    the value it cannot prove linear in the batch; ``graph`` is left as it was."""
    if rows < 2:
        raise Unproven(f"a batch of {rows} row(s): size-1 dimensions broadcast and lay out apart, so that graph is "
                       "captured as it is")
    sc = _Scale(probe, rows)
    nodes = []
    for n in graph.nodes:
        where = n.where()
        nodes.append(Node(name=n.name, op=n.op, target=n.target, args=sc.value(n.args, where),
                          kwargs=sc.value(n.kwargs, where), inputs=list(n.inputs),
                          outputs=[sc.spec(s, where) for s in n.outputs], roles=list(n.roles), phase=n.phase,
                          module_path=n.module_path, fx_node=n.fx_node))
    return with_nodes(graph, nodes, gm=None)


def with_nodes(graph: Graph, nodes: list[Node], **changes) -> Graph:
    """``graph`` with ``nodes`` and its own copy of every table (``changes`` replace fields too)."""
    return replace(graph, nodes=nodes, params=dict(graph.params), buffers=dict(graph.buffers),
                   inputs=dict(graph.inputs), constants=dict(graph.constants), grads=dict(graph.grads),
                   outputs=list(graph.outputs), hints=list(graph.hints), aliases=dict(graph.aliases),
                   mutations=dict(graph.mutations), extras=list(graph.extras), _by_name={}, **changes)


__all__ = ["MIN_PROBE", "SENTINELS", "SPREAD", "Unproven", "probe_rows", "rebatch", "with_nodes"]
