"""Fake tensors and dispatch interception: ``torch._subclasses.fake_tensor`` (``FakeTensorMode``,
``FakeTensor`` and the data-dependent-op exceptions), ``GuardOnDataDependentSymNode``, and
``torch.utils._python_dispatch.TorchDispatchMode`` (torch 2.13).

On a torch upgrade: check those import paths, that a data-dependent op still raises one of
``DATA_DEPENDENT_ERRORS`` with the op in ``.func``, and that a ``TorchDispatchMode`` entered inside
a ``FakeTensorMode`` still sees each aten op once, before the fake mode runs it
(``tests/test_plain_local.py`` and ``record_collectives`` in ``tests/test_parallel.py`` rely on it).
"""

from __future__ import annotations

from typing import Any, Callable

from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._python_dispatch import TorchDispatchMode

#: Exceptions fake tensors raise on an op whose output shape or value depends on tensor data.
DATA_DEPENDENT_ERRORS = (DynamicOutputShapeException, DataDependentOutputException, GuardOnDataDependentSymNode)


def data_dependent_op(exc: BaseException) -> str | None:
    """The op named by a data-dependent fake-tensor exception, if it says."""
    func: Any = getattr(exc, "func", None)
    if func is not None:
        return str(func)
    return None


class _DispatchRecorder(TorchDispatchMode):
    """Runs every op dispatched to it unchanged, then reports it to ``on_op``."""

    def __init__(self, on_op: Callable[[Any, tuple, dict, Any], None]):
        super().__init__()
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.on_op(func, args, kwargs, out)
        return out


def record_dispatch(on_op: Callable[[Any, tuple, dict, Any], None]) -> TorchDispatchMode:
    """A context manager under which every op that reaches torch's dispatcher (aten ops, and
    collectives such as ``_c10d_functional``'s) runs unchanged and is then reported as
    ``on_op(func, args, kwargs, out)``, ``func`` the ``OpOverload``. Modes entered earlier (a
    ``FakeTensorMode``) run the op; ``on_op`` sees their results."""
    return _DispatchRecorder(on_op)


def storage_key(t: Any) -> Any:
    """A hashable key of ``t``'s storage, equal for every view of it (meta tensors included)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def record_writes(written: set) -> TorchDispatchMode:
    """A context manager under which every op runs unchanged and ``storage_key`` of each tensor an
    op writes (``normal_``'s ``self``, ``copy_``'s destination, an ``out=``) is added to ``written``."""
    import torch

    def on_op(func, args, kwargs, out):
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable:
            return
        for i, spec in enumerate(schema.arguments):
            if spec.alias_info is None or not spec.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(spec.name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    written.add(storage_key(t))

    return _DispatchRecorder(on_op)


__all__ = ["DATA_DEPENDENT_ERRORS", "FakeTensor", "FakeTensorMode", "data_dependent_op", "record_dispatch",
           "record_writes", "storage_key"]
