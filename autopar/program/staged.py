"""A lowered program cut into pipeline stages: the contract between the stage cut (``passes.lower.stages``,
which writes it) and the pipeline runtimes (``runtime.pipeline``, which run it).

The lowering marks fx nodes for the cut (``passes.lower.tagged``), and the cut's dry run marks their
local shapes; the marks are named here, once:

- ``IR_TAG``: the IR node whose emission wrote the fx node (none on what finishing the program wrote:
  the loss's placement, the gradient reductions and the casts before them);
- ``PARAM_VALUE``: (IR node, output, placements) of a parameter read at those placements, so that a
  backward regather can be matched with the forward's;
- ``SHAPE``: the (shape, dtype) of the node's local value on this device.

``Cut`` holds the per-step static program, each stage's per-micro-batch forward and backward
(``StageCut``) and the per-step reductions (``Reductions``); ``StagedProgram`` is what a driver hands
a pipeline runtime: the cut with the program and the captured graph it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx

from autopar.errors import ArgumentError
from autopar.ir.graph import Graph
from autopar.program.program import CompiledPart, Program

IR_TAG = "autopar_ir"
PARAM_VALUE = "autopar_param_value"
SHAPE = "autopar_local"


@dataclass
class StageCut:
    """One stage's per-micro-batch programs and what they read and write."""

    index: int
    forward: fx.GraphModule  # (*statics, *given, *f_in) -> (*f_out, *stash)
    f_statics: list[int]  # static value ids it reads
    f_given: list[int]  # input slot positions (program.inputs) it reads
    f_in: list[fx.Node]
    f_out: list[fx.Node]
    stash: list[fx.Node]
    backward: fx.GraphModule  # (*stash, *statics, *g_in, [tangent]) -> (*g_out, *frontier)
    b_statics: list[int]
    g_in: list[fx.Node]
    g_out: list[fx.Node]
    frontier: list[int]  # frontier ids it makes
    tangent: bool  # its backward reads the loss's gradient
    #: The backward split for zero-bubble schedules (``cut(..., split=True)``), else None:
    #: ``backward_input`` (same inputs) -> (*g_out, *shared): the input gradients, and what the
    #: weight part reads of its work; ``backward_weight`` (same inputs, *shared) -> (*frontier).
    backward_input: Optional[fx.GraphModule] = None
    backward_weight: Optional[fx.GraphModule] = None


@dataclass
class Cut:
    """The program cut into stages (``passes.lower.stages``)."""

    stages: list[StageCut]
    static: fx.GraphModule  # (*params and buffers it reads) -> every static value, in id order
    state_slots: list[int]  # the program.inputs positions the static program reads
    reduce: Callable  # (*frontier) -> the program's gradients (program.grads order): ``Reductions``
    frontier_shapes: list[tuple]  # (shape, dtype) per frontier id
    frontier_stage: list[int]
    n_static: int


class Reductions:
    """The per-step part for one rank: ``(*frontier) ->`` every gradient of the program, in order. Only
    the reductions of gradients that this rank's stages contribute to run (one collective for a
    bucket whole if any member's does); the others are zeros of their reduced shape (a weight read
    on several ranks, a tied embedding and head, is summed over the pipeline group from them) on
    ``device`` (the program's; None: the CPU)."""

    def __init__(self, gm: fx.GraphModule, kept: list[int], shapes: list[tuple],
                 device: Optional[torch.device] = None):
        self.gm, self.kept, self.shapes, self.device = gm, kept, shapes, device

    def __call__(self, *frontier):
        got = dict(zip(self.kept, self.gm(*frontier)))
        return [got[k] if k in got else torch.zeros(shape, dtype=dtype, device=self.device)
                for k, (shape, dtype) in enumerate(self.shapes)]


@dataclass
class StagedProgram:
    """One device's program of one micro-batch, cut into the plan's stages: what a pipeline runtime runs."""

    graph: Graph  # the IR graph captured at the micro-batch's shape
    stage_of: Callable[[str], int]  # IR node name -> its stage (``ir.stages.stage_rule``)
    program: Program  # lowered for the device's coordinates on the stage mesh, marked and dry-run
    cut: Cut
    batch: int  # the whole batch's rows (the micro-batches are its slices)
    local: list[int]  # the stages this device runs (the static program computes what they read)


def compile_cut(cut: Cut, backend: str) -> None:
    """Run every stage's per-micro-batch programs (forward, backward and the zero-bubble halves)
    through ``torch.compile`` with ``backend`` from now on (``program.CompiledPart``); the static
    program and the reductions, once a step each, stay eager."""
    for st in cut.stages:
        for part in ("forward", "backward", "backward_input", "backward_weight"):
            gm = getattr(st, part)
            if gm is not None and not isinstance(gm, CompiledPart):
                setattr(st, part, CompiledPart(gm, backend))


def local_shape(n: fx.Node) -> tuple:
    """The (shape, dtype) the dry run recorded for ``n``; an ``ArgumentError`` if it did not reach it."""
    got = n.meta.get(SHAPE)
    if got is None:
        raise ArgumentError(f"autopar pipeline: no local shape for {n.name} (the dry run did not reach it)")
    return got


def boundary_pairs(f_vals: list, g_vals: list, where: str) -> list[int]:
    """For each backward boundary value, the forward boundary slot of equal local shape and dtype
    that carries it back (torch's stages send a stage's input gradients in its inputs' shapes)."""
    free = list(range(len(f_vals)))
    out = []
    for g in g_vals:
        want = g.meta.get(SHAPE)
        slot = next((k for k in free if f_vals[k].meta.get(SHAPE) == want), None)
        if slot is None:
            raise ArgumentError(f"autopar pipeline: the backward sends {g.name} {want} back across {where}, but no "
                                "value the forward sends there has its local shape; this plan's placements do not "
                                "pair the stage boundary's gradients with its activations")
        free.remove(slot)
        out.append(slot)
    return out


__all__ = ["IR_TAG", "PARAM_VALUE", "SHAPE", "Cut", "Reductions", "StageCut", "StagedProgram", "boundary_pairs", "compile_cut",
           "local_shape"]
