"""The planners' options: one frozen record, checked once where ``autopar.plan`` (``compile``,
``autopar.recipes``) receives its keywords, and handed unchanged down the planners
(``factorize`` -> ``pipelined`` -> ``intra``). A planner that needs another setting for one solve
makes a copy (``dataclasses.replace(options, memory_budget=math.inf)``); no planner re-states a
default."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

from autopar.cost_model.mesh import Mesh
from autopar.cost_model.precision import get_precision
from autopar.cost_model.schedules import SCHEDULES
from autopar.errors import ArgumentError, MeshError
from autopar.ir.attention_forms import check_forms
from autopar.ir.graph import Graph
from autopar.passes.search.checkpoint import Pin as CheckpointPin
from autopar.passes.search.checkpoint import check_checkpointing
from autopar.passes.search.kept import Pin as KeptPin
from autopar.passes.search.kept import check_kept_gathers
from autopar.passes.search.layout import Layout
from autopar.passes.search.recipes import NAMES
from autopar.plans.format import human_bytes
from autopar.validate import check_bool, check_choice, check_hints, check_keywords, check_number, parse_size

#: The memory budget when none is given: this fraction of the device's memory. The other 15% is
#: the headroom a job on the device needs beyond the tensors the plan prices: the caching
#: allocator's fragmentation (what it reserves over what is allocated, commonly 5-10% of the peak),
#: the communication library's own buffers (NCCL keeps a few MiB per channel and peer for each
#: communicator: about 1-2 GiB with a data, a tensor and a pipeline axis), and the CUDA context,
#: kernel images and library workspaces (about 1 GiB). On an 80 GB device that leaves 12 GB.
DEFAULT_BUDGET_FRACTION = 0.85
#: keys of ``pipeline=``
PIPELINE_KEYS = ("schedule", "microbatches", "virtual_stages")


@dataclass(frozen=True)
class PlanOptions:
    """What ``autopar.plan`` was asked, besides the model, the mesh and the inputs (see its docstring
    for each keyword). ``memory_budget`` None is the default budget (``budget``); ``graph`` an already
    captured graph of the model; ``pipeline`` the checked ``pipeline=`` dict (None: not pinned)."""

    training: bool = True
    hints: Optional[Mapping] = None
    #: forms of attention ops per mesh axis (``ir.attention_forms``): ``{"sp": "ulysses"}``
    attention: Optional[Mapping] = None
    memory_budget: Optional[float] = None
    time_limit: Optional[float] = None
    search: str = "ilp"
    precision: Optional[str] = None
    optimizer: str = "adamw"
    recipe: Optional[Union[str, Layout]] = None
    tensor_axis: Union[int, str] = -1
    deterministic_time: float = 20.0
    progress: Optional[bool] = None
    graph: Optional[Graph] = None
    checkpointing: CheckpointPin = None
    kept_gathers: KeptPin = None
    #: price the program as Inductor compiles it (``cost_model.fusion``): ``compile(..., compile=True)``
    compiled: bool = False
    #: for a model that returns logits: ``loss_fn(output, target)`` (``target=`` a keyword input) or
    #: ``loss_fn(output)``, captured into the step with the model (unpipelined plans)
    loss_fn: Optional[Callable] = None
    pipeline: Optional[Mapping] = None
    #: the step returns the model's other outputs too (``ir.capture.capture(outputs=True)``): set by
    #: ``autopar.plan`` for unpipelined plans, not a keyword
    capture_outputs: bool = False

    def budget(self, mesh: Mesh) -> float:
        """The memory budget per device in bytes: the one given, else ``DEFAULT_BUDGET_FRACTION`` of
        ``mesh``'s device memory."""
        if self.memory_budget is not None:
            return float(self.memory_budget)
        return DEFAULT_BUDGET_FRACTION * mesh.hardware.memory


#: the keywords ``plan_options`` reads (``autopar.plan``'s own and those it passes on); ``pipeline``
#: is an argument of ``autopar.plan`` alone
KEYWORDS = tuple(f for f in PlanOptions.__dataclass_fields__ if f not in ("pipeline", "capture_outputs"))


