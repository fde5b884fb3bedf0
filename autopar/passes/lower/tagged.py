"""Lowering with each program node tagged by the IR op it was written for, for the pipeline runtime.

``lower_tagged`` is ``lower`` (the same ``Emitter``, the same program) with two marks on the fx
nodes (``program.staged`` names them), so that ``passes/lower/stages.py`` can cut one micro-batch's
program into pipeline stages by the planner's own rule (``ir.stages``):

- ``meta[IR_TAG]``: the IR node whose emission wrote it (an op, or the reshardings and
  gathers of its inputs: a transfer belongs to its consumer, as the pipeline price charges it);
  nodes written while finishing the program (the loss's placement, gradient reductions) have none;
- ``meta[PARAM_VALUE]``: (IR node, output, placements) of a parameter (or a layout view of
  one) at the placements an op reads it, so a backward regather can be matched with the forward's.

Every backward node without ``IR_TAG`` was written while finishing the program: the gradient
reductions (bucketed or not) and the casts before them.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.fx as fx

from autopar.ir.graph import Node, Ref
from autopar.ir.placement import Placements
from autopar.ir.stages import boundary_carriers
from autopar.passes.lower.emitter import Emitter
from autopar.passes.lower.resolve import Resolved
from autopar.passes.search.kept import instance_path, kept_reads
from autopar.passes.search.strategies import output_placement
from autopar.program.program import Program
from autopar.program.staged import IR_TAG, PARAM_VALUE


class _Tagging(Emitter):
    """The emitter, marking every fx node it writes with the IR node being emitted; with a stage
    rule (``stage_of``: IR node -> stage), a backward value handed to an earlier stage in another
    placement than its activation's crosses in that one (``ir.stages.boundary_carriers``)."""

    def __init__(self, res: Resolved, coords: Sequence[int], device: Optional[torch.device], precision: str,
                 stage_of: Optional[Callable[[str], int]] = None):
        super().__init__(res, coords, device, precision)
        self.stage_of = stage_of
        self.carriers = {} if stage_of is None else boundary_carriers(
            res.graph, stage_of, lambda r: output_placement(res.strategies[r.node], r.index))
        self.reading: Optional[str] = None  # the IR node being emitted
        self.carried: dict[tuple, fx.Node] = {}  # (ref, placements, dtype) -> its value read past the boundary

    def _emit_node(self, node: Node) -> None:
        outer, self.reading = self.reading, node.name
        with _tagged(self, node.name):
            super()._emit_node(node)
        self.reading = outer

    def value(self, ref: Ref, want: Placements, where: fx.Graph, dtype: Optional[torch.dtype] = None) -> fx.Node:
        carrier = self.carriers.get(ref) if where is self.bg and self.reading is not None else None
        if carrier is not None and self.stage_of(self.reading) < self.stage_of(ref.node):
            # made by a later stage: resharded to the carrier's placement there (tagged with its
            # maker), then from it here, by this reader
            key = (ref, tuple(want), dtype)
            if key not in self.carried:
                with _tagged(self, ref.node):
                    sent = super().value(ref, carrier, where)
                out = self._reshard(sent, ref, carrier, want, where)
                self.carried[key] = out if dtype is None else self.cast(out, dtype, where)
            return self.carried[key]
        out = super().value(ref, want, where, dtype)
        if dtype is None and ref.node in self.params:
            out.meta.setdefault(PARAM_VALUE, (ref.node, ref.index, tuple(want)))
        return out


@contextlib.contextmanager
def _tagged(em: Emitter, name: str) -> Iterator[None]:
    """Tag the fx nodes ``em`` appends to either program while the block runs with IR node ``name``
    (a node already tagged, emitted early inside, keeps its own)."""
    before = [next(iter(reversed(g.nodes)), None) for g in (em.fg, em.bg)]
    yield
    for graph, last in zip((em.fg, em.bg), before):  # new nodes are appended at the end
        n = last.next if last is not None else next(iter(graph.nodes), None)
        while n is not None and n.op != "root":
            n.meta.setdefault(IR_TAG, name)
            n = n.next


def keeping_gathers(res: Resolved) -> Resolved:
    """``res`` with every parameter keeping its gathered blocks for the step (the backward
    reads the forward's gathered block, or a layout view of it, instead of gathering again): what
    the pipeline price assumes (``passes/search/pipeline_split.py``: gathers once per step)."""
    g = res.graph
    paths = sorted({instance_path(g, node) for node in g.params.values()} - {None})
    # None: the parameters outside every layer instance (embedding, head) are kept too
    kept = kept_reads(g, res.strategies.__getitem__, [*paths, None], res.mesh, res.recomputed)
    return replace(res, kept={**kept, **res.kept}, _casts={})


def lower_tagged(res: Resolved, coords: Sequence[int], device: Optional[torch.device] = None,
                 precision: str = "model", stage_of: Optional[Callable[[str], int]] = None) -> Program:
    """``lower``'s program for the device at ``coords``, its fx nodes tagged (see the module docstring);
    ``stage_of`` (IR node -> pipeline stage): the stage boundaries' gradients cross as their
    activations are placed."""
    em = _Tagging(res, coords, device, precision, stage_of)
    em.emit()
    return em.finish()


__all__ = ["keeping_gathers", "lower_tagged"]
