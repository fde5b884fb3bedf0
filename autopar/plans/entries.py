"""The plan file's entry shapes, once: pydantic models that both check a file (``autopar.plans.validate``)
and are the typed records code reads (``plan.pipeline`` is a ``PipelineChoice``).

Each model lists only the keys ``Plan.save`` writes, each of its own type (``Strict``: no coercion of
strings to numbers, an unknown key refused). Optional keys default to None, and None is never written:
a record is dumped without its None fields (``dump``), which gives the file's keys exactly. Fields whose
checks need the plan's mesh (placements, axis names) read it from the validation context
(``{"axes": (...)}``). Schema versions: see ``autopar.plans.schema``.
"""

from __future__ import annotations

import functools
import math
import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from autopar.cost_model.precision import OPTIMIZER_STATES, PRECISIONS
from autopar.errors import PlacementError
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
    shown,
)

R = TypeVar("R", bound=BaseModel)

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
    # "a+b": a collective over the combined group of axes a and b (a joint all-to-all)
    if axes and not all(part in axes for part in name.split("+")):
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


class Strict(BaseModel):
    """Only the keys autopar writes, each of its own type (no coercion of strings to numbers)."""
    model_config = ConfigDict(extra="forbid", strict=True)


class LinkEntry(Strict):
    """One link's alpha-beta figures (``autopar.cost_model.hardware.Link``)."""
    latency: Positive
    bandwidth: Positive
    # schema version 7: per collective kind, time over the ring formula's (absent: none, all at 1)
    factors: dict[Literal["all_gather", "all_reduce", "reduce_scatter", "all_to_all"], Positive] = None


class EfficiencyEntry(Strict):
    """The shape-dependent efficiency curves (schema version 5)."""
    mm_max: Positive
    mm_half_mn: NonNegative
    mm_half_k: NonNegative
    attn_fwd: Positive
    attn_bwd: Positive
    attn_half_seq: NonNegative
    attn_half_head_dim: NonNegative
    mem_max: Positive
    mem_half_bytes: NonNegative


class HardwareEntry(Strict):
    """The device model the plan was priced on."""
    name: Name
    peak_flops: Annotated[dict[Name, Positive], Field(min_length=1)]
    hbm_bandwidth: Positive
    memory: Annotated[int, BeforeValidator(_whole), Field(ge=1, le=MAX_INT)]
    intra_node: LinkEntry
    inter_node: LinkEntry
    devices_per_node: Annotated[int, BeforeValidator(_whole), Field(ge=1, le=MAX_DEVICES)]
    nics_per_node: Annotated[int, BeforeValidator(_whole), Field(ge=1, le=MAX_DEVICES)]  # schema version 3
    efficiency: EfficiencyEntry = None  # schema version 5
    matmul_efficiency: Positive = None  # schema versions 1-4 (loaded as a flat efficiency)
    memory_efficiency: Positive = None
    launch_floor: Seconds
    flash_attention: bool
    default_precision: Literal[PRECISIONS]  # type: ignore[valid-type]
    # schema version 6: fraction of compute throughput lost beside a hidden collective (older: 0)
    overlap_slowdown: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = None


