"""The Plan: what ``autopar.plan(...)`` decided and what the cost model predicts for it.

A Plan is plain data (dicts, lists, strings, numbers; the pipeline entry a typed record) so it can be
saved, loaded, shown, explained and compared without the model and without solving again. The planner
fills it (``autopar/planner/report.py``); its entry shapes are the pydantic models of
``autopar.plans.entries`` (which also check a file); this module owns the Plan, its JSON file format
and ``load_plan``; ``autopar.plans.view`` renders it for the terminal and
``autopar.plans.html`` as a page.

File format: canonical JSON (keys sorted, indent 1, floats rounded to 12 significant digits), so
saving the same plan twice, or an equal plan made on another run, gives identical bytes. Wall-clock
figures (``phases`` and the solver's ``wall_time``) live under one ``"timing"`` key, which
``save``/``to_json`` leave out unless ``timing=True``. Every file is checked against the schema in
``autopar.plans.validate`` before a Plan is made of it.

Schema versions: 1 (the first); 2 adds ``graph.shapes`` (each parameter's shape, so a plan used on a
model whose shapes changed names them); 3 adds ``mesh.hardware.nics_per_node`` (NIC rails per node,
which the default links of an axis spanning nodes now depend on). Version 1 and 2 files load as
version 3: without ``graph.shapes`` (version 1), with ``nics_per_node`` set to ``devices_per_node``
(one NIC per device, as they were priced) and their links as written (every saved plan writes its
links; a hand-made one without them gets the links versions 1 and 2 priced with), so their prices do
not change. Version 4 adds the memory/time trade-offs: ``checkpointing`` (module path of each
recomputed layer instance -> ``"full"`` or ``"selective"``), ``kept_gathers`` (module paths whose
gathered parameters are kept from the forward for the backward) and ``layer_groups`` (per group of
alike layers, what checkpointing saves and costs), and reshardings that a recomputation runs
again (``kind`` ``"recompute"``; a re-run op's weight gathers in the backward carry ``phase``); a
version 1-3 file loads with nothing recomputed or kept, as it was priced. Version 5 adds to each
``layer_groups`` entry what keeping its gathers costs and saves (``kept``, ``kept_bytes``,
``kept_time``), and plans whose ``kept_gathers`` is not empty (version 4 had the field, always
empty). It also adds the model FLOPs utilization: ``model_flops`` (per step, all devices: 3 x the
forward's matmul, convolution and attention FLOPs, recomputation not counted;
``autopar.cost_model.compute.model_flops``), ``mfu`` (model_flops / (step_time x devices x peak
FLOP/s of the compute dtype)), ``tokens_per_step`` and ``tokens_per_second_per_device``, and writes
``mesh.hardware.efficiency`` (the shape-dependent efficiency curves) where older versions wrote
``matmul_efficiency`` and ``memory_efficiency``; a version 1-4 file loads with these four at 0 (not
known), its two constants as a flat efficiency, and its layer groups as they were. Version 5 also
adds ``pipeline`` (None, or what a pipelined plan chose: the ``pp`` axis and the whole mesh's axes, the schedule,
micro-batches, virtual stages, module paths per stage, the replayed bubble and per-rank figures;
``autopar/planner/pipelined.py``); a version 1-4 file loads with ``pipeline`` None. Version 6 adds
``mesh.hardware.overlap_slowdown`` (a number in [0, 1): the fraction of compute throughput lost while
a hidden parameter gather or gradient reduction runs beside it; the plan's ``comm_time`` and
``step_time`` include that slowed compute, ``s * min(traffic, compute)`` per overlap group,
``autopar.passes.search.problem``), ``mesh_search`` (None, or for a mesh made by ``Mesh.devices``: the
device count, the node size, the factorizations into pp x dp x tp the planner compared and the one it
chose) and, in ``pipeline``, ``recompute`` (per stage, the layer instances it recomputes and in which
mode), ``batch_coupled`` (ops whose result depends on the whole batch: batch-norm statistics,
capacity-limited routing) with ``reference`` (``"whole-batch"``, or ``"micro-batched"`` when such ops
run per micro-batch), and per compared candidate ``recomputed`` and ``estimated``; a version 1-5 file
loads with ``overlap_slowdown`` at 0 (overlap priced as free, as it was), ``mesh_search`` None and those
pipeline keys absent. Version 7 adds to a link (``mesh.links.*``, ``mesh.hardware.intra_node`` and
``inter_node``) ``factors``, written only where there are any: per collective kind, what the backend's
implementation costs over its ring-formula price (``autopar.cost_model.hardware.Link``; a calibrated
gloo mesh prices reduce-scatter at about twice its ring time, as gloo runs it as an all-reduce); a
version 1-6 file has none (every kind at its ring price, as it was priced). Version 7 also adds
``pipeline.stage_buckets`` (true: the plan's gradient buckets never span pipeline stages, and each rank
runs its own stages' reductions; the reshardings a stage's recomputation runs again are listed); a
version 1-6 pipelined plan loads with it false, and its buckets are lowered as it lists them. Version 8
prices the peak as the program runs it (``autopar.cost_model.liveness``): ``memory`` adds
``temporaries`` (what lives between ops at the peak: the loss's buffers, gathered weights, collective
and bucket buffers, unreduced gradients, or the optimizer step's scratch) to the parameters,
gradients, optimizer state and activations alive at that moment, and ``peak_at`` says where in the
step the peak is; a version 1-7 file loads with ``peak_at`` empty and its memory as it was priced (a
sum of parameter state and saved activations). Version 8 also names fused attention by its device-neutral ops, ``autopar.attention.default`` and
``autopar.attention_backward.default`` (``autopar.ir.attention``), where versions 1-7 wrote the CPU
kernel's ``aten._scaled_dot_product_flash_attention_for_cpu.default`` (and ``_backward``): the same ops,
arguments and node names. A version 1-7 file loads with those op names replaced, and the lowering
accepts its graph fingerprint, which was computed under the old names. Version 9 adds to each module
entry ``attention``: every attention op's form per mesh axis (``ir.attention_forms``: batch, heads,
Ulysses, gather, ring) with what each other form would add to the step time, which ``plan.explain``
prints; a version 1-8 file loads without it (explain then names no form). Version 10 adds the
load-balanced split ``Z(d)`` (``autopar.ir.placement.Balanced``) to the placements a plan writes, in
strategies, placements and reshardings (with their ``permute`` and local reorder steps), and
``ring:balanced`` attention reads and writes it; a version 1-9 file has no ``Z`` and loads as it
was, except one that runs ``ring:balanced`` attention on plain sequence splits, which is a PlanError
naming its version (plan again). Any other version is a PlanError naming it.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Union

from autopar.errors import ArgumentError, PlanError
from autopar.plans import legacy, view
from autopar.plans.format import SOLVER_TIMING_KEYS, canon
from autopar.plans.legacy import copy_plain
from autopar.plans.bounds import check_values, read_json, shown
from autopar.plans.entries import (
    Alternative,
    Baseline,
    Collective,
    Fingerprint,
    GraphSummary,
    LayerGroupEntry,
    ModuleEntry,
    NodeEntry,
    PipelineChoice,
    Resharding,
    ReshardingStep,
    dump,
    record,
)
from autopar.plans.validate import check_fields
from autopar.validate import check_path

SCHEMA_VERSION = 10
#: the versions ``load_plan`` reads (an older one loads with the newer fields defaulted or left out)
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)


# -- entry shapes: the pydantic models of ``autopar.plans.entries``, the one description of the file's
# shapes. ``pipeline`` is held as its record; the other entries are held as the plain dicts the file
# has (readers use .get(), since hand-made plans may lack keys), and these names say their shape.

# -- the plan ---------------------------------------------------------------------------------------

@dataclass
class Plan:
    """One parallelization decision for one (graph, mesh, hardware), with its predicted costs.

    Placements are per-mesh-axis SBP text in mesh-axis order (``"S(0), B"``: sharded on dim 0
    along the first axis, broadcast along the second). Times are seconds, memory bytes per device.
    """

    # identity
    fingerprint: dict  # Fingerprint
    mesh: dict  # Mesh.to_dict(): {"axes", "device", "hardware", "links"}
    precision: dict  # Precision.to_dict()
    training: bool
    memory_budget: int
    # estimates
    step_time: float
    compute_time: float
    comm_time: float
    peak_memory: int
    memory: dict[str, int]  # params, grads, optimizer, activations, temporaries alive at the peak -> bytes
    # decisions
    placements: dict[str, str]  # FQN | "input:0" | kw name -> "S(0), B"
    nodes: list[dict]  # NodeEntry each
    reshardings: list[dict]  # Resharding each
    collectives: list[dict]  # Collective each
    bucket_size: int
    baselines: dict[str, dict]  # recipe name -> its estimate (Baseline)
    solver: dict
    source: str  # "search" | "recipe:fsdp" ...
    modules: list[dict]  # ModuleEntry each
    phases: dict[str, float]  # planning wall times: capture, fold, ..., total
    graph: dict  # GraphSummary
    # memory/time trade-offs (schema version 4; older files load with these empty)
    checkpointing: dict[str, str] = field(default_factory=dict)  # module path -> "full" | "selective"
    kept_gathers: list[str] = field(default_factory=list)  # module paths whose gathers are kept
    layer_groups: list[dict] = field(default_factory=list)  # LayerGroupEntry each
    # model FLOPs utilization (schema version 5; older files load with 0: not known)
    model_flops: float = 0.0  # per step, every device together (3 x forward matmuls + attention)
    mfu: float = 0.0  # model_flops / (step_time * devices * peak FLOP/s of the compute dtype)
    tokens_per_step: int = 0  # elements of the token-id input (0: the model takes none)
    tokens_per_second_per_device: float = 0.0
    # pipeline parallelism (schema version 5; older files load with None): see autopar/planner/pipelined.py
    pipeline: Optional[PipelineChoice] = None
    # the factorization ``Mesh.devices`` left to the planner (schema version 6; older files load with None)
    mesh_search: Optional[dict] = None
    # where in the step the peak is, e.g. "backward, at lm_head (aten.mm)" (schema version 8; older: "")
    peak_at: str = ""
    schema_version: int = field(default=SCHEMA_VERSION)

    # -- derived --------------------------------------------------------------------------------

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh axis names, in mesh order."""
        return tuple(self.mesh.get("axes", {}).keys())

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh axis sizes, in mesh order."""
        return tuple(int(v) for v in self.mesh.get("axes", {}).values())

    @property
    def run_axes(self) -> dict[str, int]:
        """The axes of the mesh the plan runs on, in order: a pipelined plan's whole mesh, ``pp`` included."""
        if self.pipeline is not None:
            return dict(zip(self.pipeline.mesh_names, self.pipeline.mesh_shape))
        return dict(zip(self.axis_names, self.mesh_shape))

    @property
    def fits(self) -> bool:
        """Whether the predicted peak memory per device is within the budget."""
        return self.peak_memory <= self.memory_budget

    def module(self, path: str) -> dict | None:
        """The ``modules`` entry for ``path``, or None."""
        return next((m for m in self.modules if m.get("path") == path), None)

    # -- persistence ----------------------------------------------------------------------------

    def to_dict(self, timing: bool = True) -> dict:
        """JSON-able deep copy; ``Plan.from_dict(p.to_dict()) == p``. Wall-clock figures go under
        ``"timing"`` (left out with ``timing=False``); ``"axis_names"`` keeps the mesh axis order,
        which sorted JSON keys would lose."""
        d: dict[str, Any] = {}
        for f in fields(self):
            if f.name != "phases":
                d[f.name] = copy_plain(getattr(self, f.name))
        if self.pipeline is not None:  # the record's keys as the file has them: None fields are not written
            d["pipeline"] = dump(self.pipeline)
        d["axis_names"] = list(self.axis_names)
        solver_timing = {k: d["solver"].pop(k) for k in SOLVER_TIMING_KEYS if k in d["solver"]}
        if timing:
            d["timing"] = {"phases": copy_plain(self.phases), "solver": solver_timing}
        return d

    @staticmethod
    def from_dict(d: Mapping) -> "Plan":
        """Inverse of ``to_dict``; checked against the plan file's schema (``autopar.plans.validate``):
        a PlanError names a schema version it does not read, missing fields, or the first field (a
        JSON path) of a wrong type or out of range, with its value. A version 1-7 plan comes back
        as version 8 (see the module's "Schema versions")."""
        if not isinstance(d, Mapping):
            raise PlanError(f"a plan is a JSON object, got {type(d).__name__}")
        if "schema_version" not in d:
            raise PlanError("not an autopar plan: it has no 'schema_version' (expected a file written by Plan.save)")
        version = d["schema_version"]
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise PlanError(f"plan schema version {shown(version)} found, this autopar reads version {SCHEMA_VERSION} "
                            f"(and the earlier {', '.join(map(str, READABLE_VERSIONS[:-1]))}): make the plan again "
                            f"with autopar.plan(...) (or use the autopar version that wrote it)")
        if version < 10:
            _no_old_balanced_ring(d, version)
        d = legacy.upgrade_hardware(d, version)
        plain = check_values(d)
        names = [f.name for f in fields(Plan) if f.name not in ("phases", "schema_version")]
        d = legacy.with_defaults(d, version)
        missing = [n for n in names if n not in d]
        if missing:
            raise PlanError(f"plan lacks the field(s) {', '.join(missing)} (schema version {version})")
        kw: dict[str, Any] = {n: copy_plain(d[n]) for n in names}
        for n, want in _FIELD_TYPES.items():
            v = kw[n]
            if want == (int,) and isinstance(v, float) and v.is_integer():
                v = kw[n] = int(v)  # a byte count written as 8e10
            ok = isinstance(v, want) and not (isinstance(v, bool) and bool not in want)
            if not ok:
                wanted = " or ".join(t.__name__ for t in want)
                raise PlanError(f"plan field {n!r} should be {wanted}, got {type(v).__name__} {shown(v)}")
            if want == (int, float):
                kw[n] = float(v)
        check_fields(d if plain else canon(d))
        order = d.get("axis_names")
        if order is not None:  # restore the mesh axis order that sorted JSON keys lost
            mesh = kw["mesh"]
            for key in ("axes", "links"):
                if isinstance(mesh.get(key), dict) and set(mesh[key]) == set(order):
                    mesh[key] = {a: mesh[key][a] for a in order}
        if kw["pipeline"] is not None:  # the entry as its record (checked above; validated once more on the way)
            kw["pipeline"] = record(PipelineChoice, kw["pipeline"] if plain else canon(kw["pipeline"]))
        if version < 3 and "links" not in kw["mesh"]:
            kw["mesh"]["links"] = legacy.links_of_old_plan(kw["mesh"])
        timing = d.get("timing") or {}
        kw["phases"] = copy_plain(timing.get("phases") or {})
        kw["solver"].update(copy_plain(timing.get("solver") or {}))
        return Plan(**kw)

    def to_json(self, timing: bool = False) -> str:
        """Canonical JSON text: identical bytes for equal plans. Without ``timing`` the planning
        wall times are left out, so runs that decide the same give the same file."""
        return json.dumps(canon(self.to_dict(timing=timing)), sort_keys=True, indent=1, separators=(",", ": ")) + "\n"

    def save(self, path: Union[str, os.PathLike], timing: bool = False) -> None:
        """Write ``to_json(timing)`` to ``path`` (through a temporary file, so a reader never sees
        half a plan)."""
        text = self.to_json(timing=timing)
        tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)

    # -- rendering (autopar.plans.view) ----------------------------------------------------------

    def summary(self, full: bool = False) -> str:
        """Terminal table by module, totals, baselines and solver figures (lines <= 120 chars)."""
        return view.summary(self, full=full)

    def explain(self, module_path: str) -> str:
        """Chosen strategy, compute time and incoming reshardings of every op in a module (or the
        module of a parameter FQN; "" is the whole model), and the module's alternatives."""
        if not isinstance(module_path, str):
            raise ArgumentError(f"Plan.explain: module_path must be a module path or a parameter FQN (a str) such as "
                                f"'blocks.0.mlp' ('' for the whole model), got {shown(module_path)} "
                                f"({type(module_path).__name__})")
        return view.explain(self, module_path)

    def diff(self, other: Union["Plan", str, os.PathLike]) -> str:
        """What differs between two plans: placements, estimates, source, mesh, precision. ``other`` is a
        Plan or a saved plan's path."""
        if isinstance(other, (str, os.PathLike)):
            other = load_plan(other)
        elif not isinstance(other, Plan):
            raise ArgumentError(f"Plan.diff: other must be a Plan or a saved plan's path, got "
                                f"{type(other).__name__} {shown(other)}")
        return view.diff(self, other)

    def export(self, format: str, model=None, example_inputs=(), example_kwargs=None, **options):
        """The plan as a layout people already run: ``"dtensor"`` (a Python module applying it with
        DTensor's module styles and FSDP2) or ``"torchtitan"`` (its job-config settings), with a report
        of the projection onto module styles and its price (``autopar.export.export``; the model and
        the plan's example inputs price the projection, and ``"dtensor"`` needs them; ``options``:
        ``tensor_parallel``)."""
        # the exporter sits above the plans (it re-runs the planner's passes): loaded by name here
        return importlib.import_module("autopar.export").export(self, format, model, example_inputs,
                                                                    example_kwargs, **options)

    def __str__(self) -> str:
        """The summary table."""
        return self.summary()

    # -- staleness ------------------------------------------------------------------------------

    def check_graph(self, graph_fingerprint: str, graph_info: Mapping) -> None:
        """Raise PlanError when the plan was made for another graph, listing what differs between
        ``self.graph`` and ``graph_info`` (same layout) so the user sees why it is stale."""
        mine = self.fingerprint.get("graph")
        if mine == graph_fingerprint:
            return
        diffs = graph_differences(self.graph, graph_info)
        if diffs:
            what = "\n  ".join(diffs)
        elif "shapes" not in self.graph:
            what = ("(no difference in parameters, inputs or op counts: the ops' attributes or connections changed, "
                    "or the parameters' shapes, which this plan (from a schema version 1 file) does not record)")
        else:
            what = "(no difference in parameters, inputs or op counts: the ops' attributes or connections changed)"
        raise PlanError(f"this plan was made for another graph (plan {str(mine)[:12]}, model {str(graph_fingerprint)[:12]}); "
                        f"what changed since the plan was made (plan -> model):\n  {what}\n"
                        f"make a new plan with autopar.plan(...)")

    def check_mesh(self, axes: Mapping[str, int]) -> None:
        """Raise PlanError unless ``axes`` (a mesh's ``{name: size}``, in mesh order) are the plan's
        own: the same names, sizes and order. Both meshes are named, and why they differ."""
        mine, theirs = dict(zip(self.axis_names, self.mesh_shape)), dict(axes)
        if list(mine.items()) == list(theirs.items()):
            return
        def text(m: Mapping) -> str:
            return " x ".join(f"{k}={v}" for k, v in m.items()) or "(no axes)"

        if mine == theirs:
            why = "the same axes in another order: placements are per axis in mesh order"
        elif set(mine) != set(theirs):
            why = f"axis names differ: the plan's {list(mine)}, the mesh's {list(theirs)}"
        else:
            why = "axis sizes differ: " + ", ".join(f"{k} {mine[k]} vs {theirs[k]}" for k in mine if mine[k] != theirs[k])
        raise PlanError(f"this plan was made for mesh {text(mine)}, not {text(theirs)} ({why}): build the mesh as "
                        f"autopar.Mesh({mine!r}, ...) or plan again for this mesh")


