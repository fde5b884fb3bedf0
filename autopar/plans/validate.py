"""The plan file's schema: what ``load_plan`` and ``Plan.from_dict`` accept, checked before a Plan exists.

A plan file is data a user may edit by hand (or receive from someone else), so nothing in it is trusted:
``read_json`` bounds the file (size, integer digits, nesting) while parsing it, ``check_values`` bounds
every value (finite numbers of sane size, strings without control characters), and ``check_fields``
checks every field's type and range against the pydantic models below, parses every placement with
autopar's own parser and checks that axis names agree across the file. The first problem found is a
``PlanError`` naming the field as a JSON path (``nodes[3].strategy[0]``) and the value, clipped.

Policy: a key that ``Plan.save`` does not write is refused (a typo or a file of another format would
otherwise be half-read silently); free-form maps (placements, memory, baselines, solver statistics)
take any names. Schema versions: see ``autopar.plans.schema.READABLE_VERSIONS``.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import numbers
import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from autopar.cost_model.precision import OPTIMIZER_STATES, PRECISIONS
from autopar.errors import PlacementError, PlanError
from autopar.ir.placement import Split, parse, parse_one, split_top_level
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

# control characters (tab and newline allowed in free text), lone surrogates, bidirectional overrides
_BAD_TEXT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u202a-\u202e\u2066-\u2069]")
_BAD_NAME = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u202a-\u202e\u2066-\u2069]")


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
    integer beyond 64 bits, a number that is not finite or beyond ``MAX_NUMBER``, a string too long
    or holding control characters, more than ``MAX_VALUES`` values in all. Returns whether every
    value is plain JSON data (dict, list, str, int, float, bool, None), as a parsed file is."""
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
    if _BAD_TEXT.search(s):
        raise PlanError(f"{json_path(loc)}: the {'key' if key else 'string'} {shown(s)} holds control characters")


# -- field types ------------------------------------------------------------------------------------

def _whole(x: Any) -> Any:
    """An integral float (``8e10``, as a hand-edited byte count may be written) as an int."""
    return int(x) if isinstance(x, float) and math.isfinite(x) and x.is_integer() else x


def _name(s: str) -> str:
    if _BAD_NAME.search(s):
        raise ValueError("a name may not hold control characters, tabs or newlines")
    return s


def _ndim(info: ValidationInfo) -> int:
    return len((info.context or {}).get("axes", ()))


@functools.lru_cache(maxsize=4096)
def _placement(text: str, ndim: int) -> str:
    try:
        ps = parse(text, ndim=ndim or None)
    except PlacementError as e:
        raise ValueError(str(e)) from None
    for p in ps:
        if isinstance(p, Split) and not 0 <= p.dim < MAX_DIM:
            raise ValueError(f"placement {text!r} splits dim {p.dim}; tensor dims are 0..{MAX_DIM - 1}")
    return text


def _check_placement(text: str, info: ValidationInfo) -> str:
    return _placement(text, _ndim(info))


_SIGNATURE = re.compile(r"^\((.*)\) -> \((.*)\)$")


@functools.lru_cache(maxsize=4096)
def _signature(text: str) -> str:
    m = _SIGNATURE.match(text)
    if not m:
        raise ValueError(f"a strategy is '(inputs) -> (outputs)' per mesh axis, got {shown(text)}")
    try:
        for side, allow_none in ((m.group(1), False), (m.group(2), True)):
            for part in (split_top_level(side) if side.strip() else []):
                if not (allow_none and part.strip() == "-"):
                    parse_one(part)
    except PlacementError as e:
        raise ValueError(str(e)) from None
    return text


def _axis(name: str, info: ValidationInfo) -> str:
    axes = (info.context or {}).get("axes", ())
    if axes and name not in axes:
        raise ValueError(f"axis {name!r} is not one of the mesh's axes {list(axes)}")
    return name


