"""The small pieces of the plan's HTML page: escaping, number formats, placement chips, table cells.

Every text from the plan goes through ``escape`` (module paths are user-controlled); numbers that
may be missing or not finite print as ``"-"``.
"""

from __future__ import annotations

import html
import math
import re
from typing import Any, Iterable

from autopar.ir.placement import split_top_level
from autopar.plans.format import finite_float, human_bytes, human_time


def escape(x: Any) -> str:
    """Escaped text for element content and attribute values."""
    return html.escape(str(x), quote=True)


def is_number(x: Any) -> bool:
    """Whether ``x`` is a finite int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))


def sort_key(x: Any) -> str:
    """The sort key of a numeric cell (``data-v``)."""
    return format(finite_float(x), ".12g")


def svg_coord(x: float) -> str:
    """An SVG coordinate: two decimals, no ``-0.00``."""
    s = f"{x:.2f}"
    return "0.00" if s == "-0.00" else s


def percent(part: float, whole: float) -> str:
    """``"12.5%"``; below 0.1% two significant digits (``"0.0045%"``) so a small share is not 0.0%."""
    if not whole > 0:
        return "-"
    x = 100.0 * part / whole
    return f"{x:.2g}%" if 0 < abs(x) < 0.1 else f"{x:.1f}%"


def time_text(x: Any) -> str:
    """``human_time(x)``, or ``"-"`` when ``x`` is not a finite number."""
    return human_time(x) if is_number(x) else "-"


def bytes_text(x: Any) -> str:
    """``human_bytes(x)``, or ``"-"`` when ``x`` is not a finite number."""
    return human_bytes(x) if is_number(x) else "-"


def placement_entries(text: str) -> list[str]:
    """``"S(0), P(max)"`` -> ``["S(0)", "P(max)"]``: the non-empty entries, stripped."""
    return [p.strip() for p in split_top_level(text) if p.strip()]


def per_axis(placement: Any, axes: tuple[str, ...]) -> dict[str, str]:
    """``"S(0), B"`` over ``("dp", "tp")`` -> ``{"dp": "S(0)", "tp": "B"}``; the named form
    ``"dp=S(0), tp=B"`` too. Axes a placement does not mention are left out."""
    parts = placement_entries(str(placement))
    if parts and all("=" in p for p in parts):
        named = {}
        for p in parts:
            name, _, value = p.partition("=")
            named[name.strip()] = value.strip()
        return named
    return {ax: parts[i] for i, ax in enumerate(axes) if i < len(parts)}


def placement_kind(token: str) -> str:
    """CSS class suffix of a placement token: S, B, P or X (unknown)."""
    head = token[:1].upper()
    return head if head in ("S", "B", "P") else "X"


def chip(token: str, title: str = "") -> str:
    """A placement token as a colour-coded chip (``title``: its tooltip)."""
    t = f' title="{escape(title)}"' if title else ""
    return f'<span class="pl pl-{placement_kind(token)}"{t}>{escape(token)}</span>'


def full_name(name: str, path: str) -> str:
    """A parameter name listed under module ``path`` as its full FQN."""
    if not path or name.startswith(path + "."):
        return name
    return f"{path}.{name}"


def header_cell(label: str, key: str, num: bool = False, title: str = "") -> str:
    """A sortable column header: ``key`` names the column in ``#sort=``, ``num`` sorts it by number."""
    t = f' title="{escape(title)}"' if title else ""
    typ = ' data-type="num"' if num else ""
    return f'<th scope="col" data-key="{escape(key)}"{typ}{t}>{escape(label)}</th>'


def bar_cell(value: Any, text: str, scale: float, cls: str = "") -> str:
    """A numeric cell with a bar behind its text, ``value`` against ``scale`` (the column's largest)."""
    w = 100.0 * finite_float(value) / scale if scale > 0 else 0.0
    c = f" {cls}" if cls else ""
    return (f'<td class="num" data-v="{sort_key(value)}"><span class="cellbar{c}" style="width:{w:.1f}%"></span>'
            f'<span class="cellval">{escape(text)}</span></td>')


def placement_chips(text: Any) -> str:
    """Placement text (``"S(0), B"``) as one chip per mesh axis."""
    if text is None:
        return '<span class="none">-</span>'
    parts = placement_entries(str(text))
    return '<span class="chips">' + "".join(chip(p) for p in parts) + "</span>" if parts else escape(text)


def steps_text(steps: Iterable[Any]) -> str:
    """A resharding's steps in one line (``"all_gather on tp 1.00 KiB 3 us, ..."``)."""
    out = [f"{s.get('kind')} on {s.get('axis')} {bytes_text(s.get('bytes'))} {time_text(s.get('time'))}"
           for s in steps if isinstance(s, dict)]
    return ", ".join(out) or "local (no communication)"


def css_class(name: str) -> str:
    """``name`` made safe as a CSS class suffix."""
    return re.sub(r"[^a-z0-9_-]", "_", name.lower())


__all__ = ["bar_cell", "bytes_text", "chip", "css_class", "escape", "full_name", "header_cell", "is_number", "per_axis",
           "percent", "placement_chips", "placement_entries", "placement_kind", "sort_key", "steps_text", "svg_coord",
           "time_text"]