def graph_differences(old: Mapping, new: Mapping, limit: int = 12) -> list[str]:
    """Lines saying how graph summary ``new`` differs from ``old``: parameters added and removed,
    parameter and input shapes, node/op/parameter counts, op histogram."""
    out: list[str] = []

    def listed(items: list[str]) -> str:
        more = f", ... {len(items) - limit} more" if len(items) > limit else ""
        return ", ".join(items[:limit]) + more

    old_f, new_f = set(old.get("fqns") or ()), set(new.get("fqns") or ())
    if new_f - old_f:
        out.append(f"parameters added: {listed(sorted(new_f - old_f))}")
    if old_f - new_f:
        out.append(f"parameters removed: {listed(sorted(old_f - new_f))}")
    old_s, new_s = old.get("shapes") or {}, new.get("shapes") or {}
    changed = [f"parameter {k}: {old_s[k]} -> {new_s[k]}" for k in sorted(set(old_s) & set(new_s)) if old_s[k] != new_s[k]]
    out += changed[:limit] + ([f"... {len(changed) - limit} more parameters changed shape"] if len(changed) > limit else [])
    old_in, new_in = old.get("inputs") or {}, new.get("inputs") or {}
    for k in sorted(set(old_in) | set(new_in)):
        a, b = old_in.get(k, "(absent)"), new_in.get(k, "(absent)")
        if a != b:
            out.append(f"input {k}: {a} -> {b}")
    for k, label in (("nodes", "nodes"), ("ops", "ops"), ("params", "parameter count")):
        if old.get(k) != new.get(k):
            out.append(f"{label}: {old.get(k)} -> {new.get(k)}")
    old_h, new_h = old.get("ops_hist") or {}, new.get("ops_hist") or {}
    ops = [f"{op} {old_h.get(op, 0)} -> {new_h.get(op, 0)}"
           for op in sorted(set(old_h) | set(new_h)) if old_h.get(op, 0) != new_h.get(op, 0)]
    if ops:
        out.append(f"op counts: {listed(ops)}")
    return out


