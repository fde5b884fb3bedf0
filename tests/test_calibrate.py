"""Calibration under the conditions programs run in: the link fit, the overlap figure, and how the
cost model prices a hardware whose collectives cannot hide under compute (``overlap_slowdown``
near 1)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import autopar
from autopar.models import make
from autopar.cost_model.calibrate_procs import KINDS, MAX_SLOWDOWN, REFERENCE_KIND, fit_link, overlap_of
from autopar.cost_model.comm import collective_time, reshard_time, ring_time
from autopar.cost_model.hardware import PRESETS, Hardware, Link, load_profile, save_profile
from autopar.ir.placement import B, P, S
from autopar.plans import SCHEMA_VERSION, Plan


def test_fit_link_recovers_the_link_its_formulas_were_made_with():
    truth = Link(latency=800e-6, bandwidth=0.5e9)
    costs = {(k, b): collective_time(k, b, 4, truth) for k in KINDS for b in (1 << 10, 256 << 10, 4 << 20)}
    got = fit_link(costs, 4)
    assert got.latency == pytest.approx(truth.latency, rel=1e-6)
    assert got.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)


def test_fit_link_keeps_both_terms_positive_when_bytes_do_not_matter():
    # costs flat in the bytes (latency-bound, as gloo between busy processes mostly is): the
    # latency carries them and the bandwidth stays positive and finite
    costs = {(k, b): 5e-3 for k in KINDS for b in (1 << 10, 4 << 20)}
    got = fit_link(costs, 4)
    assert got.latency > 0 and 0 < got.bandwidth < float("inf")
    priced = [collective_time(k, b, 4, got) for k, b in costs]
    assert min(priced) > 1e-3 and max(priced) < 2e-2


def test_fit_link_recovers_per_kind_factors_and_prices_them():
    """Costs made with a link whose reduce-scatter costs 2x, all-to-all 1.3x and all-gather 0.9x their
    ring times: the fit finds the link and each factor, and the fitted link prices each kind so."""
    truth = Link(latency=800e-6, bandwidth=0.5e9, factors={"reduce_scatter": 2.0, "all_to_all": 1.3, "all_gather": 0.9})
    costs = {(k, b): collective_time(k, b, 4, truth) for k in KINDS for b in (1 << 10, 256 << 10)}
    got = fit_link(costs, 4)
    assert got.latency == pytest.approx(truth.latency, rel=1e-6)
    assert got.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)
    assert dict(got.factors) == pytest.approx(dict(truth.factors), rel=1e-6)
    assert got.factor(REFERENCE_KIND) == 1.0 and REFERENCE_KIND not in dict(got.factors)
    for (k, b), t in costs.items():
        assert collective_time(k, b, 4, got) == pytest.approx(t, rel=1e-6)
        assert collective_time(k, b, 4, got) == pytest.approx(got.factor(k) * ring_time(k, b, 4, got))


def test_a_reduce_scatter_that_runs_as_an_all_reduce_is_priced_as_one():
    """gloo runs reduce-scatter as an all-reduce of the whole tensor (torch's
    ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``): where it measures what the all-reduce of
    the same tensor does, the fitted link prices the two alike, not the reduce-scatter at about half
    (which is what one link without per-kind factors fits)."""
    ring = Link(latency=1e-3, bandwidth=0.5e9)
    costs = {}
    for b in (1 << 10, 256 << 10, 4 << 20):
        for k in ("all_reduce", "all_gather", "all_to_all"):
            costs[(k, b)] = collective_time(k, b, 4, ring)
        costs[("reduce_scatter", b)] = costs[("all_reduce", b)]
    got = fit_link(costs, 4)
    for b in (1 << 10, 4 << 20):
        assert collective_time("reduce_scatter", b, 4, got) == pytest.approx(costs[("all_reduce", b)], rel=0.1)
    assert 1.7 < got.factor("reduce_scatter") < 2.1
    without = fit_link({kb: t for kb, t in costs.items() if kb[0] != "all_reduce"}, 4)  # no anchor: one ring link
    assert without.factors == ()


def test_link_factors_round_trip_and_refuse_what_cannot_be_right():
    link = Link(1e-3, 1e9, {"reduce_scatter": 1.9})
    assert Link.from_dict(link.to_dict()) == link and link.to_dict()["factors"] == {"reduce_scatter": 1.9}
    assert "factors" not in Link(1e-3, 1e9).to_dict()  # written as schema version 6 wrote it
    assert Link.from_dict({"latency": 1e-3, "bandwidth": 1e9}).factor("reduce_scatter") == 1.0
    with pytest.raises(ValueError, match="unknown collective kind 'broadcast'"):
        Link(1e-3, 1e9, {"broadcast": 2.0})
    with pytest.raises(ValueError, match="reduce_scatter must be a positive finite number"):
        Link(1e-3, 1e9, {"reduce_scatter": 0.0})


def test_a_mesh_with_a_reduce_scatter_factor_prices_and_records_it(tmp_path):
    """A profile whose link prices reduce-scatter at 2x its ring time: a mesh made with it prices a
    P -> S(0) reshard at twice the same link's without the factor (and the other kinds as before);
    FSDP's plan costs more, records the factor on the hardware's links and the mesh's, and loads back
    to the same price."""
    slow = Link(latency=1e-3, bandwidth=0.5e9)
    base = dataclasses.replace(PRESETS["cpu"], name="box", overlap_slowdown=MAX_SLOWDOWN)
    paths = {}
    for name, link in (("ring", slow), ("gloo", Link(slow.latency, slow.bandwidth, {"reduce_scatter": 2.0}))):
        paths[name] = tmp_path / f"{name}.json"
        save_profile(dataclasses.replace(base, intra_node=link, inter_node=link), paths[name], base="cpu")
    meshes = {name: autopar.Mesh({"dp": 4}, device="cpu", profile=path) for name, path in paths.items()}
    for src, dst, ratio in (([P], [S(0)], 2.0), ([P], [B], 1.0), ([S(0)], [B], 1.0)):
        priced = {name: reshard_time((1024, 64), src, dst, mesh, 4) for name, mesh in meshes.items()}
        assert priced["gloo"] == pytest.approx(ratio * priced["ring"]) and priced["ring"] > 0
    ring, gloo = _fsdp(paths["ring"]), _fsdp(paths["gloo"])
    assert gloo.step_time > ring.step_time
    doc = json.loads(gloo.to_json(timing=False))
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["mesh"]["links"]["dp"]["factors"] == {"reduce_scatter": 2.0}
    assert doc["mesh"]["hardware"]["intra_node"]["factors"] == {"reduce_scatter": 2.0}
    assert "factors" not in json.loads(ring.to_json(timing=False))["mesh"]["links"]["dp"]
    again = Plan.from_dict(doc)
    assert again.step_time == pytest.approx(gloo.step_time)
    assert Link.from_dict(again.mesh["links"]["dp"]).factor("reduce_scatter") == 2.0
    from autopar.plans.html.page import render_html
    assert "reduce_scatter at 2x its ring time" in render_html(gloo)
    assert "its ring time" not in render_html(ring)


def test_overlap_of_reads_the_compute_lost_beside_the_collective():
    # compute 10 ms alone; compute + collective waited at once 16 ms (the collective: 6 ms); issued
    # before the compute 13 ms: 3 ms more than the longer of the two, over the 6 ms they overlap
    rank = [[10e-3, 16e-3, 13e-3]] * 3
    assert overlap_of([rank, rank]) == pytest.approx(0.5)
    # the slowest rank's block counts: a rank that hid nothing (clamped below 1)
    slow = [[10e-3, 16e-3, 16e-3]] * 3
    assert overlap_of([rank, slow]) == pytest.approx(MAX_SLOWDOWN)
    assert overlap_of([[[10e-3, 16e-3, 10e-3]] * 3]) == 0.0  # hidden entirely, nothing slowed
    assert overlap_of([[[10e-3, 22e-3, 11e-3]] * 3]) == 0.0  # faster than the collective alone: clamped
    # read per repetition, the median kept: one repetition disturbed by load (compute alone slow, the
    # collective lost in it) neither moves the figure nor counts
    noisy = [[10e-3, 16e-3, 13e-3], [30e-3, 16e-3, 13e-3], [10e-3, 16e-3, 13e-3]]
    assert overlap_of([noisy]) == pytest.approx(0.5)
    mixed = [[10e-3, 16e-3, 13e-3], [10e-3, 16e-3, 10e-3], [10e-3, 16e-3, 13e-3], [10e-3, 16e-3, 16e-3]]
    assert overlap_of([mixed]) == pytest.approx(0.5)
    # no repetition saw the collective beside the compute: inconclusive, never priced as free overlap
    assert overlap_of([[[10e-3, 9e-3, 10e-3]] * 3]) == MAX_SLOWDOWN


def _fsdp(profile):
    model, inputs = make("gpt", "tiny", batch=4, device="meta")
    mesh = autopar.Mesh({"dp": 4}, device="cpu", profile=profile)
    return autopar.recipes.fsdp(model, mesh, inputs, progress=False)


def test_parameter_traffic_is_exposed_where_collectives_cannot_hide(tmp_path):
    """FSDP's gathers and reduce-scatters hide under the layers' compute where collectives run
    beside it for free at ``overlap_slowdown`` 0, and are paid (nearly) in full where the collectives
    take the cores compute needs; the plan records the figure and loads."""
    # slow links, so the parameter traffic is larger than the compute it could hide under
    slow = Link(latency=1e-3, bandwidth=0.5e9)
    base = dataclasses.replace(PRESETS["cpu"], name="box", intra_node=slow, inter_node=slow)
    paths = {}
    for s in (0.0, MAX_SLOWDOWN):
        paths[s] = tmp_path / f"s{s}.json"
        save_profile(dataclasses.replace(base, overlap_slowdown=s), paths[s], base="cpu")
    hidden, exposed = _fsdp(paths[0.0]), _fsdp(paths[MAX_SLOWDOWN])
    assert hidden.compute_time == pytest.approx(exposed.compute_time)
    assert exposed.comm_time > hidden.comm_time
    assert exposed.step_time == pytest.approx(exposed.compute_time + exposed.comm_time)
    # what overlap hid is at most the compute it hid under
    assert exposed.comm_time - hidden.comm_time <= hidden.compute_time * (1 + 1e-9)
    doc = json.loads(exposed.to_json(timing=False))
    assert doc["mesh"]["hardware"]["overlap_slowdown"] == MAX_SLOWDOWN
    again = Plan.from_dict(doc)
    assert again.step_time == pytest.approx(exposed.step_time)
    assert Hardware.from_dict(again.mesh["hardware"]).overlap_slowdown == MAX_SLOWDOWN


def test_cli_calibrate_one_process(tmp_path, monkeypatch, capsys):
    """``autopar calibrate --nprocs 1 --quick``: this process alone, the preset's link kept (the
    in-process measurement is ``test_cost_model.test_calibrate_quick``'s)."""
    from autopar.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--nprocs", "1", "--quick", "-o", str(out)]) == 0
    assert "launch floor" in capsys.readouterr().out
    hw = load_profile(out)
    assert hw.name == "cpu-calibrated" and hw.overlap_slowdown == PRESETS["cpu"].overlap_slowdown
    assert hw.intra_node == PRESETS["cpu"].intra_node and hw.launch_floor > 0
