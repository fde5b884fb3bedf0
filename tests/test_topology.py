"""Topology: devices and NIC rails per node, the effective link of an axis (one member per node,
inside a node, hierarchical), overrides and errors, the mesh round trip, and old plans and profiles."""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib

import pytest

from autopar.cost_model.comm import collective_time
from autopar.cost_model.hardware import PRESETS, Hardware, Link, get_hardware, load_profile, save_profile
from autopar.cost_model.mesh import Mesh, MeshError, axis_link, node_layout
from autopar.plans import SCHEMA_VERSION, Plan, PlanError, load_plan

H100 = PRESETS["h100"]
NVLINK, IB = H100.intra_node, H100.inter_node
V2_PLAN = pathlib.Path(__file__).parent / "data" / "plan_v2_mlp_h100_dp4_tp4.json"


def test_presets_have_eight_gpus_and_eight_nics_per_node():
    for name in ("h100", "h200", "a100"):
        hw = PRESETS[name]
        assert (hw.devices_per_node, hw.nics_per_node) == (8, 8)
        assert hw.to_dict()["nics_per_node"] == 8 and Hardware.from_dict(hw.to_dict()) == hw
    assert PRESETS["h100"].inter_node == Link(10e-6, 48e9)  # still one NIC (one rail)


@pytest.mark.parametrize("n, inner, d, want", [
    (8, 1, 8, (8, 1)),  # one node
    (64, 1, 8, (8, 8)),  # 8 members on each of 8 nodes
    (8, 8, 8, (1, 8)),  # (dp=8, tp=8): dp has one member per node
    (4, 4, 8, (2, 2)),
    (3, 16, 8, (1, 3)),
    (6, 1, 8, (6, 1)),  # fits: 6 <= 8
    (12, 1, 8, (8, 2)),  # 8 does not divide 12: the regular layout's figures (k down, m up)
    (5, 3, 8, (2, 3)),  # 3 does not divide 8: k = 8 // 3
    (4, 12, 8, (1, 4)),
])
def test_node_layout(n, inner, d, want):
    assert node_layout(n, inner, d) == want


def test_one_member_per_node_is_the_inter_node_link():
    m = Mesh({"dp": 8, "tp": 8})
    assert m.link("dp") == IB and m.link("tp") == NVLINK
    assert Mesh({"dp": 4}, devices_per_node=1).links == (IB,)
    assert Mesh({"pp": 4, "dp": 2, "tp": 8}).links == (IB, IB, NVLINK)
    # fewer NICs than devices: a device gets its share of a rail
    assert Mesh({"dp": 8, "tp": 8}, nics_per_node=4).link("dp") == Link(10e-6, 24e9)


def test_a_group_inside_a_node_is_nvlink():
    assert Mesh({"dp": 8}).links == (NVLINK,)
    assert Mesh({"dp": 2, "tp": 4}).links == (NVLINK, NVLINK)
    assert Mesh({"dp": 16}, devices_per_node=16).links == (NVLINK,)
    assert Mesh({"dp": 16}, device="cpu").links == (PRESETS["cpu"].intra_node,)


def test_dp64_on_8_gpu_nodes_is_hierarchical():
    """The worked example of docs/design/cost_model.md, "Links"."""
    link = Mesh({"dp": 64}).link("dp")
    assert link.latency == pytest.approx((8 * 10e-6 + 8 * 4e-6) / 64, rel=1e-12)  # 1.75 us
    assert link.bandwidth == pytest.approx((63 / 64) / (7 / 8 / (8 * 48e9) + 7 / 8 / 360e9), rel=1e-12)
    assert 209e9 < link.bandwidth < 210e9
    assert link.bandwidth > 4 * IB.bandwidth  # far better than one NIC per GPU, worse than NVLink


def _hierarchical(kind: str, nbytes: float, k: int, m: int, hw: Hardware) -> float:
    """The two-phase collective timed phase by phase: the inter-node ring over m nodes with k rails
    (the node's share of NICs), and the NVLink ring over the k members of a node."""
    share = min(1.0, hw.nics_per_node / hw.devices_per_node)
    rails = Link(hw.inter_node.latency, hw.inter_node.bandwidth * k * share)
    return collective_time(kind, nbytes, m, rails) + collective_time(kind, nbytes, k, hw.intra_node)


@pytest.mark.parametrize("axes, axis, nics, k, m", [
    ({"dp": 64}, "dp", 8, 8, 8),
    ({"dp": 512}, "dp", 8, 8, 64),
    ({"dp": 16, "tp": 2}, "dp", 8, 4, 4),
    ({"dp": 4, "tp": 4}, "dp", 8, 2, 2),
    ({"dp": 64}, "dp", 2, 8, 8),  # two NICs for eight GPUs: two rails per group
    ({"pp": 2, "dp": 32, "tp": 2}, "dp", 8, 4, 8),
])
@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_effective_link_prices_gathers_as_the_hierarchical_collective(axes, axis, nics, k, m, kind):
    mesh = Mesh(axes, nics_per_node=nics)
    n = mesh.axis_size(axis)
    inner = 1
    for size in list(mesh.shape)[mesh.axis(axis) + 1:]:
        inner *= size
    assert node_layout(n, inner, 8) == (k, m)
    for nbytes in (1.0, 3e6, 2.6e10):
        want = _hierarchical(kind, nbytes, k, m, mesh.hardware)
        assert collective_time(kind, nbytes, n, mesh.link(axis)) == pytest.approx(want, rel=1e-9)
    # and not the flat ring at one NIC per GPU (what the mesh priced before)
    assert collective_time(kind, 1e9, n, mesh.link(axis)) < collective_time(kind, 1e9, n, IB)


