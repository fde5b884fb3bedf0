"""Mesh: named device axes, the hardware they run on, and a link model per axis.

Ranks are laid out row-major (the last axis varies fastest, as in torch's DeviceMesh), so the
innermost axes are the ones that stay within a node. By default each axis gets one effective
``Link`` from ``axis_link``: NVLink when its group (with every inner axis) fits in a node; the
inter-node link (one NIC) when its group has one member per node; and, when the group has ``k``
members on each of ``m`` nodes, a hierarchical price (an NVLink phase over ``k`` plus an
inter-node phase over ``m`` on ``k`` NIC rails) folded into one link so the ring formulas of
``autopar.cost_model.comm`` apply unchanged (docs/design/cost_model.md, "Links"). ``Mesh({"dp": 8,
"tp": 8})`` on h100 puts tp on NVLink and dp on InfiniBand; ``Mesh({"dp": 64})`` prices dp with
eight rails. ``devices_per_node=``/``nics_per_node=`` override the hardware's; ``links=``
overrides any axis.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import operator
import os
from typing import Any, Mapping, Optional, Sequence, Union

from autopar.cost_model.hardware import Hardware, Link, get_hardware
from autopar.errors import ArgumentError, MeshError
from autopar.validate import check_path, parse_size

LinkLike = Union[Link, tuple, list, dict]


#: Mesh axis names with a meaning to the planners: ``pp`` pipelines (``autopar.planner.pipelined``);
#: the factorization search (``Mesh.devices``) names its axes ``pp`` x ``dp`` x ``tp``, data over
#: tensor parallel; a mesh of one device is ``dp=1``.
PP_AXIS = "pp"
DP_AXIS = "dp"
TP_AXIS = "tp"


class Mesh:
    """Named axes (``{"dp": 2, "tp": 4}``), the device kind and one ``Link`` per axis.

    ``axes`` may also be a torch ``DeviceMesh`` (names from ``mesh_dim_names``, else ``dim0``, ...)
    or a sequence of sizes (named ``dim0``, ...). ``device`` is a preset name (``h100``, ``h200``,
    ``a100``, ``cpu``) or a ready ``Hardware``; ``profile`` a calibrated profile file overriding the
    preset's figures; ``memory`` overrides the per-device memory (bytes, or a size such as ``"80GiB"``);
    ``devices_per_node`` and ``nics_per_node`` override the node's shape (the default links follow).
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]
    device: str
    hardware: Hardware
    links: tuple[Link, ...]

    def __init__(
        self,
        axes: Union[Mapping[str, int], Any, Sequence[int]],
        device: str = "h100",
        profile: Optional[Union[str, os.PathLike]] = None,
        links: Optional[Mapping[str, LinkLike]] = None,
        memory: Optional[Union[int, float, str]] = None,
        devices_per_node: Optional[int] = None,
        nics_per_node: Optional[int] = None,
    ) -> None:
        names, shape = _read_axes(axes)
        if isinstance(device, Hardware):  # a ready Hardware object (e.g. from a plan file)
            hw, device_name = device, device.name
        else:
            if not isinstance(device, str):
                raise MeshError(f"Mesh: device must be a preset name such as 'h100' or 'cpu' (or a Hardware), "
                                f"got {type(device).__name__}")
            try:
                if profile is not None:
                    check_path(profile, "Mesh: profile")
                hw = get_hardware(device, profile)
            except ArgumentError as e:
                raise MeshError(str(e)) from None
            except ValueError as e:
                raise MeshError(f"Mesh: {e}") from None
            device_name = str(device).lower()
        if memory is not None:
            try:
                memory = parse_size(memory, "Mesh: memory (bytes per device)")
            except ArgumentError as e:
                raise MeshError(str(e)) from None
            hw = dataclasses.replace(hw, memory=int(memory))
        hw = _node_overrides(hw, devices_per_node=devices_per_node, nics_per_node=nics_per_node)
        self._setup(names, shape, device_name, hw, _resolve_links(names, shape, hw, links))

    def _setup(self, names, shape, device, hw, links) -> None:
        self.names, self.shape, self.device, self.hardware = tuple(names), tuple(shape), device, hw
        self.links = tuple(links)
        self._dict: Optional[dict] = None
        self._fp: Optional[str] = None
        #: set by ``Mesh.devices``: the planner chooses the factorization (None: the axes are given)
        self.factorize: Optional[dict] = None

    @classmethod
    def devices(cls, count: int, device: Union[str, Hardware] = "h100", node_size: Optional[int] = None, *,
                pp: Optional[Sequence[int]] = None, tp: Optional[Sequence[int]] = None,
                profile: Optional[Union[str, os.PathLike]] = None, memory: Optional[Union[int, float, str]] = None,
                nics_per_node: Optional[int] = None) -> "Mesh":
        """``count`` devices whose factorization into pipeline x data x tensor axes (``pp`` x ``dp`` x
        ``tp``) ``autopar.plan`` chooses: it plans every sensible shape (tp within a node: a divisor of
        ``node_size``, which defaults to the preset's devices per node; pp a power of two no larger
        than the model's repeated layers; dp the rest) and keeps the fastest that fits, saying which it
        compared in ``plan.mesh_search``. ``pp`` and ``tp`` restrict the degrees tried (lists of ints).
        Until planned, the mesh is one axis ``devices`` of ``count``."""
        try:
            ok = not isinstance(count, bool) and operator.index(count) >= 1
        except TypeError:
            ok = False
        if not ok:
            raise MeshError(f"Mesh.devices: count must be a positive integer (the number of devices), got {count!r}")
        count = operator.index(count)
        mesh = cls({"devices": count}, device=device, profile=profile, memory=memory, devices_per_node=node_size,
                   nics_per_node=nics_per_node)
        node = mesh.hardware.devices_per_node
        for name, allowed in (("pp", pp), ("tp", tp)):
            if allowed is None:
                continue
            if isinstance(allowed, (str, bytes)) or not isinstance(allowed, Sequence) or not allowed or any(
                    isinstance(v, bool) or not isinstance(v, int) or v < 1 or count % v for v in allowed):
                raise MeshError(f"Mesh.devices: {name} must be a list of positive ints dividing {count}, "
                                f"got {allowed!r}")
        if tp is not None and any(node % v for v in tp):
            raise MeshError(f"Mesh.devices: tp degrees {list(tp)} must divide the node size {node} (tp stays within a "
                            f"node); pass node_size= to change it")
        mesh.factorize = {"devices": count, "node_size": node, "pp": None if pp is None else sorted(set(pp)),
                          "tp": None if tp is None else sorted(set(tp))}
        return mesh

    def factorized(self, axes: Mapping[str, int]) -> "Mesh":
        """This ``Mesh.devices(n)`` mesh as the factorization ``axes`` (a plan's choice, ``plan.run_axes``),
        on the same hardware; a MeshError when ``axes`` do not hold n devices."""
        count = math.prod(axes.values())
        if count != self.size:
            shown = " x ".join(f"{k}={v}" for k, v in axes.items())
            raise MeshError(f"this plan was made for {count} devices (mesh {shown}), not the {self.size} of "
                            f"Mesh.devices({self.size}): plan again for {self.size} devices, or run on {count}")
        return Mesh(dict(axes), device=self.hardware)

    # -- geometry ---------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of devices."""
        return math.prod(self.shape)

    def axis(self, name_or_index: Union[str, int]) -> int:
        """The index of an axis given by name or by (possibly negative) index."""
        if isinstance(name_or_index, str):
            if name_or_index not in self.names:
                raise MeshError(f"the mesh has no axis {name_or_index!r}; its axes are {list(self.names)}")
            return self.names.index(name_or_index)
        if isinstance(name_or_index, bool) or not isinstance(name_or_index, int):
            raise MeshError(f"a mesh axis is a name or an int index, got {name_or_index!r}")
        if not -self.ndim <= name_or_index < self.ndim:
            raise MeshError(f"axis index {name_or_index} is out of range for a mesh with {self.ndim} axes {list(self.names)}")
        return name_or_index % self.ndim

    def axis_size(self, name_or_index: Union[str, int]) -> int:
        """The size of an axis given by name or index."""
        return self.shape[self.axis(name_or_index)]

    def link(self, name_or_index: Union[str, int]) -> Link:
        """The link figures of an axis given by name or index."""
        return self.links[self.axis(name_or_index)]

    @property
    def axes(self) -> dict[str, int]:
        """Axis name -> size, in axis order."""
        return dict(zip(self.names, self.shape))

    # -- serialisation ----------------------------------------------------------------------

    def to_dict(self) -> dict:
        """JSON-able; ``Mesh.from_dict(m.to_dict()) == m`` (hardware figures and links included)."""
        if self._dict is None:
            self._dict = {
                "axes": dict(zip(self.names, self.shape)),
                "device": self.device,
                "hardware": self.hardware.to_dict(),
                "links": {n: link.to_dict() for n, link in zip(self.names, self.links)},
            }
        return json.loads(json.dumps(self._dict))  # a copy the caller may change

    @staticmethod
    def from_dict(d: Mapping) -> "Mesh":
        """The mesh a plan describes (``to_dict``'s inverse); a ``MeshError`` names what is wrong."""
        try:
            names, shape = _read_axes(d["axes"])
            hw = Hardware.from_dict(d["hardware"])
            links = _resolve_links(names, shape, hw, d.get("links"))
            device = str(d["device"])
        except KeyError as e:
            raise MeshError(f"mesh description lacks the key {e.args[0]!r} (expected axes, device, hardware, links)") from None
        except ValueError as e:
            if isinstance(e, MeshError):
                raise
            raise MeshError(f"mesh description: {e}") from None
        m = Mesh.__new__(Mesh)
        m._setup(names, shape, device, hw, links)
        return m

    def fingerprint(self) -> str:
        """sha256 hex digest of the canonical JSON of ``to_dict()`` (keys sorted, axis order kept)."""
        if self._fp is None:
            d = self.to_dict()  # axis order matters: lists of pairs, since sort_keys would lose it
            d["axes"], d["links"] = list(map(list, d["axes"].items())), list(map(list, d["links"].items()))
            text = json.dumps(d, sort_keys=True, separators=(",", ":"))
            self._fp = hashlib.sha256(text.encode()).hexdigest()
        return self._fp

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return self is other or self.fingerprint() == other.fingerprint()

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def __repr__(self) -> str:
        return f"Mesh({dict(zip(self.names, self.shape))!r}, device={self.device!r})"

