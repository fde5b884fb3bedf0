"""Checks of the public API's arguments, made up front by every driver (``plan``, ``compile``,
``simulate``, ``launch``, the recipes, ``Mesh``, ``hint``, ``load_plan``) before any work.

Each check raises an ``ArgumentError`` whose one line names the argument, what it got and what to
pass. ``parse_size`` is the one reader of sizes (``60GiB``, ``80GB``, ``6e10``): the CLI's
``--memory-budget``, ``autopar.plan(memory_budget=...)`` and ``Mesh(memory=...)`` all use it.
This module sits below everything but ``errors``, so any layer may use it.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import re
from typing import TYPE_CHECKING, Any, Collection, Iterable, Mapping, Optional, Sequence, Union

from autopar.errors import ArgumentError

if TYPE_CHECKING:
    import torch

#: The hand-written recipes, by name (``autopar.recipes``; here so that the command line lists them
#: without loading the planner).
RECIPE_NAMES = ("ddp", "fsdp", "megatron_tp", "megatron_sp", "fsdp_tp")

#: Unit suffixes of a size (case-insensitive): ``GB`` is 10^9, ``GiB`` and a bare ``G`` 2^30; none: bytes.
UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")
_SIZE_FORMS = "a positive size such as 60GiB, 80GB or 6e10 (bytes)"


def _got(value: Any) -> str:
    """``value`` as a one-line message shows it: its repr when short, and its type."""
    if isinstance(value, type):
        return f"the class {value.__name__!r}"
    if callable(value) and hasattr(value, "__name__"):
        return f"the {type(value).__name__} {value.__name__!r}"
    text = repr(value)
    if isinstance(value, (str, bool, int, float, type(None))) and len(text) <= 60 and text.isprintable():
        return text
    if len(text) > 60 or not text.isprintable():
        name = type(value).__name__
        return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
    return f"{text} (a {type(value).__name__})"


def parse_size(value: Union[str, int, float], what: Optional[str] = None, *, allow_inf: bool = False
               ) -> Union[int, float]:
    """A positive number of bytes: a number (returned as given), or text with an optional unit as
    the CLI takes it (``"60GiB"`` -> 64424509440, returned as an int). ``what`` names the argument
    in the error; ``allow_inf`` admits ``float("inf")`` (no limit)."""
    bad = ArgumentError(f"{what} must be {_SIZE_FORMS}, got {_got(value)}" if what
                        else f"expected {_SIZE_FORMS}, got {value!r}")
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in UNITS:
            raise bad
        size = float(m.group(1)) * UNITS[unit]
        if not 1 <= size < math.inf:
            raise bad
        return int(size)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise bad
    v = _as_float(value)
    if math.isnan(v) or v < 1 or (v == math.inf and not allow_inf):  # as text: at least one byte
        raise bad
    return math.inf if v == math.inf else value  # an int beyond any float is no limit, as inf is


def _as_float(value: numbers.Real) -> float:
    """``float(value)``, with an int too large for a float read as infinity (not an OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def check_number(value: Any, what: str, *, allow_none: bool = True, integer: bool = False) -> Any:
    """``value`` itself when it is a positive finite number (an int when ``integer``), or None when
    ``allow_none``."""
    if value is None and allow_none:
        return value
    kind = "a positive integer" if integer else "a positive number"
    ok = not isinstance(value, bool) and isinstance(value, numbers.Integral if integer else numbers.Real)
    if not ok or not 0 < _as_float(value) < math.inf:
        raise ArgumentError(f"{what} must be {kind}" + (" or None" if allow_none else "") + f", got {_got(value)}")
    return value


def check_bool(value: Any, what: str) -> bool:
    """``value`` when it is True or False."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{what} must be True or False, got {_got(value)}")
    return value


def check_choice(value: Any, choices: Collection[str], what: str, *, allow_none: bool = False) -> Any:
    """``value`` when it is one of ``choices`` (or None when ``allow_none``)."""
    if value is None and allow_none:
        return value
    if not isinstance(value, str) or value not in choices:
        raise ArgumentError(f"{what} must be one of {', '.join(map(repr, choices))}, got {_got(value)}")
    return value


def check_model(model: Any, what: str = "model") -> torch.nn.Module:
    """``model`` when it is a ``torch.nn.Module``; a function, a class or a factory's
    ``(model, inputs)`` pair get an error saying what to pass instead."""
    import torch  # here, not at the top: the command line reads its arguments with this module before torch loads

    if isinstance(model, torch.nn.Module):
        return model
    if isinstance(model, type) and issubclass(model, torch.nn.Module):
        hint = f": pass an instance, e.g. {model.__name__}(...)"
    elif isinstance(model, tuple) and model and isinstance(model[0], torch.nn.Module):
        hint = ": a factory's (model, inputs) pair? pass the model and the inputs as two arguments"
    elif callable(model):
        hint = ": pass the module itself (call the function that builds it)"
    else:
        hint = ""
    raise ArgumentError(f"{what} must be a torch.nn.Module, got {_got(model)}{hint}")


def check_hints(hints: Any, what: str = "hints") -> Optional[Mapping]:
    """``hints`` when it is None or a dict of name -> placement (a string, or a list of per-axis
    placements); the placements' syntax is checked against the mesh when the plan is made."""
    if hints is None:
        return None
    if not isinstance(hints, Mapping):
        raise ArgumentError(f"{what} must be a dict of name -> placement, e.g. {{'input:0': 'dp=S(0)'}}, "
                            f"got {_got(hints)}")
    for key, value in hints.items():
        if not isinstance(key, str) or not key:
            raise ArgumentError(f"{what}: key {_got(key)} is not a name; keys are parameter or buffer paths (with * "
                                "wildcards), 'input:N' or a keyword input's name")
        if isinstance(value, str) or (isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray))):
            continue
        raise ArgumentError(f"{what}[{key!r}] must be a placement such as 'dp=S(0)' or 'S(0), B' (or a list of "
                            f"placements, one per mesh axis), got {_got(value)}")
    return hints


