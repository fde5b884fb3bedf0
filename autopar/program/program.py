"""The lowered program: what the lowering writes for one rank and the runtime runs.

A ``Program`` holds one rank's forward and backward ``fx.GraphModule``s and the ``Slot``s that say
what each input and output is (a parameter's FQN, ``input:0``, the loss, a gradient) and how it is
placed. Its graphs call plain aten ops, ``LocalOp`` modules (rules that need this device's
offsets), ``RandomOp`` modules (random draws keyed by the program's ``RandomState``), and the
collectives of ``program.collectives``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Union

import torch
import torch.fx as fx

from autopar.errors import CompileError
from autopar.ir.graph import TensorSpec
from autopar.ir.placement import Broadcast, Placements, Split
from autopar.ir.rules.base import LocalCtx, run_local
from autopar.ir.rules.dimmap import Signature
from autopar.ir.rules.random_attention import random_local
from autopar.ir.rules.random_ops import draw_key, key_tensor
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
    #: Pipelined runs (``runtime/pipeline*.py``): the program runs one of ``micros`` micro-batches,
    #: ``micro``; each random op (IR node name) draws as block ``micro`` of the whole batch along the
    #: dim of its tensors that ``batch_dims`` names (``runtime.random_state.batch_dims``), so the
    #: micro-batches together draw the whole batch's masks.
    micro: int = 0
    micros: int = 1
    batch_dims: dict = field(default_factory=dict)


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
    #: ``torch.compile``'s forward and backward (``compile_with``), run in their place; None: eager.
    compiled: Optional[tuple] = None

    def compile_with(self, backend: str = "inductor", options: Optional[dict] = None) -> None:
        """Run the forward and backward programs through ``torch.compile`` with ``backend`` from now on.

        Dynamo traces each program with its functional collectives in it, so the backend may fuse
        the local ops between them and move a collective's wait towards its first reader. Shapes are
        static (a program is lowered for one shape), so a new input shape is a new compilation."""
        kw = dict(options or {})
        fwd = torch.compile(self.forward, backend=backend, dynamic=False, **kw)
        bwd = torch.compile(self.backward, backend=backend, dynamic=False, **kw) if self.backward is not None else None
        self.compiled = (fwd, bwd)

    def run_forward(self, *inputs) -> tuple[list, list]:
        """Run the forward program on this thread's collective backend: its outputs, and the values
        it saves for the backward. Every collective is waited before returning: a result left in
        flight (saved for a backward that never runs) would be freed while the process group
        still writes it."""
        res = (self.compiled[0] if self.compiled is not None else self.forward)(*inputs)
        res = [C.wait(t) for t in (res if isinstance(res, (tuple, list)) else [res])]
        n_out = len(res) - self.n_saved
        return res[:n_out], res[n_out:]

    def run_backward(self, *saved_and_seed) -> list:
        """Run the backward program on the forward's saved values and the loss's incoming gradient:
        the gradients, in ``grads`` order, every collective waited."""
        assert self.backward is not None, "an inference program has no backward"
        fn = self.compiled[1] if self.compiled is not None else self.backward
        return [C.wait(g) for g in fn(*saved_and_seed)]

    @property
    def code(self) -> str:
        """The program's Python source (forward, then backward)."""
        parts = ["# forward" + self.forward.code]
        if self.backward is not None:  # fx names every module's function "forward"
            parts.append("# backward" + self.backward.code.replace("def forward(self", "def backward(self", 1))
        return "\n".join(parts)


class CompiledPart:
    """A program part (an ``fx.GraphModule``) run through ``torch.compile``; everything else read of
    it (its graph, its code) is the part's own."""

    def __init__(self, gm: fx.GraphModule, backend: str):
        self.gm = gm
        self.fn = torch.compile(gm, backend=backend, dynamic=False)

    def __call__(self, *args):
        return self.fn(*args)

    def __getattr__(self, name: str):
        return getattr(self.gm, name)


