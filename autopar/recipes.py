"""Hand-written parallelism recipes as fixed placements, priced by the same evaluator as a search.

Each recipe fixes what users fix when they write it by hand — where parameters and inputs live —
and lets every op follow the cheapest way consistent with that:

- ``ddp``: parameters replicated; the batch split over every (data) axis.
- ``fsdp`` (ZeRO-3): parameters split along a dim on every data axis, gathered before use.
- ``megatron_tp``: on the tensor axis every weight matrix is split (column or row, whichever its
  neighbours make cheaper), biases and norms replicated; data axes as DDP.
- ``megatron_sp``: tensor parallel plus the sequence split on the tensor axis between blocks.
- ``fsdp_tp``: FSDP on the data axes, tensor parallel on the tensor axis (needs two axes or more).

``tensor_axis`` (default the last) names the tensor-parallel axis; the other axes are data axes.

A team's own layout is a recipe too, priced beside these and the searched plan (``plan.diff``):
``from_dtensor`` runs a torchtitan-style ``parallelize(model, device_mesh)`` function
(``parallelize_module`` styles, ``fully_shard``) on a meta copy of the model under a fake process
group and reads off every parameter's placements; ``from_torchtitan`` reads a torchtitan job
config's parallelism degrees and activation checkpointing. Both return the layout's ``Plan``
(``dtensor_layout``/``torchtitan_layout`` the ``Layout`` alone, which ``autopar.plan(recipe=...)``
takes as well).
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch

from autopar._torch_compat.layouts import recording_styles, split_dim
from autopar.api import check_plan_args, plan_with
from autopar.cost_model.mesh import Mesh, require_mesh
from autopar.errors import ArgumentError, RecipeError
from autopar.ir.placement import B, Placements, Split
from autopar.passes.search.layout import Layout
from autopar.passes.search.recipes import NAMES


def _recipe(name: str) -> Callable:
    """The public function for recipe ``name``: ``autopar.plan`` with that recipe's placements."""

    def build(model, mesh: Mesh, example_inputs=(), example_kwargs=None, *, tensor_axis=-1, **kw):
        where = f"autopar.recipes.{name}"
        if "recipe" in kw:
            raise ArgumentError(f"{where} takes no recipe= (it is the {name} recipe); call autopar.plan(..., "
                                "recipe=...) for another")
        options = check_plan_args(model, mesh, example_kwargs, dict(kw, recipe=name, tensor_axis=tensor_axis), where)
        return plan_with(model, mesh, example_inputs, example_kwargs, options)

    build.__name__ = name
    build.__doc__ = f"The {name} recipe as a Plan (see ``autopar.recipes``)."
    return build


ddp = _recipe("ddp")
fsdp = _recipe("fsdp")
megatron_tp = _recipe("megatron_tp")
megatron_sp = _recipe("megatron_sp")
fsdp_tp = _recipe("fsdp_tp")


# -- a DTensor parallelize function as a recipe --------------------------------------------------

def from_dtensor(model: torch.nn.Module, mesh: Mesh, parallelize_fn: Callable, example_inputs=(),
                 example_kwargs=None, **kw):
    """The layout ``parallelize_fn(model, device_mesh)`` makes, as a Plan priced like the recipes
    (``dtensor_layout``; the other keywords are ``autopar.plan``'s): ``searched.diff(it)`` says how
    far it is from the searched plan, its ``step_time`` how much slower."""
    layout = dtensor_layout(model, mesh, parallelize_fn)
    return _plan_layout(model, mesh, layout, example_inputs, example_kwargs, kw, "autopar.recipes.from_dtensor")


