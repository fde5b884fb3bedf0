"""``nn.Module`` internals (torch 2.13): its own parameter, buffer and submodule tables
(``_parameters``, ``_buffers``, ``_non_persistent_buffers_set``, ``_modules``) and ``_apply``, the
method every tensor conversion (``to``, ``to_empty``, ``cuda``, ``half``, ...) goes through.

On a torch upgrade: check that those tables are still plain dicts keyed by attribute name (a
``None`` entry for a registered-but-unset tensor), and that conversions still call
``_apply(fn, recurse)`` (``tests/test_models.py`` checks GPT's tied head survives ``to_empty``).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Callable, Mapping, TypeVar

import torch

_M = TypeVar("_M", bound=type)


def parameter_table(module: torch.nn.Module) -> dict:
    """``module``'s own parameters by attribute name: the live dict. Reading or assigning an entry
    skips ``nn.Module.__getattr__``/``__setattr__`` (a DTensor ``Parameter`` put in as it is)."""
    return module._parameters


def buffer_table(module: torch.nn.Module) -> dict:
    """``module``'s own buffers by attribute name: the live dict (as ``parameter_table``)."""
    return module._buffers


def with_submodules(module: torch.nn.Module, submodules: dict) -> torch.nn.Module:
    """A shallow copy of ``module`` whose own submodule table is ``submodules`` (attribute name ->
    module; ``module`` and its table are not touched)."""
    new = copy.copy(module)
    object.__setattr__(new, "_modules", dict(submodules))
    return new


def submodule_table(module: torch.nn.Module) -> dict:
    """``module``'s own submodules by attribute name (``None`` for a registered-but-unset one): the live dict."""
    return module._modules


def share_tables(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """Give ``dst`` ``src``'s own parameter, buffer and submodule tables (the same dicts, not copies),
    so that ``dst.state_dict()``, ``named_parameters()`` and ``load_state_dict`` use ``src``'s names
    (no prefix) and see every change either side makes."""
    for table in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
        object.__setattr__(dst, table, getattr(src, table))


def with_metadata(values: Mapping, like: Mapping) -> "OrderedDict":
    """``values`` as a state dict carrying ``like``'s version metadata (``state_dict()``'s
    ``_metadata``, which ``load_state_dict`` reads to upgrade old formats)."""
    out = OrderedDict(values)
    meta = getattr(like, "_metadata", None)
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]
    return out


def after_conversion(hook: Callable[[torch.nn.Module], None]) -> Callable[[_M], _M]:
    """Class decorator: ``hook(module)`` runs after every tensor conversion of an instance
    (``to``, ``to_empty``, ``cuda``, ``half``, ...), e.g. to re-tie weights a conversion replaced
    one reference at a time."""
    def decorate(cls: _M) -> _M:
        def _apply(self, fn, recurse=True):
            out = super(cls, self)._apply(fn, recurse)
            hook(self)
            return out

        cls._apply = _apply
        return cls

    return decorate


__all__ = ["after_conversion", "buffer_table", "parameter_table", "share_tables", "submodule_table", "with_metadata",
           "with_submodules"]