def compile_backend(choice: Union[bool, str, None], where: str) -> Optional[str]:
    """The ``torch.compile`` backend a ``compile=`` choice names (None: run eagerly; True: Inductor);
    a CompileError naming ``where`` for anything else than a backend torch knows."""
    if choice is False or choice is None:
        return None
    if choice is True:
        return "inductor"
    if not isinstance(choice, str):
        raise CompileError(f"{where}: compile must be True, False or a torch.compile backend's name, "
                           f"got {type(choice).__name__} {choice!r}")
    known = torch.compiler.list_backends(exclude_tags=())
    if choice not in known:
        raise CompileError(f"{where}: compile={choice!r} is not a torch.compile backend; "
                           f"known: {', '.join(sorted(known))}")
    return choice


class LocalOp(torch.nn.Module):
    """An op whose rule computes its local block with this device's offsets (vocab-split
    embedding, sharded attention masks, ...): runs the rule's local implementation."""

    def __init__(self, ctx: LocalCtx):
        super().__init__()
        # a strategy that exchanges blocks inside the op (ring attention) does it with the program's collectives
        self.ctx = ctx if ctx.permute is not None else replace(ctx, permute=C.permute)

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
        """Draw this device's block for the current step (and micro-batch)."""
        if self.state.micros > 1 and torch.compiler.is_compiling():
            return self._micro_draw(*xs)  # the micro-batch is read at run time, never compiled in
        return self._draw(*xs)

    @torch.compiler.disable
    def _micro_draw(self, *xs):
        return self._draw(*xs)

    def _draw(self, *xs):
        st, ctx = self.state, self.ctx
        if st.micros > 1:
            if self.node not in st.batch_dims:
                raise RuntimeError(f"autopar: the random op {self.node} has no batch dim for a pipelined run "
                                   "(runtime.random_state.pipelined_random was not given its graph)")
            ctx = micro_ctx(ctx, st.batch_dims[self.node], st.micro, st.micros)
        key = _step_key(st, self.node, xs[0]) if torch.compiler.is_compiling() else draw_key(st.seed, st.step, self.node)
        out = random_local(ctx, list(xs), key)
        return tuple(out) if len(self.ctx.call.out_specs) > 1 else out[0]

    def extra_repr(self) -> str:
        """The op, its node and its strategy, as ``print(program)`` shows them."""
        return f"{self.ctx.call.op} ({self.node}), " + " | ".join(str(s) for s in self.ctx.strategy)


@torch.compiler.disable
def _step_key(state: RandomState, node: str, like: torch.Tensor) -> torch.Tensor:
    """The key of ``node``'s draw at the state's current step, as a tensor on ``like``'s device: a
    compiled program calls it at run time (one graph break) and never specializes on the step."""
    return key_tensor(draw_key(state.seed, state.step, node), like.device)


def micro_ctx(ctx: LocalCtx, dim: int, micro: int, micros: int) -> LocalCtx:
    """``ctx`` as block ``micro`` of ``micros`` of the whole batch: every tensor of the op whose
    ``dim`` has the output's size there is ``micros`` times longer, split on an outermost virtual
    mesh axis (the micro-batches cut the batch before any mesh axis does)."""
    size = ctx.call.out_specs[0].shape[dim]  # type: ignore[union-attr]

    def grow(spec):
        if spec is None or len(spec.shape) <= dim or spec.shape[dim] != size:
            return spec, False
        shape = list(spec.shape)
        shape[dim] *= micros
        return replace(spec, shape=tuple(shape)), True

    ins = [grow(s) for s in ctx.call.in_specs]
    outs = [grow(s) for s in ctx.call.out_specs]
    cut = Signature(tuple(Split(dim) if g else Broadcast() for _, g in ins),
                    tuple(None if s is None else Split(dim) if g else Broadcast() for s, g in outs), "micro")
    call = replace(ctx.call, in_specs=[s for s, _ in ins], out_specs=[s for s, _ in outs])
    return replace(ctx, call=call, strategy=(cut, *ctx.strategy), mesh_shape=(micros, *ctx.mesh_shape),
                   coords=(micro, *ctx.coords))


__all__ = ["CompiledPart", "LocalOp", "Program", "RandomOp", "RandomState", "Slot", "compile_backend"]