# ---------------------------------------------------------------------------------------------


def require_mesh(mesh: object) -> Mesh:
    """``mesh`` itself when it is an ``autopar.Mesh``; a clear ``TypeError`` otherwise."""
    if not isinstance(mesh, Mesh):
        raise ArgumentError(f"mesh must be an autopar.Mesh, got {type(mesh).__name__}: build one, e.g. "
                            "autopar.Mesh({'dp': 2, 'tp': 4}, device='h100')")
    return mesh


def _read_axes(axes: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Names and sizes from a dict, a torch DeviceMesh or a sequence of sizes; checked."""
    if isinstance(axes, Mesh):
        return axes.names, axes.shape
    if isinstance(axes, Mapping):
        names, sizes = list(axes.keys()), list(axes.values())
    elif hasattr(axes, "mesh_dim_names") and hasattr(axes, "shape"):  # torch DeviceMesh
        sizes = list(axes.shape)
        names = list(axes.mesh_dim_names) if axes.mesh_dim_names else [f"dim{i}" for i in range(len(sizes))]
    elif isinstance(axes, (list, tuple)):  # sizes only: the axes are named dim0, dim1, ...
        sizes = list(axes)
        names = [f"dim{i}" for i in range(len(sizes))]
        if any(isinstance(s, str) for s in sizes):
            raise MeshError(f"Mesh axes given as a list are sizes (named dim0, dim1, ...), got {list(axes)!r}: for "
                            "named axes pass a dict, e.g. Mesh({'dp': 2, 'tp': 4})")
    else:
        raise MeshError(
            f"Mesh axes must be a dict of name -> size, a torch DeviceMesh or a list of sizes, got {type(axes).__name__}"
        )
    if not sizes:
        raise MeshError("Mesh needs at least one axis, e.g. Mesh({'dp': 8})")
    for n in names:
        if not isinstance(n, str) or not n.isidentifier():
            raise MeshError(f"mesh axis name {n!r} is not a Python identifier; use names like 'dp', 'tp'")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise MeshError(f"mesh axis names must be distinct; {dup} appear more than once")
    for n, s in zip(names, sizes):
        try:
            ok = not isinstance(s, bool) and operator.index(s) >= 1  # ints, numpy ints; not floats
        except TypeError:
            ok = False
        if not ok:
            raise MeshError(f"mesh axis {n!r} has size {s!r}; sizes are positive integers (use 1 for an unused axis)")
    return tuple(names), tuple(operator.index(s) for s in sizes)


def _node_overrides(hw: Hardware, **counts: Optional[int]) -> Hardware:
    """``hw`` with the node counts given (positive integers) replaced; a MeshError names a bad one."""
    for name, value in counts.items():
        if value is None:
            continue
        try:
            ok = not isinstance(value, bool) and operator.index(value) >= 1
        except TypeError:
            ok = False
        if not ok:
            raise MeshError(f"Mesh: {name} must be a positive integer (a count per node), got {value!r}")
        hw = dataclasses.replace(hw, **{name: operator.index(value)})
    return hw


def node_layout(n: int, inner: int, devices_per_node: int) -> tuple[int, int]:
    """``(k, m)`` for an axis of ``n`` devices whose inner axes span ``inner`` ranks: each group has
    ``k`` members per node on ``m`` nodes. Where ``inner`` does not divide the node or ``k`` does
    not divide ``n``, the regular layout's figures (``k`` rounded down, ``m`` up)."""
    k = max(1, min(n, devices_per_node // inner))
    return k, -(-n // k)


def axis_link(n: int, inner: int, hw: Hardware) -> Link:
    """The one link whose ring formulas price an axis of ``n`` devices (inner span ``inner``) on
    ``hw``'s nodes: all-gathers and reduce-scatters exactly as the hierarchical collective (an
    NVLink phase over the ``k`` members of a node, then an inter-node phase over ``m`` nodes on
    ``k`` rails, fewer where the node has fewer NICs than devices); see docs/design/cost_model.md, "Links"."""
    k, m = node_layout(n, inner, hw.devices_per_node)
    if m == 1:
        return hw.intra_node
    share = min(1.0, hw.nics_per_node / hw.devices_per_node)  # rails per device, at most one
    ai, bi = hw.intra_node.latency, hw.intra_node.bandwidth
    ae, be = hw.inter_node.latency, hw.inter_node.bandwidth
    if k == 1:
        return hw.inter_node if share == 1.0 else Link(ae, be * share, hw.inter_node.factors)
    inter_s, intra_s = (m - 1) / m / (k * share * be), (k - 1) / k / bi  # seconds per byte of each phase
    seconds_per_byte = inter_s + intra_s
    return Link((m * ae + k * ai) / n, (n - 1) / n / seconds_per_byte,
                _phase_factors(hw.inter_node, hw.intra_node, inter_s / seconds_per_byte))


def _phase_factors(inter: Link, intra: Link, inter_share: float) -> dict[str, float]:
    """Per-kind factors (``Link.factors``) of a two-phase collective: each kind's factor on each
    phase, weighted by the share of the bytes' time the phase takes (the kinds either link has)."""
    kinds = sorted({k for k, _ in inter.factors} | {k for k, _ in intra.factors})
    return {k: inter_share * inter.factor(k) + (1.0 - inter_share) * intra.factor(k) for k in kinds}


def default_links(shape: Sequence[int], hw: Hardware) -> list[Link]:
    """``axis_link`` for every axis, each with the span of the axes after it as its inner span."""
    out: list[Link] = []
    for a, n in enumerate(shape):
        out.append(axis_link(n, math.prod(shape[a + 1:]), hw))
    return out


def _resolve_links(names, shape, hw: Hardware, links: Optional[Mapping[str, LinkLike]]) -> list[Link]:
    out = default_links(shape, hw)
    if links is None:
        return out
    if not isinstance(links, Mapping):
        raise MeshError("links must be a dict of axis name -> Link(latency, bandwidth) or (latency, bandwidth)")
    for name, value in links.items():
        if name not in names:
            raise MeshError(f"links names axis {name!r}, but the mesh's axes are {list(names)}")
        try:
            out[list(names).index(name)] = Link.from_dict(value)
        except (ValueError, TypeError) as e:
            raise MeshError(f"link of axis {name!r}: {e} (latency in seconds, bandwidth in bytes/s, both > 0)") from None
    return out


__all__ = ["DP_AXIS", "Mesh", "MeshError", "PP_AXIS", "TP_AXIS", "axis_link", "default_links", "node_layout"]
