"""The structure of what a model returns, so that a compiled step returns it too.

Capture flattens the model's result into its tensors (the captured program's outputs; the loss
apart when training) and an ``OutputTree`` that says where each goes back: a Hugging Face
``ModelOutput``, a dict, a dataclass, a (named) tuple or list, nested as the model nests them, with
non-tensor constants (``None``, numbers, strings) kept as they were. Objects autopar cannot rebuild
(a key-value cache object) come back as ``None``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

from autopar import _torch_compat as tc
from autopar._torch_compat import pytree
from autopar.errors import CaptureError

aten = torch.ops.aten

__all__ = ["OutputTree", "StepOutput", "check_loss_fn", "flatten_outputs", "is_namedtuple_type", "loss_of",
           "rebuild_outputs", "strip_output_detach", "traced_forward"]

_CONSTANTS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


class StepOutput(NamedTuple):
    """What a step with ``loss_fn=`` returns: the loss ``loss_fn`` computed (what ``backward`` is
    called on) and the model's own output."""

    loss: Any
    output: Any


@dataclasses.dataclass(frozen=True)
class OutputTree:
    """One node of a model's output structure. ``kind``: ``"loss"`` (the training loss),
    ``"tensor"`` (the next of the program's outputs), ``"const"`` (``value`` as it was),
    ``"dropped"`` (an object autopar cannot rebuild: ``None``), or a container: ``"seq"`` (tuple,
    list, named tuple), ``"map"`` (dict, ``ModelOutput``), ``"dataclass"``."""

    kind: str
    cls: Any = None
    keys: tuple = ()
    children: tuple = ()
    value: Any = None

    def count(self, kind: str) -> int:
        """How many leaves of ``kind`` the tree holds."""
        return (self.kind == kind) + sum(c.count(kind) for c in self.children)


def flatten_outputs(out: Any, loss: Optional[torch.Tensor] = None) -> tuple[OutputTree, list[torch.Tensor]]:
    """``out``'s structure and its tensors in order (``loss`` itself, when given, is a ``"loss"``
    leaf and not among them)."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> OutputTree:
        if isinstance(x, torch.Tensor):
            if loss is not None and x is loss:
                return OutputTree("loss")
            tensors.append(x)
            return OutputTree("tensor")
        if isinstance(x, _CONSTANTS):
            return OutputTree("const", value=x)
        if isinstance(x, Mapping):
            keys = tuple(x.keys())
            return OutputTree("map", type(x), keys, tuple(walk(x[k]) for k in keys))
        if isinstance(x, (tuple, list)):
            return OutputTree("seq", type(x), (), tuple(walk(v) for v in x))
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            keys = tuple(f.name for f in dataclasses.fields(x))
            return OutputTree("dataclass", type(x), keys, tuple(walk(getattr(x, k)) for k in keys))
        return OutputTree("dropped", type(x))

    return walk(out), tensors


def rebuild_outputs(tree: OutputTree, loss: Any, tensors: Iterator[Any]) -> Any:
    """The model's output structure again, with ``loss`` at the loss leaf and the next of
    ``tensors`` at each tensor leaf."""

    def build(t: OutputTree) -> Any:
        if t.kind == "loss":
            return loss
        if t.kind == "tensor":
            return next(tensors)
        if t.kind == "const":
            return t.value
        if t.kind == "dropped":
            return None
        values = [build(c) for c in t.children]
        if t.kind == "seq":
            if is_namedtuple_type(t.cls):
                return t.cls(*values)
            return _construct(t.cls, values, tuple if issubclass(t.cls, tuple) else list)
        if t.kind == "map":
            items = dict(zip(t.keys, values))
            if dataclasses.is_dataclass(t.cls):  # a Hugging Face ModelOutput: its fields by keyword
                return t.cls(**items)
            return _construct(t.cls, items, dict)
        obj = t.cls.__new__(t.cls)  # a dataclass: its fields as they were, without running __init__ again
        for k, v in zip(t.keys, values):
            object.__setattr__(obj, k, v)
        return obj

    return build(tree)


def is_namedtuple_type(cls: type) -> bool:
    """Whether ``cls`` is a named tuple class (built from its fields as positional arguments)."""
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def _construct(cls: type, values: Any, plain: Callable) -> Any:
    """``cls(values)``, or the plain container where the subclass cannot be built that way."""
    try:
        return cls(values)
    except Exception:  # noqa: BLE001 - a subclass with another constructor: the plain type holds the values
        return plain(values)


# ---------------------------------------------------------------------------------------------
# Capture's side: the loss among the outputs, and what the traced forward returns


def _describe(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        return f"a {str(out.dtype).replace('torch.', '')} tensor of shape {tuple(out.shape)}"
    if isinstance(out, Mapping):
        return f"a {type(out).__name__} with keys {list(out.keys())}"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)}: [{', '.join(_describe(o) for o in out[:6])}]"
    return f"a {type(out).__name__}"


def loss_of(out: Any) -> torch.Tensor:
    """The loss among a model's outputs (see ``ir.capture.capture``)."""
    loss = None
    if isinstance(out, torch.Tensor):
        loss = out
    elif isinstance(out, Mapping):
        loss = out.get("loss")
    elif (dataclasses.is_dataclass(out) and not isinstance(out, type)) or is_namedtuple_type(type(out)):
        loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)) and out and _is_loss(out[0]):
        loss = out[0]  # (loss, logits, ...), as Hugging Face models return it with return_dict=False
    if _is_loss(loss):
        return loss
    if loss is None and not isinstance(out, torch.Tensor):
        scalars = [t for t in pytree.tree_leaves(out) if _is_loss(t)]
        if len(scalars) == 1:
            return scalars[0]
    raise CaptureError(
        f"training capture needs a loss, but the model returned {_describe(out)}. Pass loss_fn= (e.g. "
        "loss_fn=lambda logits, target: F.cross_entropy(logits.flatten(0, -2), target.flatten()), with the target "
        "as the keyword input target=), or return a scalar loss tensor, a dict or dataclass with a 'loss' entry "
        "or a tuple starting with the loss; or capture with training=False for a forward-only graph."
    )