Int = Annotated[int, BeforeValidator(_whole), Field(ge=0, le=MAX_INT)]
Count = Int  # a count of things: a whole number like any other
Seconds = Annotated[float, Field(ge=0, le=MAX_NUMBER, allow_inf_nan=False)]
Delta = Annotated[float, Field(ge=-MAX_NUMBER, le=MAX_NUMBER, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, le=MAX_NUMBER, allow_inf_nan=False)]
Name = Annotated[str, Field(max_length=MAX_NAME), AfterValidator(_name)]
Text = Annotated[str, Field(max_length=MAX_STRING)]
PlacementText = Annotated[str, Field(max_length=1024), AfterValidator(_check_placement)]
AxisName = Annotated[str, Field(max_length=MAX_NAME), AfterValidator(_axis)]
Signature = Annotated[str, Field(max_length=MAX_STRING), AfterValidator(_signature)]


class _Strict(BaseModel):
    """Only the keys autopar writes, each of its own type (no coercion of strings to numbers)."""
    model_config = ConfigDict(extra="forbid", strict=True)


class _Link(_Strict):
    latency: Positive
    bandwidth: Positive


class _Hardware(_Strict):
    name: Name
    peak_flops: Annotated[dict[Name, Positive], Field(min_length=1)]
    hbm_bandwidth: Positive
    memory: Annotated[int, BeforeValidator(_whole), Field(ge=1, le=MAX_INT)]
    intra_node: _Link
    inter_node: _Link
    devices_per_node: Annotated[int, BeforeValidator(_whole), Field(ge=1, le=MAX_DEVICES)]
    nics_per_node: Annotated[int, BeforeValidator(_whole), Field(ge=1, le=MAX_DEVICES)]  # schema version 3
    matmul_efficiency: Positive
    memory_efficiency: Positive
    launch_floor: Seconds
    flash_attention: bool
    default_precision: Literal[PRECISIONS]  # type: ignore[valid-type]