_NUM = (int, float)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "fingerprint": (dict,), "mesh": (dict,), "precision": (dict,), "training": (bool,),
    "memory_budget": (int,), "step_time": _NUM, "compute_time": _NUM, "comm_time": _NUM,
    "peak_memory": (int,), "memory": (dict,), "placements": (dict,), "nodes": (list,),
    "reshardings": (list,), "collectives": (list,), "bucket_size": (int,), "baselines": (dict,),
    "solver": (dict,), "source": (str,), "modules": (list,), "graph": (dict,),
    "checkpointing": (dict,), "kept_gathers": (list,), "layer_groups": (list,),
    "model_flops": _NUM, "mfu": _NUM, "tokens_per_step": (int,), "tokens_per_second_per_device": _NUM,
    "pipeline": (dict, type(None)),
    "mesh_search": (dict, type(None)),
}


def load_plan(path: Union[str, os.PathLike]) -> Plan:
    """Read a plan saved by ``Plan.save``; a PlanError says plainly what is wrong with the file: which
    field (a JSON path such as ``nodes[3].strategy``) holds which value (``autopar.plans.validate``)."""
    p = check_path(path, "load_plan: path")
    if not os.path.exists(p):
        raise PlanError(f"no plan file at {p!r}: make one with autopar.plan(...) and save it with plan.save(path)")
    if os.path.isdir(p):
        raise PlanError(f"{p!r} is a directory, not a plan file")
    d = read_json(p)
    try:
        return Plan.from_dict(d)
    except PlanError as e:
        raise PlanError(f"{p!r}: {e}") from None


def _no_old_balanced_ring(d: Mapping, version: int) -> None:
    """Versions 1-9 ran ``ring:balanced`` attention on plain sequence splits, permuting at the op's
    edges; version 10 lays its tensors out balanced (``Z``), so such a plan has no strategy to run."""
    nodes = d.get("nodes")
    for n in nodes if isinstance(nodes, list) else []:
        if isinstance(n, Mapping) and "ring:balanced" in (n.get("tags") or []):
            raise PlanError(f"plan schema version {version} runs {n.get('name')!r} as ring:balanced attention on "
                            f"plain sequence splits; version {SCHEMA_VERSION} lays ring:balanced out balanced (Z): "
                            "make the plan again with autopar.plan(...)")


__all__ = ["READABLE_VERSIONS", "SCHEMA_VERSION", "SOLVER_TIMING_KEYS", "Alternative", "Baseline", "Collective",
           "Fingerprint", "GraphSummary", "LayerGroupEntry", "ModuleEntry", "NodeEntry", "PipelineChoice", "Plan",
           "PlanError", "Resharding", "ReshardingStep",
           "graph_differences", "load_plan"]