def test_all_reduce_bandwidth_is_exact_and_latency_within_one_inter_node_step():
    hw, k, m = H100, 8, 8
    link = axis_link(64, 1, hw)
    rails = Link(IB.latency, IB.bandwidth * k)
    # reduce-scatter in the node, all-reduce across nodes on k rails (1/k of the bytes each), all-gather in the node
    bw = 2 * (k - 1) / k / NVLINK.bandwidth + 2 * (m - 1) / m / rails.bandwidth
    lat = 2 * k * NVLINK.latency + (2 * m - 1) * IB.latency
    for nbytes in (1e6, 1e10):
        got = collective_time("all_reduce", nbytes, 64, link)
        assert got - (2 * 64 - 1) * link.latency == pytest.approx(nbytes * bw, rel=1e-9)
        assert abs(got - (lat + nbytes * bw)) <= IB.latency


def test_explicit_links_still_override_an_axis():
    m = Mesh({"dp": 64}, links={"dp": (1e-5, 5e10)})
    assert m.links == (Link(1e-5, 5e10),) and m.links != (IB,)
    m = Mesh({"dp": 8, "tp": 8}, nics_per_node=1, links={"tp": (3e-6, 400e9)})
    assert m.links == (Link(10e-6, 48e9 / 8), Link(3e-6, 400e9))


def test_node_overrides_change_the_hardware_and_the_default_links():
    m = Mesh({"dp": 64}, devices_per_node=4, nics_per_node=2)
    assert (m.hardware.devices_per_node, m.hardware.nics_per_node) == (4, 2)
    assert m.hardware.peak_flops == H100.peak_flops and m.hardware.name == "h100"
    assert m.link("dp") == axis_link(64, 1, m.hardware) != Mesh({"dp": 64}).link("dp")
    # k = 4 members on 16 nodes, half a rail each: two rails per group
    want = (15 / 16 / (2 * 48e9) + 3 / 4 / 360e9)
    assert m.link("dp").bandwidth == pytest.approx(63 / 64 / want, rel=1e-12)
    assert Mesh({"dp": 2}, device=H100, nics_per_node=1).hardware.nics_per_node == 1  # a ready Hardware too


@pytest.mark.parametrize("kw, match", [
    ({"devices_per_node": 0}, "devices_per_node must be a positive integer"),
    ({"devices_per_node": -8}, "devices_per_node must be a positive integer"),
    ({"devices_per_node": 2.5}, "devices_per_node must be a positive integer"),
    ({"devices_per_node": True}, "devices_per_node must be a positive integer"),
    ({"devices_per_node": "8"}, "devices_per_node must be a positive integer"),
    ({"nics_per_node": 0}, "nics_per_node must be a positive integer"),
    ({"nics_per_node": 8.0}, "nics_per_node must be a positive integer"),
    ({"nics_per_node": None, "devices_per_node": [8]}, "devices_per_node must be a positive integer"),
])
def test_bad_node_counts_are_mesh_errors(kw, match):
    with pytest.raises(MeshError, match=match):
        Mesh({"dp": 16}, **kw)


def test_hardware_without_nics_per_node_is_refused():
    d = H100.to_dict()
    del d["nics_per_node"]
    with pytest.raises(ValueError, match=r"missing fields \['nics_per_node'\]"):
        Hardware.from_dict(d)
    with pytest.raises(ValueError, match="nics_per_node must be positive"):
        Hardware.from_dict({**H100.to_dict(), "nics_per_node": 0})


def test_round_trip_keeps_the_node_shape_and_links():
    m = Mesh({"pp": 2, "dp": 16, "tp": 2}, device="a100", devices_per_node=4, nics_per_node=2)
    d = json.loads(json.dumps(m.to_dict()))
    assert d["hardware"]["devices_per_node"] == 4 and d["hardware"]["nics_per_node"] == 2
    m2 = Mesh.from_dict(d)
    assert m2 == m and m2.links == m.links and m2.hardware == m.hardware and m2.to_dict() == m.to_dict()
    assert m.fingerprint() != Mesh({"pp": 2, "dp": 16, "tp": 2}, device="a100", devices_per_node=4).fingerprint()


