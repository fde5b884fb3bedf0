"""Human-readable figures and small text helpers shared by the plan's views (terminal, HTML, CLI).

``human_bytes`` and ``human_time`` print sizes and durations; ``canon`` makes the canonical JSON form
of plan data (what ``Plan.to_json`` writes, and what the views compare); ``mesh_text``,
``device_count``, ``relative_name`` and ``clip`` are the one copy of helpers the views all need;
``printable`` is the one escaping of text bound for a terminal.
Nothing here imports the Plan itself, so every view can use it without an import cycle.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any, Mapping, Union

from autopar.errors import PlanError

#: solver entries that are wall-clock measurements: stored under "timing", not with the solver,
#: and never compared between plans
SOLVER_TIMING_KEYS = ("wall_time", "user_time")

#: significant digits a float keeps in a plan's canonical JSON
SIG_DIGITS = 12


# -- human-readable figures -----------------------------------------------------------------------

def human_bytes(n: Union[int, float]) -> str:
    """``1536 -> "1.50 KiB"``; below 1 KiB whole bytes (``"512 B"``); negative values keep their sign."""
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return str(n)
    sign, v = ("-" if n < 0 else ""), abs(float(n))
    if v < 1024:
        return f"{sign}{int(round(v))} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        v /= 1024.0
        if v < 1024 or unit == "PiB":
            digits = 2 if v < 10 else 1 if v < 100 else 0
            return f"{sign}{v:.{digits}f} {unit}"
    raise AssertionError("unreachable")


def human_time(s: Union[int, float]) -> str:
    """Three significant digits in s, ms, us or ns: ``0.0123 -> "12.3 ms"``, ``85e-6 -> "85 us"``."""
    if s is None or (isinstance(s, float) and not math.isfinite(s)):
        return str(s)
    if s == 0:
        return "0 s"
    sign, v = ("-" if s < 0 else ""), abs(float(s))
    if v >= 100:
        return f"{sign}{v:.0f} s"
    units = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
    for i, (unit, scale) in enumerate(units):
        if v >= scale or unit == "ns":
            x = float(f"{v / scale:.3g}")
            if x >= 1000 and i > 0:  # 999.7 us rounds to 1000 us: say 1 ms
                unit, x = units[i - 1][0], float(f"{x / 1000:.3g}")
            return f"{sign}{x:g} {unit}"
    raise AssertionError("unreachable")


# -- canonical JSON ---------------------------------------------------------------------------------

def canon(x: Any, where: str = "plan") -> Any:
    """A JSON-able deep copy: tuples as lists, floats rounded to 12 significant digits, numpy and
    torch scalars as Python numbers; anything else is a PlanError naming where it was found."""
    if x is None or isinstance(x, (str, bool)):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        f = float(x)
        return float(f"{f:.{SIG_DIGITS}g}") if math.isfinite(f) else f
    if isinstance(x, Mapping):
        return {str(k): canon(v, f"{where}[{k!r}]") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [canon(v, f"{where}[{i}]") for i, v in enumerate(x)]
    raise PlanError(f"{where}: {type(x).__name__} value {x!r} cannot be stored in a plan (use str, numbers, lists, dicts)")


# -- small text helpers -------------------------------------------------------------------------------

def finite_float(x: Any, default: float = 0.0) -> float:
    """``x`` as a finite float, or ``default`` when it is not a number (or not finite)."""
    try:
        f = float(x)
    except (TypeError, ValueError):
        return default
    return f if math.isfinite(f) else default


#: what ``printable`` escapes: C0 controls but newline and tab, DEL, C1 controls (CSI among them), and the
#: bidirectional overrides and isolates (text that displays in another order than it reads)
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (an ESC starting an escape sequence, a carriage
    return, a bidi override) become visible escapes such as ``\\x1b``; newlines and tabs stay. Names in a
    plan (module paths, FQNs) come from user code or a file, and must not drive the terminal."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                            else f"\\u{ord(m.group()):04x}", str(text))


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, ending in ``"..."`` when it was longer."""
    return text if len(text) <= width else text[: max(width - 3, 0)] + "..."


def relative_name(name: str, path: str) -> str:
    """``"blocks.0.wq"`` under module ``"blocks.0"`` -> ``"wq"``; a name outside ``path`` unchanged."""
    return name[len(path) + 1:] if path and name.startswith(path + ".") else name


def mesh_text(mesh: Mapping) -> str:
    """``"dp=2 x tp=4 (h100)"``."""
    axes = " x ".join(f"{k}={v}" for k, v in (mesh.get("axes") or {}).items()) or "(no axes)"
    return f"{axes} ({mesh.get('device', '?')})"


def device_count(mesh: Mapping) -> int:
    """The number of devices of a mesh dict (the product of its axis sizes; a size that is not a
    number counts as 1)."""
    n = 1
    for v in (mesh.get("axes") or {}).values():
        n *= int(finite_float(v, 1))
    return n


__all__ = ["SIG_DIGITS", "SOLVER_TIMING_KEYS", "canon", "clip", "device_count", "finite_float", "human_bytes",
           "human_time", "mesh_text", "printable", "relative_name"]