def _is_loss(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.ndim == 0 and t.is_floating_point()


def check_loss_fn(loss_fn: Any) -> None:
    """A ``CaptureError`` for a ``loss_fn`` that is not callable or closes over a tensor (which
    would be a constant of the captured step, the same every step)."""
    if not callable(loss_fn):
        raise CaptureError(f"loss_fn must be a callable loss_fn(output, target), got {type(loss_fn).__name__}")
    cells = getattr(loss_fn, "__closure__", None) or ()
    held = [c.cell_contents for c in cells if _cell_tensor(c)]
    if held:
        raise CaptureError(
            f"loss_fn closes over a tensor of shape {tuple(held[0].shape)}: the captured step would use that value "
            "every step. Pass the targets as the keyword input target= (loss_fn(output, target) receives it)")


def _cell_tensor(cell) -> bool:
    try:
        return isinstance(cell.cell_contents, torch.Tensor)
    except ValueError:  # an empty cell
        return False


def traced_forward(forward, training: bool, outputs: bool, loss_fn: Optional[Callable], trees: list):
    """The forward capture traces: the loss (with ``outputs``: and the model's other tensors,
    detached), or every tensor output; the structure goes to ``trees``."""

    def call(*args, **kwargs):
        if loss_fn is None:
            return forward(*args, **kwargs)
        kwargs = dict(kwargs)
        has_target = "target" in kwargs
        target = kwargs.pop("target", None)
        out = forward(*args, **kwargs)
        return StepOutput(loss_fn(out, target) if has_target else loss_fn(out), out)

    def loss_forward(*args, **kwargs):
        out = call(*args, **kwargs)
        loss = loss_of(out)
        if not outputs:
            return loss
        tree, tensors = flatten_outputs(out, loss)
        trees.append(tree)
        # detached: the step's gradient is the loss's alone (capture removes the detach again)
        return (loss, *(t.detach() for t in tensors)) if tensors else loss

    def flat_forward(*args, **kwargs):
        tree, outs = flatten_outputs(call(*args, **kwargs))
        trees.append(tree)
        if not outs:
            raise CaptureError("the model returned no tensors: nothing to capture")
        return tuple(outs)

    return loss_forward if training else flat_forward


def strip_output_detach(gm: torch.fx.GraphModule) -> None:
    """The training step's outputs after the loss that are ``detach``/``alias`` of a value (capture
    detaches the model's other outputs) read the value itself: the program returns it as it is."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    descs = out.meta.get("desc") or [None] * len(out.args[0])
    strip = (aten.detach.default, aten.alias.default)
    args = []
    for a, d in zip(out.args[0], descs):
        while (isinstance(d, tc.PlainAOTOutput) and d.idx > 0 and isinstance(a, torch.fx.Node)
               and a.op == "call_function" and a.target in strip):
            a = a.args[0]
        args.append(a)
    old = [a for a in out.args[0] if isinstance(a, torch.fx.Node)]
    out.args = (tuple(args),)
    for n in old:
        while isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in strip and not n.users:
            src = n.args[0]
            gm.graph.erase_node(n)
            n = src
