"""What older plan schema versions lack, supplied as such a file loads (``schema.Plan.from_dict``):
the fields each later version added, at the values the older file was priced with."""

from __future__ import annotations

from typing import Any, Mapping

from autopar.ir.attention import LEGACY_NAMES


def copy_plain(x: Any) -> Any:
    """A deep copy of plain data (dicts, lists, tuples as lists), numbers untouched."""
    if type(x) in (str, int, float, bool) or x is None:  # the usual leaves, without the ABC checks below
        return x
    if isinstance(x, Mapping):
        return {k: copy_plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [copy_plain(v) for v in x]
    return x


#: the fields version 4 added, as an older plan (priced without them) has them
_V4_DEFAULTS: dict[str, Any] = {"checkpointing": {}, "kept_gathers": [], "layer_groups": []}
#: the fields version 5 added, as an older plan has them (0: not known)
_V5_DEFAULTS: dict[str, Any] = {"model_flops": 0.0, "mfu": 0.0, "tokens_per_step": 0, "tokens_per_second_per_device": 0.0,
                                "pipeline": None}
#: fields schema version 6 added, as a version 1-5 file loads them
_V6_DEFAULTS: dict[str, Any] = {"mesh_search": None}
_V8_DEFAULTS: dict[str, Any] = {"peak_at": ""}


def _attention_of_old_plan(d: Mapping) -> Mapping:
    """A version 1-7 plan with its fused attention ops under the names version 8 captures them as
    (``autopar.ir.attention``): the same ops, arguments and node names, so it lowers as it was made."""
    new = {old: name for name, old in LEGACY_NAMES.items()}
    nodes, graph = d.get("nodes"), d.get("graph")
    if isinstance(nodes, list):
        d = {**d, "nodes": [{**n, "op": new.get(n.get("op"), n.get("op"))} if isinstance(n, Mapping) else n
                            for n in nodes]}
    hist = graph.get("ops_hist") if isinstance(graph, Mapping) else None
    if isinstance(hist, Mapping):
        d = {**d, "graph": {**graph, "ops_hist": dict(sorted((new.get(k, k), v) for k, v in hist.items()))}}
    return d


def _nics_of_old_plan(d: Mapping) -> Mapping:
    """A version 1 or 2 plan with ``mesh.hardware.nics_per_node`` set to its ``devices_per_node``
    (one NIC per device, what those versions priced with); ``d`` itself when it has no such place
    (the schema check then says what is wrong)."""
    mesh = d.get("mesh")
    hw = mesh.get("hardware") if isinstance(mesh, Mapping) else None
    if not isinstance(hw, Mapping) or "devices_per_node" not in hw or "nics_per_node" in hw:
        return d
    return {**d, "mesh": {**mesh, "hardware": {**hw, "nics_per_node": hw["devices_per_node"]}}}


def _overlap_of_old_plan(d: Mapping) -> Mapping:
    """A version 1-5 plan with ``mesh.hardware.overlap_slowdown`` 0 (those versions priced hidden
    communication as free); ``d`` itself when it has no such place (the schema check then says
    what is wrong) or already gives one."""
    mesh = d.get("mesh")
    hw = mesh.get("hardware") if isinstance(mesh, Mapping) else None
    if not isinstance(hw, Mapping) or "overlap_slowdown" in hw:
        return d
    return {**d, "mesh": {**mesh, "hardware": {**hw, "overlap_slowdown": 0.0}}}


def links_of_old_plan(mesh: Mapping) -> dict:
    """The links versions 1 and 2 gave a mesh without ``links``: ``intra_node`` for an axis whose
    devices, with every inner axis's, fit in one node, ``inter_node`` otherwise."""
    hw, axes = mesh["hardware"], list(mesh["axes"].items())
    links, span = {}, 1
    for name, size in reversed(axes):
        span *= size
        links[name] = copy_plain(hw["intra_node"] if span <= hw["devices_per_node"] else hw["inter_node"])
    return {name: links[name] for name, _ in axes}


def upgrade_hardware(d: Mapping, version: int) -> Mapping:
    """``d`` (a plan of schema ``version``) with the hardware fields later versions added, before
    the schema check: ``nics_per_node`` (version 3), ``overlap_slowdown`` (version 6). Version 7's
    per-kind link ``factors`` need nothing here: a link without them prices every kind at its ring
    time, as versions 1-6 did (``autopar.cost_model.hardware.Link``)."""
    if version < 3:
        d = _nics_of_old_plan(d)
    if version < 6:
        d = _overlap_of_old_plan(d)
    return d


def with_defaults(d: Mapping, version: int) -> Mapping:
    """``d`` with the top-level fields versions 4-8 added, where it lacks them, a version 1-6
    pipelined plan's ``pipeline.stage_buckets`` false (its buckets may span stages: lowered as listed)
    and a version 1-7 plan's attention ops renamed (version 8)."""
    for since, defaults in ((4, _V4_DEFAULTS), (5, _V5_DEFAULTS), (6, _V6_DEFAULTS), (8, _V8_DEFAULTS)):
        if version < since:
            d = {**d, **{k: copy_plain(v) for k, v in defaults.items() if k not in d}}
    if version < 8:
        d = _attention_of_old_plan(d)
    pipeline = d.get("pipeline")
    if version < 7 and isinstance(pipeline, Mapping) and "stage_buckets" not in pipeline:
        d = {**d, "pipeline": {**pipeline, "stage_buckets": False}}
    return d


__all__ = ["copy_plain", "links_of_old_plan", "upgrade_hardware", "with_defaults"]
