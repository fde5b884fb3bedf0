"""The lowered program: what the lowering writes for one rank and the runtime runs.

A ``Program`` holds one rank's forward and backward ``fx.GraphModule``s and the ``Slot``s that say
what each input and output is (a parameter's FQN, ``input:0``, the loss, a gradient) and how it is
placed. Its graphs call plain aten ops, ``LocalOp`` modules (rules that need this device's
offsets), ``RandomOp`` modules (random draws keyed by the program's ``RandomState``), and the
collectives of ``program.collectives``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from autopar.ir.graph import TensorSpec
from autopar.ir.placement import Placements
from autopar.ir.rules.base import LocalCtx, run_local
from autopar.ir.rules.random_attention import random_local
from autopar.ir.rules.random_ops import draw_key
from autopar.program import collectives as C


@dataclass(frozen=True)
class Slot:
    """One input or output of a lowered program: what it is, and how it is placed."""

    kind: str  # param | buffer | input | tangent | loss | output | mutation | grad
    key: str  # FQN, input key ("input:0" / keyword), or output position
    placements: Placements
    spec: TensorSpec


@dataclass
class RandomState:
    """What a program's random draws are keyed on besides op and element: the run's seed (the same on
    every rank) and the step, which the driver advances once per forward."""

    seed: int = 0
    step: int = 0


@dataclass
class Program:
    """One rank's lowered program."""

    coords: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    forward: fx.GraphModule
    inputs: list[Slot]
    outputs: list[Slot]
    n_saved: int
    backward: Optional[fx.GraphModule] = None
    grads: list[Slot] = field(default_factory=list)
    #: The key of its random ops (dropout); None when it draws nothing.
    random: Optional[RandomState] = None

    def run_forward(self, *inputs) -> tuple[list, list]:
        """Run the forward program on this thread's collective backend: its outputs, and the values
        it saves for the backward. Every collective is waited before returning: a result left in
        flight (saved for a backward that never runs) would be freed while the process group
        still writes it."""
        res = self.forward(*inputs)
        res = [C.wait(t) for t in (res if isinstance(res, (tuple, list)) else [res])]
        n_out = len(res) - self.n_saved
        return res[:n_out], res[n_out:]

    @property
    def code(self) -> str:
        """The program's Python source (forward, then backward)."""
        parts = ["# forward" + self.forward.code]
        if self.backward is not None:  # fx names every module's function "forward"
            parts.append("# backward" + self.backward.code.replace("def forward(self", "def backward(self", 1))
        return "\n".join(parts)


class LocalOp(torch.nn.Module):
    """An op whose rule computes its local block with this device's offsets (vocab-split
    embedding, sharded attention masks, ...): runs the rule's local implementation."""

    def __init__(self, ctx: LocalCtx):
        super().__init__()
        self.ctx = ctx

    def forward(self, *xs):
        """Run the rule's local implementation on this device's blocks."""
        out = run_local(self.ctx, list(xs))
        return tuple(out) if len(self.ctx.call.out_specs) > 1 else out[0]

    def extra_repr(self) -> str:
        """The op and its strategy, as ``print(program)`` shows them."""
        return f"{self.ctx.call.op}, " + " | ".join(str(s) for s in self.ctx.strategy)


class RandomOp(torch.nn.Module):
    """A random op (dropout, ``bernoulli``, attention with dropout, ...): this device's block of the
    whole tensor's draw, keyed on the program's seed and step and an IR node's name (its own; an
    attention backward's forward), see ``ir.rules.random_ops``."""

    def __init__(self, ctx: LocalCtx, node: str, state: RandomState):
        super().__init__()
        self.ctx = ctx
        self.node = node
        self.state = state  # shared by every RandomOp of the program: the driver sets seed and step

    def forward(self, *xs):
        """Draw this device's block for the current step."""
        out = random_local(self.ctx, list(xs), draw_key(self.state.seed, self.state.step, self.node))
        return tuple(out) if len(self.ctx.call.out_specs) > 1 else out[0]

    def extra_repr(self) -> str:
        """The op, its node and its strategy, as ``print(program)`` shows them."""
        return f"{self.ctx.call.op} ({self.node}), " + " | ".join(str(s) for s in self.ctx.strategy)


__all__ = ["LocalOp", "Program", "RandomOp", "RandomState", "Slot"]
