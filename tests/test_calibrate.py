"""Calibration under the conditions programs run in: the link fit, the overlap figure, and how the
cost model prices a hardware whose collectives cannot hide under compute (``overlap_slowdown``
near 1)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import autopar
from autopar.models import make
from autopar.cost_model.calibrate_procs import KINDS, MAX_SLOWDOWN, fit_link, overlap_of
from autopar.cost_model.comm import collective_time
from autopar.cost_model.hardware import PRESETS, Hardware, Link, load_profile, save_profile
from autopar.plans import Plan


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
