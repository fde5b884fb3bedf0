"""The plan file's schema: what ``load_plan`` and ``Plan.from_dict`` accept, checked before a Plan exists.

A plan file is data a user may edit by hand (or receive from someone else), so nothing in it is trusted:
``autopar.plans.bounds`` bounds the file and every value in it first; then ``check_fields``
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
import math
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
from autopar.plans.bounds import (
    MAX_AXES,
    MAX_AXIS_SIZE,
    MAX_DEVICES,
    MAX_DIM,
    MAX_INT,
    MAX_NAME,
    MAX_NUMBER,
    MAX_STRING,
    json_path,
    shown,
)

# -- field types ------------------------------------------------------------------------------------

def _whole(x: Any) -> Any:
    """An integral float (``8e10``, as a hand-edited byte count may be written) as an int."""
    return int(x) if isinstance(x, float) and math.isfinite(x) and x.is_integer() else x


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
NonNegative = Annotated[float, Field(ge=0, le=MAX_NUMBER, allow_inf_nan=False)]
Name = Annotated[str, Field(max_length=MAX_NAME)]
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
    # schema version 7: per collective kind, time over the ring formula's (absent: none, all at 1)
    factors: dict[Literal["all_gather", "all_reduce", "reduce_scatter", "all_to_all"], Positive] = None


class _Efficiency(_Strict):
    mm_max: Positive
    mm_half_mn: NonNegative
    mm_half_k: NonNegative
    attn_fwd: Positive
    attn_bwd: Positive
    attn_half_seq: NonNegative
    attn_half_head_dim: NonNegative
    mem_max: Positive
    mem_half_bytes: NonNegative


class _Hardware(_Strict):
    name: Name
    peak_flops: Annotated[dict[Name, Positive], Field(min_length=1)]
    hbm_bandwidth: Positive
    memory: Annotated[int, BeforeValidator(_whole), Field(ge=1, le=MAX_INT)]
    intra_node: _Link
    inter_node: _Link
    devices_per_node: Annotated[int, BeforeValidator(_whole), Field(ge=1, le=MAX_DEVICES)]
    nics_per_node: Annotated[int, BeforeValidator(_whole), Field(ge=1, le=MAX_DEVICES)]  # schema version 3
    efficiency: _Efficiency = None  # schema version 5
    matmul_efficiency: Positive = None  # schema versions 1-4 (loaded as a flat efficiency)
    memory_efficiency: Positive = None
    launch_floor: Seconds
    flash_attention: bool
    default_precision: Literal[PRECISIONS]  # type: ignore[valid-type]
    # schema version 6: fraction of compute throughput lost beside a hidden collective (older: 0)
    overlap_slowdown: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = None


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
    phase: Literal["backward"] = None  # schema version 4: a gather for a re-run (checkpointed) forward op


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
    kept: Count = None  # schema version 5
    kept_bytes: Int = None
    kept_time: Seconds = None


class _Compared(_Strict):
    schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"] = None
    microbatches: Count = None
    virtual_stages: Count = None
    step_time: Seconds = None
    peak_memory: Int = None
    bubble: Annotated[float, Field(ge=0, le=1)] = None
    recomputed: Count = None  # schema version 6
    estimated: bool = None  # schema version 6


class _StageRecompute(_Strict):
    """What one pipeline stage recomputes (schema version 6)."""
    mode: Literal["none", "full", "selective"]
    layers: list[Name]


class _MeshCandidate(_Strict):
    """One factorization the mesh search priced (schema version 6)."""
    shape: dict[Name, Count]
    step_time: Seconds = None
    peak_memory: Int = None
    fits: bool = None
    pipelined: bool = None
    error: Text = None


class _MeshSearch(_Strict):
    """``Mesh.devices``: the device count the planner factorized and what it compared (schema version 6)."""
    devices: Count
    node_size: Count
    chosen: dict[Name, Count]
    compared: list[_MeshCandidate]


class _Pipeline(_Strict):
    """A pipelined plan's choice (schema version 5)."""
    axis: Name
    degree: Count
    mesh_names: list[Name]
    mesh_shape: list[Count]
    schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"]
    microbatches: Count
    virtual_stages: Count
    stages: list[list[Name]]
    stage_ranks: list[Count] = None
    bubble: Annotated[float, Field(ge=0, le=1)]
    makespan: Seconds = None
    sync_time: Seconds = None
    p2p_time: Seconds = None
    in_flight: list[Count] = None
    stage_times: list[list[Seconds]] = None
    rank_memory: list[Int] = None
    compared: list[_Compared] = None
    recompute: list[_StageRecompute] = None  # schema version 6
    batch_coupled: list[Text] = None  # schema version 6
    reference: Literal["whole-batch", "micro-batched"] = None  # schema version 6
    stage_buckets: bool = None  # schema version 7


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
    model_flops: NonNegative = None  # schema version 5
    mfu: NonNegative = None
    tokens_per_step: Int = None
    tokens_per_second_per_device: NonNegative = None
    pipeline: _Pipeline | None = None  # schema version 5
    mesh_search: _MeshSearch | None = None  # schema version 6
    peak_at: Text = None  # schema version 8


_KNOWN_KEYS = sorted({k for m in (_PlanFile, _Mesh, _Hardware, _Link, _Precision, _Fingerprint, _Graph, _Node, _Step,
                                  _Collective, _Alternative, _Module, _Baseline, _Timing, _Resharding, _LayerGroup,
                                  _Efficiency, _Pipeline, _Compared, _StageRecompute, _MeshCandidate, _MeshSearch)
                                  for k in m.model_fields}
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
        try:
            _PlanFile.model_validate(d, context={"axes": axes})
        except ValidationError as e:
            if not any(err["type"] == "string_unicode" for err in e.errors(include_url=False)):
                raise
            # a name with a lone surrogate (torch accepts any str): pydantic cannot read it, so such
            # strings are checked with U+FFFD in their place (the plan keeps them as they are)
            _PlanFile.model_validate(_surrogates_replaced(d), context={"axes": axes})
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
