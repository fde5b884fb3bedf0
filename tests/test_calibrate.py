"""Calibration under the conditions programs run in: the link fit, the overlap figure, and how the
cost model prices a hardware whose collectives cannot hide under compute (``comm_overlap``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import autopar
from autopar.models import make
from autopar.cost_model.calibrate_procs import KINDS, fit_link, overlap_of
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


def test_overlap_of_reads_the_hidden_part_of_the_collective():
    # compute 10 ms alone; compute + collective waited at once 16 ms; issued before the compute 13 ms:
    # 3 ms of the collective hid under 10 ms of compute
    rank = [[10e-3, 16e-3, 13e-3]] * 3
    assert overlap_of([rank, rank]) == pytest.approx(0.3)
    # the slowest rank's block counts: a rank that hid nothing makes the blocks as slow as exposed
    slow = [[10e-3, 16e-3, 16e-3]] * 3
    assert overlap_of([rank, slow]) == pytest.approx(0.0)
    assert overlap_of([[[10e-3, 22e-3, 11e-3]] * 3]) == 1.0  # clamped: 11 ms hid under 10 ms of compute


def test_comm_overlap_round_trips_and_is_written_only_when_below_one(tmp_path):
    cpu = PRESETS["cpu"]
    assert "comm_overlap" not in cpu.to_dict()  # presets and the plans priced on them: JSON unchanged
    hw = dataclasses.replace(cpu, name="box", comm_overlap=0.25)
    d = hw.to_dict()
    assert d["comm_overlap"] == 0.25 and Hardware.from_dict(d) == hw
    save_profile(hw, tmp_path / "box.json", base="cpu")
    assert load_profile(tmp_path / "box.json") == hw
    with pytest.raises(ValueError, match="comm_overlap must be in"):
        dataclasses.replace(cpu, comm_overlap=1.5).validate()


def _fsdp(profile):
    model, inputs = make("gpt", "tiny", batch=4, device="meta")
    mesh = autopar.Mesh({"dp": 4}, device="cpu", profile=profile)
    return autopar.recipes.fsdp(model, mesh, inputs, progress=False)


def test_parameter_traffic_is_exposed_where_collectives_cannot_hide(tmp_path):
    """FSDP's gathers and reduce-scatters hide under the layers' compute where collectives run
    beside it, and are paid in full at ``comm_overlap`` 0; the plan records the figure and loads."""
    # slow links, so the parameter traffic is larger than the compute it could hide under
    slow = Link(latency=1e-3, bandwidth=0.5e9)
    base = dataclasses.replace(PRESETS["cpu"], name="box", intra_node=slow, inter_node=slow)
    paths = {}
    for ov in (1.0, 0.0):
        paths[ov] = tmp_path / f"ov{ov}.json"
        save_profile(dataclasses.replace(base, comm_overlap=ov), paths[ov], base="cpu")
    hidden, exposed = _fsdp(paths[1.0]), _fsdp(paths[0.0])
    assert hidden.compute_time == pytest.approx(exposed.compute_time)
    assert exposed.comm_time > hidden.comm_time
    assert exposed.step_time == pytest.approx(exposed.compute_time + exposed.comm_time)
    # what overlap hid is at most the compute it hid under
    assert exposed.comm_time - hidden.comm_time <= hidden.compute_time * (1 + 1e-9)
    doc = json.loads(exposed.to_json(timing=False))
    assert doc["mesh"]["hardware"]["comm_overlap"] == 0.0
    again = Plan.from_dict(doc)
    assert again.step_time == pytest.approx(exposed.step_time)
    assert Hardware.from_dict(again.mesh["hardware"]).comm_overlap == 0.0


def test_cli_calibrate_one_process(tmp_path, monkeypatch, capsys):
    """``autopar calibrate --nprocs 1 --quick``: this process alone, the preset's link kept (the
    in-process measurement is ``test_cost_model.test_calibrate_quick``'s)."""
    from autopar.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--nprocs", "1", "--quick", "-o", str(out)]) == 0
    assert "launch floor" in capsys.readouterr().out
    hw = load_profile(out)
    assert hw.name == "cpu-calibrated" and hw.comm_overlap == 1.0
    assert hw.intra_node == PRESETS["cpu"].intra_node and hw.launch_floor > 0
