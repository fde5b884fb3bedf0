"""The IR: a Graph of Nodes whose tensors carry shapes, dtypes and roles.

A Node is one aten op (or a graph input) of the captured program. Tuple-returning ops are one Node
with several outputs; fx's ``getitem`` nodes are folded away, so an input of a Node is a
``Ref(node, index)``. Every pass reads this IR; nothing downstream needs the fx graph, but each Node
keeps its fx node for lowering.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch


class Role(str, enum.Enum):
    """What a tensor is in the training step."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    TANGENT = "tangent"  # the seed gradient of the loss (1.0)
    ACTIVATION = "activation"
    GRADIENT = "gradient"  # the gradient of a parameter (a graph output)
    LOSS = "loss"


class Phase(str, enum.Enum):
    """Whether a node belongs to the forward or the backward of the captured step."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor (no strides: the IR is about values, not layouts).

    ``blocks`` lists ``(dim, c)`` for dims made of ``c`` equal blocks that the program cuts apart
    (a fused ``qkv`` output split into q, k and v; the ``cat`` of their gradients): a split of such
    a dim cuts every block alike, so each device holds its piece of each block, in block order
    (DTensor's ``_StridedShard(dim, split_factor=c)``). ``ir.blocks`` finds them.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: tuple[tuple[int, int], ...] = ()

    def block_count(self, dim: int) -> int:
        """How many equal blocks dim ``dim`` is made of (1: a plain dim)."""
        for d, c in self.blocks:
            if d == dim:
                return c
        return 1

    @property
    def ndim(self) -> int:
        """Number of dims."""
        return len(self.shape)

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.numel * self.dtype.itemsize

    @property
    def is_float(self) -> bool:
        """Whether the dtype is floating point (it can carry gradients and partial sums)."""
        return self.dtype.is_floating_point or self.dtype.is_complex

    def __str__(self) -> str:
        return f"{str(self.dtype).replace('torch.', '')}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Ref:
    """Output ``index`` of the node named ``node``."""

    node: str
    index: int = 0

    def __str__(self) -> str:
        return self.node if self.index == 0 else f"{self.node}[{self.index}]"


def short_op(op: str) -> str:
    """An op's name without the ``aten.`` namespace and the ``.default`` overload: ``mm``, ``add.Tensor``."""
    op = op[len("aten."):] if op.startswith("aten.") else op
    return op[:-len(".default")] if op.endswith(".default") else op


@dataclass(eq=False)
class Node:
    """One op of the program.

    ``args``/``kwargs`` are the op's arguments with every tensor replaced by its ``Ref``;
    ``inputs`` lists those Refs in the order they appear (flattened), which is the order sharding
    signatures use. ``outputs[i]`` is None for a non-tensor output.
    """

    name: str
    op: str  # "aten.mm.default", "placeholder", "output", "autopar.hint.default"
    target: Any  # the OpOverload (or None for placeholders/output)
    args: tuple
    kwargs: dict
    inputs: list[Ref]
    outputs: list[Optional[TensorSpec]]
    roles: list[Role]
    phase: Phase
    module_path: str
    fx_node: Optional[torch.fx.Node] = field(default=None, repr=False)

    @property
    def out(self) -> TensorSpec:
        """The single (first) output's spec."""
        spec = self.outputs[0]
        assert spec is not None, f"{self.name} has no tensor output"
        return spec

    @property
    def is_placeholder(self) -> bool:
        """Whether the node is a graph input (parameter, buffer, input or tangent), not an op."""
        return self.op == "placeholder"

    def where(self) -> str:
        """The op as users know it, for messages: ``module path: op`` (``blocks.0.mlp.fc: mm``),
        ``(backward)`` added for an op of the backward. Never the internal node name."""
        text = f"{self.module_path or '<root>'}: {short_op(self.op)}"
        return text + " (backward)" if self.phase == Phase.BACKWARD else text


@dataclass(frozen=True)
class Hint:
    """A user annotation captured from ``autopar.hint``: ``ref`` must have ``placements``."""

    ref: Ref
    placements: str
    module_path: str


#: per graph: (its node list, its length, ``Graph.users()``) when made
_USERS: "weakref.WeakKeyDictionary[Graph, tuple]" = weakref.WeakKeyDictionary()


