"""Bounds on a plan file and on every value in it, checked while and after parsing (before any field).

``read_json`` bounds the file (size, integer digits, nesting) while parsing it; ``check_values`` bounds
every value (finite numbers of sane size, strings of sane length). Both raise a ``PlanError`` naming
the file or the value's JSON path. A string may hold any character, control characters included:
names come from the user's code (torch accepts ``"x\x1b[31m"`` as a module name), ``Plan.save``
writes them JSON-escaped, and every view escapes them before they reach a terminal
(``format.printable``). ``autopar.plans.validate`` checks fields after.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

from autopar.errors import PlanError
from autopar.plans.format import clip

#: bounds on a plan file and its values (far above what a real plan needs)
MAX_FILE_BYTES = 256 << 20
MAX_DEPTH = 16  # a real plan nests 5 deep
MAX_INT_DIGITS = 19  # every integer of a plan fits in 64 bits
MAX_INT = 2**63 - 1
MAX_NUMBER = 1e30  # seconds, bytes, FLOP/s: nothing real comes near
MAX_STRING = 1 << 16
MAX_NAME = 4096
MAX_VALUES = 20_000_000
MAX_AXES = 16
MAX_AXIS_SIZE = 1 << 20
MAX_DEVICES = 1 << 24
MAX_DIM = 64  # tensor dims a placement may split (torch allows 64 dims at most)
SHOWN = 60  # characters of a bad value shown in a message



class HugeInt:
    """An integer literal of more than ``MAX_INT_DIGITS`` digits, kept as text so that reading it
    costs nothing (Python refuses, or takes long, to convert thousands of digits)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"{self.text[:12]}..."


def shown(value: Any) -> str:
    """``repr(value)`` clipped to ``SHOWN`` characters (control characters escaped by repr)."""
    return clip(repr(value), SHOWN)


def json_path(loc: tuple) -> str:
    """``("nodes", 3, "strategy")`` -> ``"nodes[3].strategy"``; keys that are not identifiers
    (parameter FQNs) in brackets: ``placements['layers.0.weight']``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).isidentifier():
            out += f".{part}" if out else str(part)
        else:
            out += f"[{shown(str(part))}]"
    return out or "(the plan)"


# -- reading ----------------------------------------------------------------------------------------

def _parse_int(text: str):
    return HugeInt(text) if len(text.lstrip("-")) > MAX_INT_DIGITS else int(text)


def read_json(path: str) -> Any:
    """The JSON value in the file at ``path``, read with bounds (file size, integer digits, nesting);
    a PlanError, naming the file, says what is wrong with it."""
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise PlanError(f"{path!r}: the file is {size:,} bytes; a plan file is at most {MAX_FILE_BYTES:,} bytes")
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise PlanError(f"{path!r} is not a plan file: cannot read it ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PlanError(f"{path!r} is not a plan file: it is not UTF-8 text") from None
    try:
        return json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise PlanError(f"{path!r} is not a plan file: invalid JSON at line {e.lineno} column {e.colno} "
                        f"({e.msg})") from None
    except RecursionError:
        raise PlanError(f"{path!r} is not a plan file: its JSON nests too deep to read (a plan nests at most "
                        f"{MAX_DEPTH} levels)") from None


# -- values -----------------------------------------------------------------------------------------

def check_values(d: Any) -> bool:
    """Raise PlanError at the first value out of bounds: nesting deeper than ``MAX_DEPTH``, an
    integer beyond 64 bits, a number that is not finite or beyond ``MAX_NUMBER``, a string too long,
    more than ``MAX_VALUES`` values in all. Returns whether every value is plain JSON data (dict,
    list, str, int, float, bool, None), as a parsed file is."""
    stack: list[tuple[Any, tuple, int]] = [(d, (), 0)]
    count, plain = 0, True
    while stack:
        x, loc, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise PlanError(f"the plan holds more than {MAX_VALUES:,} values")
        if depth > MAX_DEPTH:
            raise PlanError(f"{json_path(loc)}: nested deeper than {MAX_DEPTH} levels")
        t = type(x)
        if t is str:
            _check_text(x, loc)
        elif x is None or t is bool:
            pass
        elif t is dict or (t is not list and isinstance(x, Mapping)):
            plain = plain and t is dict
            for k, v in x.items():
                if type(k) is str:
                    _check_text(k, loc + (k,), key=True)
                else:
                    plain = False
                stack.append((v, loc + (k,), depth + 1))
        elif t is list or t is tuple:
            plain = plain and t is list
            stack.extend((v, loc + (i,), depth + 1) for i, v in enumerate(x))
        elif isinstance(x, HugeInt):
            raise PlanError(f"{json_path(loc)}: an integer of {len(x.text.lstrip('-'))} digits ({shown(x)}); "
                            f"plan integers fit in 64 bits")
        elif isinstance(x, numbers.Integral):
            plain = plain and t is int
            if abs(int(x)) > MAX_INT:
                raise PlanError(f"{json_path(loc)}: the integer {shown(int(x))} does not fit in 64 bits")
        elif isinstance(x, numbers.Real):
            plain = plain and t is float
            f = float(x)
            if not math.isfinite(f):
                raise PlanError(f"{json_path(loc)}: {f} is not a finite number")
            if abs(f) > MAX_NUMBER:
                raise PlanError(f"{json_path(loc)}: {f:g} is out of range (at most {MAX_NUMBER:g} in size)")
        else:  # canon() names it as a value that cannot be stored
            plain = False
    return plain


def _check_text(s: str, loc: tuple, key: bool = False) -> None:
    if len(s) > MAX_STRING:
        raise PlanError(f"{json_path(loc)}: a {'key' if key else 'string'} of {len(s):,} characters "
                        f"({shown(s)}); at most {MAX_STRING:,}")


__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "MAX_INT_DIGITS", "HugeInt", "check_values", "json_path", "read_json", "shown"]