AxisSize = Annotated[int, BeforeValidator(_whole), Field(ge=1, le=MAX_AXIS_SIZE)]
MeshAxisName = Annotated[str, Field(max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class _Mesh(_Strict):
    axes: Annotated[dict[MeshAxisName, AxisSize], Field(min_length=1, max_length=MAX_AXES)]
    device: Name
    hardware: _Hardware
    links: dict[MeshAxisName, _Link] = None

    @field_validator("axes")
    @classmethod
    def _devices(cls, axes: dict) -> dict:
        if math.prod(axes.values()) > MAX_DEVICES:
            raise ValueError(f"the mesh has {math.prod(axes.values()):,} devices; at most {MAX_DEVICES:,}")
        return axes

    @model_validator(mode="after")
    def _links_match(self) -> _Mesh:
        if self.links is not None and set(self.links) != set(self.axes):
            raise ValueError(f"links are given for the axes {sorted(self.links)}, the mesh has {list(self.axes)}")
        return self


class _Precision(_Strict):
    name: Literal[PRECISIONS]  # type: ignore[valid-type]
    compute_bytes: Annotated[int, Field(ge=1, le=16)] | None = None
    compute_dtype: Name | None = None
    param_bytes: Annotated[int, Field(ge=1, le=16)] = None
    grad_bytes: Annotated[int, Field(ge=1, le=16)] = None
    gather_bytes: Annotated[int, Field(ge=1, le=16)] | None = None
    optimizer: Literal[tuple(OPTIMIZER_STATES)] = None  # type: ignore[valid-type]
    optimizer_bytes: Annotated[int, Field(ge=0, le=64)] = None


class _Fingerprint(_Strict):
    graph: Name = None
    mesh: Name = None
    hardware: Name = None


class _Graph(_Strict):
    nodes: Count = None
    ops: Count = None
    params: Count = None
    fqns: list[Name] = None
    inputs: dict[Name, Text] = None
    shapes: dict[Name, Text] = None  # schema version 2
    ops_hist: dict[Name, Count] = None
    blocks: dict[Name, list[Annotated[list[Count], Field(min_length=2, max_length=2)]]] = None


class _Node(_Strict):
    name: Name = None
    op: Name = None
    module: Name = None
    phase: Name = None
    strategy: list[Signature] = None
    tags: list[Name] = None
    inputs: list[PlacementText] = None
    outputs: list[PlacementText | None] = None
    compute: Seconds = None

    @field_validator("strategy", "tags")
    @classmethod
    def _per_axis(cls, v: list, info: ValidationInfo) -> list:
        n = _ndim(info)
        if n and len(v) != n:
            raise ValueError(f"{len(v)} entries for a mesh of {n} axes ({', '.join((info.context or {})['axes'])}); "
                             f"give one per axis")
        return v


class _Step(_Strict):
    kind: Name = None
    axis: AxisName = None
    bytes: Int = None
    time: Seconds = None


class _Resharding(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    tensor: Name = None
    consumers: list[Name] = None
    consumer: Name = None
    kind: Name = None
    from_: PlacementText = Field(None, alias="from")
    to: PlacementText = None
    bytes: Int = None
    time: Seconds = None
    steps: list[_Step] = None
    module: Name | None = None
    bucket: Count = None


class _Collective(_Strict):
    kind: Name = None
    axis: AxisName = None
    bytes: Int = None
    count: Count = None
    phase: Name = None
    bucketed: bool = None


class _Alternative(_Strict):
    name: Text = None
    time: Seconds = None
    comm: Seconds = None
    delta: Delta = None


class _Module(_Strict):
    path: Name = None
    time: Seconds = None
    comm: Seconds = None
    bytes: Int = None
    memory: Int = None
    placements: dict[Name, PlacementText] = None
    alternatives: list[_Alternative] = None


class _Baseline(_Strict):
    step_time: Seconds = None
    peak_memory: Int = None
    fits: bool = None
    error: Text = None


class _LayerGroup(_Strict):
    prefix: Name = None
    count: Count = None
    paths: list[Name] = None
    checkpointed: Count = None
    mode: Literal["none", "full", "selective"] = None
    saved_bytes: Int = None
    input_bytes: Int = None
    recompute_time: Seconds = None
    kept_gathers: bool = None


class _Solver(BaseModel):
    """The solver's statistics: the figures the views print are typed, the rest is free-form."""
    model_config = ConfigDict(extra="allow", strict=True)
    solver: Text = None
    status: Text = None
    gap: Delta | None = None
    variables: Count = None
    constraints: Count = None
    rounds: Count = None
    wall_time: Seconds = None
    user_time: Seconds = None
    deterministic_time: Seconds = None


class _Timing(_Strict):
    phases: dict[Name, Seconds] = None
    solver: dict[Name, Seconds] = None


class _PlanFile(_Strict):
    schema_version: int
    axis_names: list[MeshAxisName] = None
    timing: _Timing = None
    fingerprint: _Fingerprint
    mesh: _Mesh
    precision: _Precision
    training: bool
    memory_budget: Int
    step_time: Seconds
    compute_time: Seconds
    comm_time: Seconds
    peak_memory: Int
    memory: dict[Name, Int]
    placements: dict[Name, PlacementText]
    nodes: list[_Node]
    reshardings: list[_Resharding]
    collectives: list[_Collective]
    bucket_size: Int
    baselines: dict[Name, _Baseline]
    solver: _Solver
    source: Name
    modules: list[_Module]
    phases: dict[Name, Seconds] = None  # the Plan's field; a file keeps it under timing
    graph: _Graph
    checkpointing: dict[Name, Literal["full", "selective"]] = None  # schema version 4
    kept_gathers: list[Name] = None  # schema version 4
    layer_groups: list[_LayerGroup] = None  # schema version 4


_KNOWN_KEYS = sorted({k for m in (_PlanFile, _Mesh, _Hardware, _Link, _Precision, _Fingerprint, _Graph, _Node, _Step,
                                  _Collective, _Alternative, _Module, _Baseline, _Timing, _Resharding, _LayerGroup) for k in m.model_fields}
                     | {"from"})


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
        mesh = _Mesh.model_validate(d["mesh"])
    except ValidationError as e:
        raise PlanError(_error_text(_with_prefix(e.errors(include_url=False)[0], "mesh"))) from None
    axes = tuple(mesh.axes)
    order = d.get("axis_names")
    if order is not None and isinstance(order, list) and sorted(map(str, order)) != sorted(axes):
        raise PlanError(f"axis_names: {shown(order)} does not list the mesh's axes {list(axes)}")
    try:
        _PlanFile.model_validate(d, context={"axes": axes})
    except ValidationError as e:
        errors = e.errors(include_url=False)
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise PlanError(_error_text(errors[0]) + more) from None


def _with_prefix(err: dict, prefix: str) -> dict:
    return {**err, "loc": (prefix,) + tuple(err["loc"])}


__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "MAX_INT_DIGITS", "HugeInt", "check_fields", "check_values", "json_path",
           "read_json", "shown"]