def dtensor_layout(model: torch.nn.Module, mesh: Mesh, parallelize_fn: Callable,
                   name: Optional[str] = None) -> Layout:
    """The ``Layout`` of ``parallelize_fn(model, device_mesh)``, a torchtitan-style function of
    ``parallelize_module`` (Colwise/Rowwise/SequenceParallel/PrepareModuleInput...) and
    ``fully_shard`` calls. It runs on a copy of ``model`` on the meta device (the model is left as
    it is, and nothing is allocated) with a ``DeviceMesh`` of ``mesh``'s axes over a fake process
    group (no processes, no communication; a sub-mesh such as ``device_mesh["tp"]`` or a flattened
    one works as under torchrun). Each parameter's DTensor placements become its placements on
    ``mesh``'s axes; the axes a tensor-parallel style was applied on are the tensor axes (weights
    used where they lie), those where parameters are split otherwise are FSDP's, the rest replicate
    (the batch is split over all but the tensor axes)."""
    require_mesh(mesh)
    if getattr(mesh, "factorize", None) is not None:
        raise ArgumentError("autopar.recipes.from_dtensor: give a mesh with named axes (autopar.Mesh({'dp': 4, 'tp': "
                            "2})), the axes parallelize_fn's device_mesh has; Mesh.devices leaves them to the planner")
    if not callable(parallelize_fn):
        raise ArgumentError(f"autopar.recipes.from_dtensor: parallelize_fn must be a function parallelize_fn(model, "
                            f"device_mesh), got {type(parallelize_fn).__name__}")
    fn = getattr(parallelize_fn, "__name__", None) or type(parallelize_fn).__name__
    label = name or f"dtensor:{fn}"
    with _fake_world(mesh) as device_mesh, recording_styles() as styles:
        meta = _meta_copy(model)
        try:
            out = parallelize_fn(meta, device_mesh)
        except Exception as e:
            raise RecipeError(f"autopar.recipes.from_dtensor: {fn}(model, device_mesh) raised {type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''} (it ran on a meta copy of "
                              f"the model with a fake {tuple(mesh.names)} device mesh)") from e
        meta = out if isinstance(out, torch.nn.Module) else meta
        params = _placements(meta, mesh, label)
        tensor = sorted({a for s in styles for a in _root_axes(s.mesh, mesh)})
        sequence = any(s.style == "SequenceParallel" for s in styles)
    split = {a for pl in params.values() for a, p in enumerate(pl) if isinstance(p, Split)}
    roles = tuple("tensor" if a in tensor else "shard" if a in split else "replicate" for a in range(mesh.ndim))
    return Layout(label, roles, params, sequence_parallel=sequence)