def plan_options(mesh: Mesh, kw: Mapping[str, Any], where: str = "autopar.plan", pipeline: Any = None) -> PlanOptions:
    """``kw`` (``autopar.plan``'s keywords) checked and read into a ``PlanOptions`` for ``mesh``: an
    ``ArgumentError`` names the first bad argument. ``memory_budget`` is read as bytes (text such as
    "60GiB" too) and must not exceed the device's memory."""
    check_keywords(kw, KEYWORDS, where)
    opts = PlanOptions(**kw)
    check_bool(opts.training, f"{where}: training")
    check_hints(opts.hints, f"{where}: hints")
    check_forms(opts.attention, mesh.names, f"{where}: attention")
    budget = opts.memory_budget
    if budget is not None:
        budget = parse_size(budget, f"{where}: memory_budget", allow_inf=True)
        _check_budget(budget, mesh, where)
    check_number(opts.time_limit, f"{where}: time_limit (seconds)")
    check_number(opts.deterministic_time, f"{where}: deterministic_time", allow_none=False)
    if opts.search not in ("ilp", "propagate"):
        raise ArgumentError(f"{where}: search={opts.search!r}: choose 'ilp' (the cheapest plan) or 'propagate' "
                            "(the annotations spread GSPMD-style, the rest chosen locally)")
    if opts.progress is not None:
        check_bool(opts.progress, f"{where}: progress")
    check_bool(opts.compiled, f"{where}: compiled")
    if opts.loss_fn is not None and not callable(opts.loss_fn):
        raise ArgumentError(f"{where}: loss_fn must be a callable loss_fn(output, target) (or loss_fn(output)), got "
                            f"{type(opts.loss_fn).__name__}")
    try:
        get_precision(opts.precision, mesh.hardware, opts.optimizer)
    except ValueError as e:
        raise ArgumentError(f"{where}: {e}") from None
    if not isinstance(opts.recipe, Layout):  # a Layout: the user's own (``autopar.recipes.from_dtensor``)
        check_choice(opts.recipe, NAMES, f"{where}: recipe", allow_none=True)
    check_checkpointing(opts.checkpointing, f"{where}: checkpointing")
    check_kept_gathers(opts.kept_gathers, f"{where}: kept_gathers")
    try:
        mesh.axis(opts.tensor_axis)
    except MeshError as e:
        raise ArgumentError(f"{where}: tensor_axis: {e}") from None
    if opts.graph is not None and not isinstance(opts.graph, Graph):
        raise ArgumentError(f"{where}: graph must be a Graph from autopar.ir.capture.capture, got "
                            f"{type(opts.graph).__name__}")
    checked = check_pipeline(pipeline, where) if pipeline is not None else None
    return PlanOptions(**dict(kw, memory_budget=budget, pipeline=checked))


def _check_budget(budget: float, mesh: Mesh, where: str) -> None:
    """A finite budget above the device's memory would let a plan "fit" that the device cannot hold."""
    memory = mesh.hardware.memory
    if budget != math.inf and budget > memory:
        raise ArgumentError(f"{where}: memory_budget {human_bytes(budget)} is more than the {human_bytes(memory)} "
                            f"of one {mesh.hardware.name} device; give at most {human_bytes(memory)} (the default is "
                            f"{DEFAULT_BUDGET_FRACTION:.0%} of it), or plan for a device with more memory (another "
                            f"preset, or Mesh(..., memory=...))")


def check_pipeline(pipeline: Any, where: str = "autopar.plan") -> dict:
    """``pipeline=`` checked: a dict with some of ``schedule`` (one of torch's names in
    ``SCHEDULES``), ``microbatches`` (int >= 1), ``virtual_stages`` (int >= 1); {} for None."""
    if pipeline is None:
        return {}
    if not isinstance(pipeline, Mapping):
        raise ArgumentError(f"{where}: pipeline must be a dict such as {{'schedule': '1F1B', 'microbatches': 16}}, "
                            f"got {type(pipeline).__name__}")
    bad = [k for k in pipeline if k not in PIPELINE_KEYS]
    if bad:
        raise ArgumentError(f"{where}: pipeline has unknown key(s) {bad}; it takes {list(PIPELINE_KEYS)}")
    out = dict(pipeline)
    if "schedule" in out and out["schedule"] not in SCHEDULES:
        raise ArgumentError(f"{where}: pipeline schedule {out['schedule']!r} is not one of {list(SCHEDULES)}")
    for k in ("microbatches", "virtual_stages"):
        v = out.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ArgumentError(f"{where}: pipeline {k} must be an int >= 1, got {v!r}")
    return out


__all__ = ["DEFAULT_BUDGET_FRACTION", "KEYWORDS", "PIPELINE_KEYS", "PlanOptions", "check_pipeline", "plan_options"]