AxisSize = Annotated[int, BeforeValidator(_whole), Field(ge=1, le=MAX_AXIS_SIZE)]
MeshAxisName = Annotated[str, Field(max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class MeshEntry(Strict):
    """``Mesh.to_dict()``: the axes in mesh order, the device name, its hardware and per-axis links."""
    axes: Annotated[dict[MeshAxisName, AxisSize], Field(min_length=1, max_length=MAX_AXES)]
    device: Name
    hardware: HardwareEntry
    links: dict[MeshAxisName, LinkEntry] = None

    @field_validator("axes")
    @classmethod
    def _devices(cls, axes: dict) -> dict:
        if math.prod(axes.values()) > MAX_DEVICES:
            raise ValueError(f"the mesh has {math.prod(axes.values()):,} devices; at most {MAX_DEVICES:,}")
        return axes

    @model_validator(mode="after")
    def _links_match(self) -> MeshEntry:
        if self.links is not None and set(self.links) != set(self.axes):
            raise ValueError(f"links are given for the axes {sorted(self.links)}, the mesh has {list(self.axes)}")
        return self


class PrecisionEntry(Strict):
    """``Precision.to_dict()``: the dtypes' sizes and the optimizer priced."""
    name: Literal[PRECISIONS]  # type: ignore[valid-type]
    compute_bytes: Annotated[int, Field(ge=1, le=16)] | None = None
    compute_dtype: Name | None = None
    param_bytes: Annotated[int, Field(ge=1, le=16)] = None
    grad_bytes: Annotated[int, Field(ge=1, le=16)] = None
    gather_bytes: Annotated[int, Field(ge=1, le=16)] | None = None
    optimizer: Literal[tuple(OPTIMIZER_STATES)] = None  # type: ignore[valid-type]
    optimizer_bytes: Annotated[int, Field(ge=0, le=64)] = None


class Fingerprint(Strict):
    """sha256 hex digests of what shaped the plan."""
    graph: Name = None
    mesh: Name = None
    hardware: Name = None


class GraphSummary(Strict):
    """The captured graph in brief, to say why a plan is stale (``graph_differences``)."""
    nodes: Count = None
    ops: Count = None
    params: Count = None
    fqns: list[Name] = None
    inputs: dict[Name, Text] = None
    shapes: dict[Name, Text] = None  # schema version 2
    ops_hist: dict[Name, Count] = None
    blocks: dict[Name, list[Annotated[list[Count], Field(min_length=2, max_length=2)]]] = None


class NodeEntry(Strict):
    """One IR op node with its chosen strategy (per mesh axis), in graph order."""
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


class ReshardingStep(Strict):
    """One collective of a resharding."""
    kind: Name = None
    axis: AxisName = None
    bytes: Int = None
    time: Seconds = None


class Resharding(Strict):
    """A placement change on the way from a tensor's producer to its consumer(s); ``kind`` is activation,
    param, grad or recompute, ``bytes`` the whole tensor's, ``bucket`` the gradients sharing a bucket (or
    parameter gathers a group); ``from`` is a Python keyword, hence the field ``from_``."""
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    tensor: Name = None
    consumers: list[Name] = None
    consumer: Name = None
    kind: Name = None
    from_: PlacementText = Field(None, alias="from")
    to: PlacementText = None
    bytes: Int = None
    time: Seconds = None
    steps: list[ReshardingStep] = None
    module: Name | None = None
    bucket: Count = None
    phase: Literal["backward"] = None  # schema version 4: a gather for a re-run (checkpointed) forward op


class Collective(Strict):
    """A collective the program issues ``count`` times per step (``bytes`` per call)."""
    kind: Name = None
    axis: AxisName = None
    bytes: Int = None
    count: Count = None
    phase: Name = None
    bucketed: bool = None


class Alternative(Strict):
    """Another strategy of a module's op and how much it would add to the step time."""
    name: Text = None
    time: Seconds = None
    comm: Seconds = None
    delta: Delta = None


class AttentionForm(Strict):
    """An attention op's form on one mesh axis (``ir.attention_forms``) and what each other form
    would add to the step time (an ``Alternative`` named by the form)."""
    op: Name = None
    axis: Name = None
    form: Text = None
    alternatives: list[Alternative] = None


class ModuleEntry(Strict):
    """Per-module totals and its parameters' placements (FQN -> placement text)."""
    path: Name = None
    time: Seconds = None
    comm: Seconds = None
    bytes: Int = None
    memory: Int = None
    placements: dict[Name, PlacementText] = None
    alternatives: list[Alternative] = None
    attention: list[AttentionForm] = None


class Baseline(Strict):
    """A hand-written recipe priced by the same cost model, or the error that kept it out."""
    step_time: Seconds = None
    peak_memory: Int = None
    fits: bool = None
    error: Text = None


class LayerGroupEntry(Strict):
    """One group of alike layer instances (the folding's groups) and its memory/time trade-off
    (schema version 4). Bytes per device and seconds per instance."""
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


class ComparedSchedule(Strict):
    """One pipeline schedule x micro-batch count the planner priced."""
    schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"] = None
    microbatches: Count = None
    virtual_stages: Count = None
    step_time: Seconds = None
    peak_memory: Int = None
    bubble: Annotated[float, Field(ge=0, le=1)] = None
    recomputed: Count = None  # schema version 6
    estimated: bool = None  # schema version 6


class StageRecompute(Strict):
    """What one pipeline stage recomputes (schema version 6)."""
    mode: Literal["none", "full", "selective"]
    layers: list[Name]


class MeshCandidate(Strict):
    """One factorization the mesh search priced (schema version 6)."""
    shape: dict[Name, Count]
    step_time: Seconds = None
    peak_memory: Int = None
    fits: bool = None
    pipelined: bool = None
    error: Text = None


class MeshSearchEntry(Strict):
    """``Mesh.devices``: the device count the planner factorized and what it compared (schema version 6)."""
    devices: Count
    node_size: Count
    chosen: dict[Name, Count]
    compared: list[MeshCandidate]


class PipelineChoice(Strict):
    """``plan.pipeline``: a pipelined plan's choice (schema version 5; ``autopar/planner/pipelined.py``).

    The ``axis`` (``pp``) of ``degree`` ranks and the whole mesh's ``mesh_names``/``mesh_shape``; the
    ``schedule``, ``microbatches`` and ``virtual_stages`` (stages per rank); ``stages`` (module paths
    per stage) and ``stage_ranks`` (the pp rank running each stage); the replayed ``bubble`` and
    ``makespan``, the exposed gradient ``sync_time``, one boundary transfer's ``p2p_time``, per rank
    ``in_flight`` micro-batches and ``rank_memory``, per stage ``stage_times`` (forward, input and weight
    gradient); the ``compared`` candidates; and, since version 6, what each stage ``recompute``s, the
    ``batch_coupled`` ops and the single-device ``reference`` they are compared with; since version 7
    ``stage_buckets`` (gradient buckets never span stages). Optional fields are None when a file of
    an older version lacks them."""
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
    compared: list[ComparedSchedule] = None
    recompute: list[StageRecompute] = None  # schema version 6
    batch_coupled: list[Text] = None  # schema version 6
    reference: Literal["whole-batch", "micro-batched"] = None  # schema version 6
    stage_buckets: bool = None  # schema version 7


class SolverEntry(BaseModel):
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


class TimingEntry(Strict):
    """Wall-clock figures, written only with ``timing=True``."""
    phases: dict[Name, Seconds] = None
    solver: dict[Name, Seconds] = None


class PlanFile(Strict):
    """The whole file: the Plan's fields plus ``axis_names`` (the mesh order) and ``timing``."""
    schema_version: int
    axis_names: list[MeshAxisName] = None
    timing: TimingEntry = None
    fingerprint: Fingerprint
    mesh: MeshEntry
    precision: PrecisionEntry
    training: bool
    memory_budget: Int
    step_time: Seconds
    compute_time: Seconds
    comm_time: Seconds
    peak_memory: Int
    memory: dict[Name, Int]
    placements: dict[Name, PlacementText]
    nodes: list[NodeEntry]
    reshardings: list[Resharding]
    collectives: list[Collective]
    bucket_size: Int
    baselines: dict[Name, Baseline]
    solver: SolverEntry
    source: Name
    modules: list[ModuleEntry]
    phases: dict[Name, Seconds] = None  # the Plan's field; a file keeps it under timing
    graph: GraphSummary
    checkpointing: dict[Name, Literal["full", "selective"]] = None  # schema version 4
    kept_gathers: list[Name] = None  # schema version 4
    layer_groups: list[LayerGroupEntry] = None  # schema version 4
    model_flops: NonNegative = None  # schema version 5
    mfu: NonNegative = None
    tokens_per_step: Int = None
    tokens_per_second_per_device: NonNegative = None
    pipeline: PipelineChoice | None = None  # schema version 5
    mesh_search: MeshSearchEntry | None = None  # schema version 6
    peak_at: Text = None  # schema version 8


def record(model: type[R], data: Mapping) -> R:
    """``data`` (an entry ``check_fields`` or the planner checked) as a ``model`` record, nested entries
    as their records. A string pydantic cannot read (a lone surrogate: torch takes any str as a module
    name; the file's check reads it with U+FFFD in its place) is kept as it is: the record is then
    built field by field, without a second check."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        if any(err["type"] != "string_unicode" for err in e.errors(include_url=False)):
            raise
    return _built(model, data)


def _built(model: type[R], data: Mapping) -> R:
    names = {(f.alias or n): n for n, f in model.model_fields.items()}
    return model.model_construct(**{names[k]: _value(model.model_fields[names[k]].annotation, v)
                                    for k, v in data.items()})


def _value(kind: Any, v: Any) -> Any:
    """``v`` built as the field type ``kind`` says: a nested model (or a list of them) as records."""
    if isinstance(v, Mapping) and isinstance(kind, type) and issubclass(kind, BaseModel):
        return _built(kind, v)
    for arg in typing.get_args(kind):  # ``list[Model]``, ``Model | None``
        if isinstance(v, list) and typing.get_origin(kind) is list:
            return [_value(arg, x) for x in v]
        if isinstance(arg, type) and issubclass(arg, BaseModel) and isinstance(v, Mapping):
            return _built(arg, v)
    return v


def dump(entry: BaseModel) -> dict:
    """``entry`` as the file writes it: its keys by alias (``"from"``), None fields left out."""
    return entry.model_dump(by_alias=True, exclude_none=True)


#: the models whose keys the validator's "did you mean" hint offers (every one but the solver's
#: statistics, which take any names)
MODELS: tuple[type[BaseModel], ...] = (
    PlanFile, MeshEntry, HardwareEntry, LinkEntry, EfficiencyEntry, PrecisionEntry, Fingerprint, GraphSummary,
    NodeEntry, ReshardingStep, Resharding, Collective, Alternative, ModuleEntry, Baseline, TimingEntry,
    LayerGroupEntry, PipelineChoice, ComparedSchedule, StageRecompute, MeshCandidate, MeshSearchEntry)

__all__ = ["MODELS", "Alternative", "Baseline", "Collective", "ComparedSchedule", "EfficiencyEntry", "Fingerprint",
           "GraphSummary", "HardwareEntry", "LayerGroupEntry", "LinkEntry", "MeshCandidate", "MeshEntry",
           "MeshSearchEntry", "ModuleEntry", "NodeEntry", "PipelineChoice", "PlanFile", "PrecisionEntry", "Resharding",
           "ReshardingStep", "SolverEntry", "StageRecompute", "Strict", "TimingEntry", "dump", "record"]