def test_profiles_of_version_1_load_with_one_nic_per_device(tmp_path):
    old = {k: v for k, v in {"autopar_profile": 1, **H100.to_dict(), "devices_per_node": 4}.items()
           if k != "nics_per_node"}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(old))
    hw = load_profile(path)
    assert (hw.devices_per_node, hw.nics_per_node) == (4, 4)
    assert get_hardware("h100", path).nics_per_node == 4
    partial = tmp_path / "partial.json"  # no node figures at all: the preset's
    partial.write_text(json.dumps({"hbm_bandwidth": 1e12}))
    assert get_hardware("h100", partial).nics_per_node == 8
    save_profile(hw, tmp_path / "v2.json", base="h100")
    saved = json.loads((tmp_path / "v2.json").read_text())
    assert saved["autopar_profile"] == 4 and saved["nics_per_node"] == 4
    assert load_profile(tmp_path / "v2.json") == hw


# -- plans written before schema version 3 ----------------------------------------------------------

def _v2() -> dict:
    return json.loads(V2_PLAN.read_text(encoding="utf-8"))


def test_a_saved_version_2_plan_loads_with_its_prices():
    """A plan saved by schema version 2 (a tiny MLP on an h100 (dp=4, tp=4) mesh): its links are
    the ones written (dp one NIC per GPU), so every collective prices as it did."""
    d = _v2()
    assert d["schema_version"] == 2 and "nics_per_node" not in d["mesh"]["hardware"]
    plan = load_plan(V2_PLAN)
    assert plan.schema_version == SCHEMA_VERSION
    assert plan.mesh["hardware"]["nics_per_node"] == plan.mesh["hardware"]["devices_per_node"] == 8
    mesh = Mesh.from_dict(plan.mesh)
    # the h100 figures it was saved with (the preset's line rates then), not today's preset
    ib, nvlink = (Link.from_dict(d["mesh"]["hardware"][k]) for k in ("inter_node", "intra_node"))
    assert (ib, nvlink) == (Link(10e-6, 50e9), Link(4e-6, 450e9)) and (ib, nvlink) != (IB, NVLINK)
    assert mesh.link("dp") == ib and mesh.link("tp") == nvlink
    assert Mesh(mesh.axes, device="h100").link("dp") != ib  # today's default for dp would differ
    steps = [(s, r) for r in plan.reshardings for s in r["steps"]]
    assert sum(s["axis"] == "dp" and s["kind"] == "all_reduce" for s, _ in steps) >= 1
    for s, _ in steps:
        n = mesh.axis_size(s["axis"])
        assert collective_time(s["kind"], s["bytes"], n, mesh.link(s["axis"])) == pytest.approx(s["time"], rel=1e-9)
    assert plan.step_time == d["step_time"] and plan.placements == d["placements"]


def test_a_version_2_plan_saves_as_version_3_and_loads_again(tmp_path):
    plan = load_plan(V2_PLAN)
    plan.save(tmp_path / "v3.json")
    again = json.loads((tmp_path / "v3.json").read_text(encoding="utf-8"))
    assert again["schema_version"] == SCHEMA_VERSION and again["mesh"]["hardware"]["nics_per_node"] == 8
    assert load_plan(tmp_path / "v3.json") == plan


def test_a_version_2_plan_without_links_gets_the_links_it_was_priced_with():
    d = _v2()
    del d["mesh"]["links"]
    plan = Plan.from_dict(d)
    hw = d["mesh"]["hardware"]  # the figures it was saved with (450 GB/s NVLink, 50 GB/s NIC)
    assert plan.mesh["links"] == {"dp": hw["inter_node"], "tp": hw["intra_node"]}
    assert Link.from_dict(hw["intra_node"]) == Link(4e-6, 450e9) != NVLINK
    assert list(plan.mesh["links"]) == list(plan.mesh["axes"]) == ["dp", "tp"]


def test_a_version_3_plan_must_give_nics_per_node():
    d = _v2()
    d["schema_version"] = 3
    with pytest.raises(PlanError, match=r"mesh\.hardware.*nics_per_node"):
        Plan.from_dict(d)
    ok = copy.deepcopy(d)
    ok["mesh"]["hardware"]["nics_per_node"] = 8
    assert Plan.from_dict(ok).mesh["hardware"]["nics_per_node"] == 8


def test_an_axis_across_nodes_prices_each_phase_with_its_links_factors():
    """A kind's factor (``Link.factors``) on an axis spanning nodes: the factor both links give where
    they agree, between the two (weighted by each phase's share of the bytes' time) where only the
    intra-node link has one; every phase of a single-phase axis keeps its link's."""
    gloo_like = {"reduce_scatter": 2.0}
    nvl, ib = H100.intra_node, H100.inter_node
    both = dataclasses.replace(H100, intra_node=Link(nvl.latency, nvl.bandwidth, gloo_like),
                               inter_node=Link(ib.latency, ib.bandwidth, gloo_like))
    assert axis_link(16, 1, both).factor("reduce_scatter") == pytest.approx(2.0)
    assert axis_link(16, 8, both).factors == both.inter_node.factors  # one member per node
    assert axis_link(8, 1, both).factors == both.intra_node.factors  # inside a node
    intra_only = dataclasses.replace(both, inter_node=ib)
    f = axis_link(16, 1, intra_only).factor("reduce_scatter")
    assert 1.0 < f < 2.0
    assert axis_link(16, 1, intra_only).factor("all_gather") == 1.0
