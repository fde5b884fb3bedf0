"""Mesh: axes, default links per axis, overrides, JSON round trip, torch DeviceMesh, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from autopar.cost_model.hardware import PRESETS, Link, save_profile
from autopar.errors import AutoparError
from autopar.cost_model.mesh import Mesh, MeshError

H100 = PRESETS["h100"]


def test_basic_geometry_and_repr():
    m = Mesh({"dp": 2, "tp": 4})
    assert m.names == ("dp", "tp") and m.shape == (2, 4) and m.ndim == 2 and m.size == 8
    assert m.device == "h100" and m.hardware == H100
    assert repr(m) == "Mesh({'dp': 2, 'tp': 4}, device='h100')"
    assert m.axis("tp") == 1 and m.axis(0) == 0 and m.axis(-1) == 1 and m.axis(-2) == 0
    with pytest.raises(MeshError, match="no axis 'pp'"):
        m.axis("pp")
    with pytest.raises(MeshError, match="out of range"):
        m.axis(2)


def test_sequence_axes_are_named_dim_i():
    m = Mesh([2, 3], device="cpu")
    assert m.names == ("dim0", "dim1") and m.shape == (2, 3)


def test_default_links_inner_axes_on_nvlink():
    m = Mesh({"dp": 8, "tp": 8})
    assert m.links == (H100.inter_node, H100.intra_node)
    m = Mesh({"dp": 2, "tp": 4})  # 8 devices: one node
    assert m.links == (H100.intra_node, H100.intra_node)
    m = Mesh({"pp": 2, "dp": 4, "tp": 4})  # tp 4, dp*tp 16 > 8: dp has 2 members on each of 2 nodes
    assert m.links[0] == H100.inter_node and m.links[2] == H100.intra_node
    # dp is hierarchical (docs/design/cost_model.md, "Links"): alpha (2 * 10 + 2 * 4) us / 4, and
    # beta = (3/4) / ((1/2) / (2 rails * 48 GB/s) + (1/2) / 360 GB/s)
    assert m.links[1].latency == pytest.approx(7e-6, rel=1e-12)
    assert m.links[1].bandwidth == pytest.approx(0.75 / (0.5 / 96e9 + 0.5 / 360e9), rel=1e-12)
    m = Mesh({"dp": 16}, device="cpu")  # cpu: every axis intra
    assert m.links == (PRESETS["cpu"].intra_node,)


def test_link_overrides_and_memory():
    ib = Link(10e-6, 50e9)
    m = Mesh({"dp": 2, "tp": 4}, links={"dp": ib, "tp": (3e-6, 400e9)}, memory=40_000_000_000)
    assert m.links == (ib, Link(3e-6, 400e9))
    assert m.link("tp") == Link(3e-6, 400e9)
    assert m.hardware.memory == 40_000_000_000 and m.hardware.peak_flops == H100.peak_flops


def test_round_trip_and_fingerprint():
    m = Mesh({"dp": 2, "tp": 4}, device="a100", links={"dp": (1e-5, 2.5e10)}, memory=12345)
    d = json.loads(json.dumps(m.to_dict()))
    m2 = Mesh.from_dict(d)
    assert m2 == m and m2.to_dict() == m.to_dict() and m2.links == m.links and m2.hardware == m.hardware
    assert m2.fingerprint() == m.fingerprint() and len(m.fingerprint()) == 64
    assert hash(m2) == hash(m)
    assert Mesh({"dp": 2, "tp": 4}, device="a100") != m
    assert Mesh({"tp": 4, "dp": 2}, device="a100").fingerprint() != Mesh({"dp": 2, "tp": 4}, device="a100").fingerprint()


def test_profile_overrides_preset(tmp_path):
    hw = PRESETS["cpu"]
    import dataclasses

    custom = dataclasses.replace(hw, name="mybox", hbm_bandwidth=3e9)
    save_profile(custom, tmp_path / "p.json", base="cpu")
    m = Mesh({"dp": 2}, device="cpu", profile=tmp_path / "p.json")
    assert m.hardware == custom and m.device == "cpu"
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"hbm_bandwidth": 1e12}))
    m = Mesh({"dp": 2}, device="h100", profile=partial)
    assert m.hardware.hbm_bandwidth == 1e12 and m.hardware.peak_flops == H100.peak_flops


@pytest.mark.parametrize(
    "axes,kw,match",
    [
        ({}, {}, "at least one axis"),
        ([], {}, "at least one axis"),
        ({"dp": 0}, {}, "positive integers"),
        ({"dp": 2.0}, {}, "positive integers"),
        ({"dp": True}, {}, "positive integers"),
        ({"dp": "2"}, {}, "positive integers"),
        ({"d p": 2}, {}, "identifier"),
        ({"1dp": 2}, {}, "identifier"),
        ({"dp": 2}, {"device": "tpu"}, "unknown device 'tpu'.*h100"),
        ({"dp": 2}, {"links": {"tp": (1e-6, 1e9)}}, "names axis 'tp'"),
        ({"dp": 2}, {"links": {"dp": (0.0, 1e9)}}, "latency"),
        ({"dp": 2}, {"links": {"dp": (1e-6, -1.0)}}, "bandwidth"),
        ({"dp": 2}, {"memory": -1}, "memory"),
        ("dp", {}, "dict of name"),
    ],
)
def test_errors(axes, kw, match):
    with pytest.raises(MeshError, match=match) as info:
        Mesh(axes, **kw)
    assert isinstance(info.value, AutoparError) and isinstance(info.value, ValueError)


def test_duplicate_names_from_sequence_of_pairs():
    class FakeDM:  # duck-typed DeviceMesh with duplicate names
        shape = (2, 2)
        mesh_dim_names = ("dp", "dp")

    with pytest.raises(MeshError, match="distinct"):
        Mesh(FakeDM())


def test_from_torch_device_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        dm = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        m = Mesh(dm, device="h100")
        assert m.names == ("dp", "tp") and m.shape == (2, 4)
        dm2 = init_device_mesh("cpu", (8,))
        assert Mesh(dm2).names == ("dim0",) and Mesh(dm2).shape == (8,)
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()
    assert torch.distributed.is_available()
