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

__all__ = ["OutputTree", "StepOutput", "flatten_outputs", "is_namedtuple_type", "rebuild_outputs"]

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