@dataclass(eq=False)
class Graph:
    """A captured program: Nodes in topological order plus the meaning of its inputs and outputs."""

    nodes: list[Node]
    training: bool
    params: dict[str, str]  # FQN -> placeholder node name
    buffers: dict[str, str]  # FQN -> placeholder node name
    inputs: dict[str, str]  # "input:0" / keyword name -> placeholder node name
    constants: dict[str, Any]  # non-tensor inputs ("input:2" / keyword name -> value)
    grads: dict[str, Ref]  # parameter FQN -> its gradient
    loss: Optional[Ref]
    outputs: list[Optional[Ref]]  # every output of the program, in order
    hints: list[Hint] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)  # tied FQN -> canonical FQN (in params/buffers)
    mutations: dict[str, Ref] = field(default_factory=dict)  # buffer FQN -> its new value (e.g. BatchNorm stats)
    #: a training step's outputs besides the loss (the model's other tensors, ``capture(outputs=True)``), in order
    extras: list[Ref] = field(default_factory=list)
    #: where each output goes back in the model's result (``ir.outputs.OutputTree``); None: not recorded
    output_tree: Any = None
    gm: Optional[torch.fx.GraphModule] = field(default=None, repr=False)
    _by_name: dict[str, Node] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {n.name: n for n in self.nodes}

    def node(self, name: str) -> Node:
        """The node called ``name``."""
        return self._by_name[name]

    def user_name(self, x: "Ref | Node | str") -> str:
        """The user's name of a tensor (a ``Ref``) or of a node's first output: the parameter's or
        buffer's FQN, ``input:N`` or the keyword input's name, the gradient of a parameter, the loss,
        or ``module path: op`` (``Node.where``). Every message naming a tensor goes through here:
        the internal node names (``primals_3``, ``mm_7``) mean nothing to users."""
        ref = x if isinstance(x, Ref) else Ref(x.name if isinstance(x, Node) else x)
        node = self._by_name[ref.node]
        if node.is_placeholder:
            for table in (self.params, self.buffers, self.inputs):
                for key, name in table.items():
                    if name == ref.node:
                        return key
            return "the loss's incoming gradient" if node.roles[0] == Role.TANGENT else node.where()
        for fqn, g in self.grads.items():
            if g == ref:
                return f"the gradient of {fqn}"
        if self.loss == ref:
            return "the loss"
        text = node.where()
        return text if len(node.outputs) == 1 else f"{text} output {ref.index}"

    def spec(self, ref: Ref) -> TensorSpec:
        """Shape and dtype of the tensor ``ref`` names."""
        spec = self._by_name[ref.node].outputs[ref.index]
        assert spec is not None, f"{ref} is not a tensor"
        return spec

    def role(self, ref: Ref) -> Role:
        """The role of the value ``ref`` names (parameter, activation, gradient, ...)."""
        return self._by_name[ref.node].roles[ref.index]

    def ops(self) -> Iterator[Node]:
        """Every node that computes something (not placeholders)."""
        return (n for n in self.nodes if not n.is_placeholder)

    def users(self) -> dict[str, list[str]]:
        """Node name -> names of the nodes that read any of its outputs. Made once per node list
        (several passes ask): the answer is shared, callers read it and never change it."""
        got = _USERS.get(self)
        if got is not None and got[0] is self.nodes and got[1] == len(self.nodes):
            return got[2]
        seen: dict[str, dict[str, None]] = {n.name: {} for n in self.nodes}  # (ordered sets: a wide fan-out stays linear)
        for n in self.nodes:
            for r in n.inputs:
                seen[r.node][n.name] = None
        out = {k: list(v) for k, v in seen.items()}
        _USERS[self] = (self.nodes, len(self.nodes), out)
        return out

    def op_names(self) -> list[str]:
        """Distinct op names, sorted."""
        return sorted({n.op for n in self.ops()})

    def __len__(self) -> int:
        return len(self.nodes)

    def summary(self) -> str:
        """A short text listing of the graph, one node a line (for debugging)."""
        lines = []
        for n in self.nodes:
            ins = ", ".join(str(r) for r in n.inputs)
            outs = ", ".join(str(o) for o in n.outputs)
            lines.append(f"{n.phase.value[:3]} {n.name} = {n.op}({ins}) -> {outs}  [{n.module_path}]")
        return "\n".join(lines)