def check_kwargs(kwargs: Any, what: str = "example_kwargs") -> Optional[Mapping]:
    """``kwargs`` when it is None or a dict keyed by argument names."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ArgumentError(f"{what} must be a dict of keyword name -> value (or None), got {_got(kwargs)}")
    return kwargs


def check_keywords(given: Iterable[str], known: Collection[str], what: str) -> None:
    """Every name in ``given`` is one of ``known``; the nearest known name is suggested."""
    for name in given:
        if name not in known:
            near = difflib.get_close_matches(name, list(known), n=1)
            also = f"; did you mean {near[0]!r}?" if near else f"; it takes {', '.join(sorted(known))}"
            raise ArgumentError(f"{what} got an unknown keyword argument {name!r}{also}")


def check_path(path: Any, what: str) -> str:
    """``path`` as a string when it is a non-empty ``str`` or ``os.PathLike``."""
    if isinstance(path, (str, os.PathLike)):
        text = os.fspath(path)
        if isinstance(text, str) and text:
            return text
    raise ArgumentError(f"{what} must be a file path (a str or pathlib.Path), got {_got(path)}")


def check_callable(fn: Any, what: str) -> Any:
    """``fn`` when it can be called."""
    if not callable(fn):
        raise ArgumentError(f"{what} must be a function, got {_got(fn)}")
    return fn


def check_launch_args(fn: Any, nprocs: Any, timeout: Any, backend: Any, collective_timeout: Any = None) -> None:
    """``autopar.launch``'s own arguments: a function, a positive number of ranks, positive numbers of
    seconds when given (the run's and each collective's), a backend name."""
    check_callable(fn, "autopar.launch: fn")
    check_number(nprocs, "autopar.launch: nprocs (the number of ranks)", allow_none=False, integer=True)
    check_number(timeout, "autopar.launch: timeout (seconds)")
    check_number(collective_timeout, "autopar.launch: collective_timeout (seconds)")
    if not isinstance(backend, str) or not backend:
        raise ArgumentError(f"autopar.launch: backend must be a torch.distributed backend name such as 'gloo' or "
                            f"'nccl', got {_got(backend)}")


__all__ = ["RECIPE_NAMES", "UNITS", "ArgumentError",
           "check_bool", "check_callable", "check_choice", "check_hints", "check_keywords",
           "check_kwargs", "check_launch_args", "check_model", "check_number", "check_path", "parse_size"]
