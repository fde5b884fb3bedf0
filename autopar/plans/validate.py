"""The plan file's schema: what ``load_plan`` and ``Plan.from_dict`` accept, checked before a Plan exists.

A plan file is data a user may edit by hand (or receive from someone else), so nothing in it is trusted:
``autopar.plans.bounds`` bounds the file and every value in it first; then ``check_fields``
checks every field's type and range against the entry models (``autopar.plans.entries``, the one
description of the file's shapes), parses every placement with autopar's own parser and checks that
axis names agree across the file. The first problem found is a
``PlanError`` naming the field as a JSON path (``nodes[3].strategy[0]``) and the value, clipped.

Policy: a key that ``Plan.save`` does not write is refused (a typo or a file of another format would
otherwise be half-read silently); free-form maps (placements, memory, baselines, solver statistics)
take any names. Schema versions: see ``autopar.plans.schema.READABLE_VERSIONS``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from autopar.errors import PlanError
from autopar.plans.bounds import json_path, shown
from autopar.plans.entries import MODELS, MeshEntry, PlanFile

_KNOWN_KEYS = sorted({k for m in MODELS for k in m.model_fields} | {"from"})


def _error_text(err: dict) -> str:
    where = json_path(tuple(p for p in err["loc"] if not (isinstance(p, str) and (p.startswith("function-")
                                                                                   or p == "[key]"))))
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        key = err["loc"][-1]
        close = difflib.get_close_matches(str(key), _KNOWN_KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return (f"{where}: unknown key {shown(key)}{hint}; a plan file holds only the keys Plan.save writes, "
                f"so an unknown key is refused rather than ignored")
    msg = err["msg"]
    msg = msg.removeprefix("Value error, ")
    msg = msg[:1].lower() + msg[1:]
    return f"{where}: {msg}, got {shown(value)}"


def check_fields(d: Mapping) -> None:
    """Raise PlanError at the first field of a wrong type, out of range, or naming an axis or a
    placement that does not fit the plan's mesh (the mesh is checked first, the rest against it)."""
    try:
        mesh = MeshEntry.model_validate(d["mesh"])
    except ValidationError as e:
        raise PlanError(_error_text(_with_prefix(e.errors(include_url=False)[0], "mesh"))) from None
    axes = tuple(mesh.axes)
    order = d.get("axis_names")
    if order is not None and isinstance(order, list) and sorted(map(str, order)) != sorted(axes):
        raise PlanError(f"axis_names: {shown(order)} does not list the mesh's axes {list(axes)}")
    try:
        try:
            PlanFile.model_validate(d, context={"axes": axes})
        except ValidationError as e:
            if not any(err["type"] == "string_unicode" for err in e.errors(include_url=False)):
                raise
            # a name with a lone surrogate (torch accepts any str): pydantic cannot read it, so such
            # strings are checked with U+FFFD in their place (the plan keeps them as they are)
            PlanFile.model_validate(_surrogates_replaced(d), context={"axes": axes})
    except ValidationError as e:
        errors = e.errors(include_url=False)
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise PlanError(_error_text(errors[0]) + more) from None


def _surrogates_replaced(x: Any) -> Any:
    """A copy of ``x`` whose strings (keys too) have each lone surrogate replaced by U+FFFD."""
    if isinstance(x, str):
        return _SURROGATE.sub("\ufffd", x)
    if isinstance(x, Mapping):
        return {_surrogates_replaced(k): _surrogates_replaced(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_surrogates_replaced(v) for v in x]
    return x


_SURROGATE = re.compile("[\ud800-\udfff]")


def _with_prefix(err: dict, prefix: str) -> dict:
    return {**err, "loc": (prefix,) + tuple(err["loc"])}


__all__ = ["check_fields"]
