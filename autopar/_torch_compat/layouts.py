"""Reading a layout made with torch's DTensor APIs (torch 2.13): the split dim of a placement,
``_StridedShard`` included (``split_dim``), and which tensor-parallel styles a user's
``parallelize`` function applies, on which device mesh: ``parallelize_module`` applies a
``ParallelStyle`` through its private ``_apply`` method, the one point every style passes, whatever
name the caller imported ``parallelize_module`` under. ``recording_styles`` wraps ``_apply`` on
every style class for the duration of a block.

On a torch upgrade: check that ``torch.distributed.tensor.parallel.api.parallelize_module`` still
calls ``style._apply(module, device_mesh)`` (``tests/test_from_dtensor.py`` fails when no style is
recorded for a torchtitan-style plan), and whether ``_StridedShard`` became a ``Shard`` (``fully_shard``
of a column-parallel weight makes one).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator, Optional


@dataclass(frozen=True)
class AppliedStyle:
    """One style applied to one module: the style's class name, the module object and the device
    mesh it was applied on."""

    style: str
    module: Any
    mesh: Any


def split_dim(placement: Any) -> Optional[int]:
    """The dim a DTensor placement splits (``Shard(d)``, ``_StridedShard(d, sf)``); None for the others."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.dim if isinstance(placement, (Shard, _StridedShard)) else None


def _style_classes() -> list[type]:
    from torch.distributed.tensor.parallel.style import ParallelStyle

    seen, todo = [], [ParallelStyle]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


@contextlib.contextmanager
def recording_styles() -> Iterator[list[AppliedStyle]]:
    """Within the block, every ``ParallelStyle`` applied by ``parallelize_module`` is appended to
    the list it yields (styles nested in another, ``PrepareModuleInputOutput``'s, too); the styles
    still apply as usual."""
    applied: list[AppliedStyle] = []
    patched = []
    for cls in _style_classes():
        own = cls.__dict__.get("_apply")
        if own is None:
            continue

        def wrapper(self, module, device_mesh, _own=own):
            applied.append(AppliedStyle(type(self).__name__, module, device_mesh))
            return _own(self, module, device_mesh)

        patched.append((cls, own))
        setattr(cls, "_apply", functools.wraps(own)(wrapper))
    try:
        yield applied
    finally:
        for cls, own in patched:
            setattr(cls, "_apply", own)


__all__ = ["AppliedStyle", "recording_styles", "split_dim"]