@contextlib.contextmanager
def _fake_world(mesh: Mesh) -> Iterator[Any]:
    """A ``DeviceMesh`` of ``mesh``'s axes on a fake process group of ``mesh.size`` ranks (this
    process is rank 0; collectives do nothing), torn down at the end."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise ArgumentError("autopar.recipes.from_dtensor runs parallelize_fn under a fake process group of its own: "
                            "call it in a process without a torch.distributed group (before init_process_group)")
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=mesh.size)
    try:
        yield init_device_mesh("cpu", tuple(mesh.shape), mesh_dim_names=tuple(mesh.names))
    finally:
        dist.destroy_process_group()


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on the meta device (tied ones stay
    tied); the model's own tensors are neither copied nor touched."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _root_axes(device_mesh, mesh: Mesh) -> list[int]:
    """The axes of ``mesh`` that ``device_mesh`` (the whole mesh, a sub-mesh or a flattened one)
    spans: those along which the ranks of its devices differ."""
    ranks = device_mesh.mesh.flatten().tolist()
    coords = [torch.unravel_index(torch.tensor(r), tuple(mesh.shape)) for r in ranks]
    return [a for a in range(mesh.ndim) if len({int(c[a]) for c in coords}) > 1]


def _placements(model: torch.nn.Module, mesh: Mesh, label: str) -> dict[str, Placements]:
    """Every parameter's placements on ``mesh``'s axes (by FQN, tied names each): a DTensor's
    ``Shard(d)`` (``_StridedShard`` too) splits dim ``d`` on the axes its mesh dim spans,
    ``Replicate`` and a plain parameter are whole."""
    from torch.distributed.tensor import DTensor, Replicate

    out: dict[str, Placements] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        pl: list = [B] * mesh.ndim
        if isinstance(p, DTensor):
            for i, place in enumerate(p.placements):
                sub = p.device_mesh[p.device_mesh.mesh_dim_names[i]] if p.device_mesh.ndim > 1 else p.device_mesh
                d = split_dim(place)
                if d is not None:
                    for a in _root_axes(sub, mesh):
                        pl[a] = Split(d)
                elif not isinstance(place, Replicate):
                    raise RecipeError(f"{label}: parameter {fqn!r} is {place} on mesh dim {i}; a parameter's "
                                      f"placements are Shard or Replicate")
        out[fqn] = tuple(pl)
    return out


# -- a torchtitan job config as a recipe ---------------------------------------------------------

#: torchtitan's ``[parallelism]`` degrees, in its device mesh's order, and the axis each becomes
TORCHTITAN_AXES = (("pipeline_parallel_degree", "pp"), ("data_parallel_replicate_degree", "dp_replicate"),
                   ("data_parallel_shard_degree", "dp_shard"), ("context_parallel_degree", "cp"),
                   ("tensor_parallel_degree", "tp"))
_ROLE = {"dp_replicate": "replicate", "dp_shard": "shard", "tp": "tensor"}


def torchtitan_layout(config: Union[Mapping, str, os.PathLike],
                      devices: Optional[int] = None) -> tuple[dict, Layout, dict]:
    """``(mesh axes, Layout, plan keywords)`` of a torchtitan job config (its TOML file's path, or
    the parsed dict): the ``[parallelism]`` degrees as mesh axes in torchtitan's order (``dp_replicate``
    replicates, ``dp_shard`` is FSDP, ``tp`` tensor parallel with sequence parallelism, as torchtitan's
    Llama applies them; degrees of 1 dropped; a ``data_parallel_shard_degree`` of -1 takes the
    ``devices`` left); ``[activation_checkpoint] mode`` as ``autopar.plan``'s ``checkpointing`` and
    ``fsdp_reshard_after_forward = "never"`` as ``kept_gathers="all"`` (else ``"none"``)."""
    where = "autopar.recipes.from_torchtitan"
    if isinstance(config, (str, os.PathLike)):
        import tomllib

        try:
            with open(config, "rb") as f:
                config = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ArgumentError(f"{where}: cannot read the job config {str(config)!r}: {e}") from e
    if not isinstance(config, Mapping):
        raise ArgumentError(f"{where}: config must be a torchtitan job config (a dict or a .toml path), got "
                            f"{type(config).__name__}")
    par = dict(config.get("parallelism") or {})
    degrees = {axis: par.get(key, -1 if axis == "dp_shard" else 1) for key, axis in TORCHTITAN_AXES}
    for axis, d in degrees.items():
        if isinstance(d, bool) or not isinstance(d, int) or (d < 1 and not (axis == "dp_shard" and d == -1)):
            raise ArgumentError(f"{where}: [parallelism] degree of {axis} must be a positive int (-1 for "
                                f"data_parallel_shard_degree: the devices left), got {d!r}")
    if degrees["dp_shard"] == -1:
        rest = 1
        for axis, d in degrees.items():
            rest *= d if axis != "dp_shard" else 1
        if devices is None or devices % rest:
            raise ArgumentError(f"{where}: data_parallel_shard_degree = -1 takes the devices left: give devices= (a "
                                f"multiple of {rest}), or the degree itself")
        degrees["dp_shard"] = devices // rest
    for axis, what in (("pp", "pipeline"), ("cp", "context")):
        if degrees[axis] > 1:
            raise RecipeError(f"{where}: {what} parallelism ({axis} degree {degrees[axis]}) is not priced as a layout "
                              f"yet; plan it with autopar.plan on a mesh with that axis instead")
    axes = {a: d for a, d in degrees.items() if d > 1} or {"dp_shard": 1}
    mode = str((config.get("activation_checkpoint") or {}).get("mode", "selective")).lower()
    if mode not in ("none", "full", "selective"):
        raise ArgumentError(f"{where}: [activation_checkpoint] mode {mode!r} is not none, full or selective")
    reshard = str(par.get("fsdp_reshard_after_forward", "default")).lower()
    if reshard not in ("default", "always", "never"):
        raise ArgumentError(f"{where}: [parallelism] fsdp_reshard_after_forward {reshard!r} is not default, always "
                            f"or never")
    plan_kw = {"checkpointing": mode, "kept_gathers": "all" if reshard == "never" else "none"}
    return axes, Layout("torchtitan", tuple(_ROLE[a] for a in axes)), plan_kw


def from_torchtitan(model: torch.nn.Module, config: Union[Mapping, str, os.PathLike], example_inputs=(),
                    example_kwargs=None, *, device: str = "h100", devices: Optional[int] = None, **kw):
    """A torchtitan job config's layout (``torchtitan_layout``) as a Plan on ``device``s, priced like
    the recipes; ``mesh=`` (an ``autopar.Mesh`` with the config's axes) replaces the one made of the
    degrees, to price other hardware or links. The other keywords are ``autopar.plan``'s."""
    axes, layout, plan_kw = torchtitan_layout(config, devices)
    mesh = kw.pop("mesh", None) or Mesh(axes, device=device)
    if dict(mesh.axes) != axes:
        raise ArgumentError(f"autopar.recipes.from_torchtitan: mesh {mesh.axes} is not the config's {axes}")
    kw = dict(plan_kw, **kw)
    return _plan_layout(model, mesh, layout, example_inputs, example_kwargs, kw, "autopar.recipes.from_torchtitan")


def _plan_layout(model, mesh: Mesh, layout: Layout, example_inputs, example_kwargs, kw: dict, where: str):
    """``autopar.plan`` with ``layout`` as its recipe."""
    if "recipe" in kw:
        raise ArgumentError(f"{where} takes no recipe= (the layout is the recipe)")
    options = check_plan_args(model, mesh, example_kwargs, dict(kw, recipe=layout), where)
    return plan_with(model, mesh, example_inputs, example_kwargs, options)


__all__ = ["NAMES", "TORCHTITAN_AXES", "ddp", "dtensor_layout", "from_dtensor", "from_torchtitan", "fsdp", "fsdp_tp",
           "megatron_sp", "megatron_tp", "torchtitan_layout"]
