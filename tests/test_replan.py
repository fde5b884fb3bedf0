"""Re-planning after a failure (``autopar.replan``, ``autopar replan``): the same model planned for
the devices left, the old plan's checkpoint checked against the new one. Planning and the
checkpoint check run in this process; the gloo test saves with torch.distributed.checkpoint on 8
ranks under the first plan, loads on 6 under the second and trains on, equal to one device (the
simulator runs no DCP: a checkpoint's blocks are written by the ranks that hold them)."""

from __future__ import annotations

import re

import pytest
import torch
from _replan_helpers import gpt, load_under, save_under, single_device

import autopar
from autopar.errors import ArgumentError, PlanError
from autopar.replan import check_checkpoint


@pytest.fixture(scope="module")
def plans():
    """The 8-device plan (FSDP x TP on dp=2, tp=4) and its replan for 6 devices."""
    model, args = gpt(0)
    first = autopar.recipes.fsdp_tp(model, autopar.Mesh({"dp": 2, "tp": 4}, device="cpu"), args, progress=False)
    return first, autopar.replan(model, first, 6, args, progress=False, deterministic_time=2.0)


def test_replan_plans_for_the_devices_left_and_says_what_moved(plans):
    first, again = plans
    new = again.plan
    assert again.old is first
    n = 1
    for size in new.run_axes.values():
        n *= size
    assert n == 6 and new.mesh_search is not None and new.mesh_search["devices"] == 6
    assert new.precision == first.precision and new.training
    report = again.report()
    assert "from 8 devices" in report and "to 6 devices" in report and "step time:" in report
    assert again.moved in report and again.moved != "plans are identical"
    # the new plan is the model's on 6 devices: its step equals the single device's
    model, args = gpt(0)
    loss, grads = autopar.simulate(model, new, args)
    ref = model(*args)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_checkpoint_check_names_what_is_missing_or_differs(plans, tmp_path):
    import torch.distributed.checkpoint as dcp

    model, _ = gpt(0)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    ok = check_checkpoint(model, tmp_path / "ok")
    assert ok.loadable and ok.found["wte.weight"] == "model.wte.weight" and "all" in ok.lines()[0]
    partial = {k: v for k, v in model.state_dict().items() if k != "ln_f.bias"}
    partial["wpe.weight"] = partial["wpe.weight"][:4]
    dcp.save(partial, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    bad = check_checkpoint(model, tmp_path / "bad")
    assert not bad.loadable and bad.missing == ["ln_f.bias"]
    assert bad.mismatched["wpe.weight"][0][0] == 4
    assert "NOT loadable" in "\n".join(bad.lines())
    with pytest.raises(ArgumentError, match="no .metadata"):
        check_checkpoint(model, tmp_path)


def test_replan_refuses_another_model_and_bad_devices(plans):
    first, _ = plans
    other, args = gpt(0)
    other.ln_f = torch.nn.LayerNorm(8)  # the plan's parameter names, another shape
    with pytest.raises(PlanError, match="'ln_f.bias' is \\[8\\] in the model, \\[64\\] in the plan"):
        autopar.replan(other, first, 6, args)
    with pytest.raises(PlanError, match="'blocks.0.attn.proj.bias' is absent in the model"):
        autopar.replan(torch.nn.Linear(2, 2), first, 6, (torch.ones(2, 2),))
    model, args = gpt(0)
    with pytest.raises(ArgumentError, match="devices"):
        autopar.replan(model, first, 0, args)


@pytest.mark.gloo
@pytest.mark.slow
def test_state_saved_on_8_ranks_loads_on_6_and_trains_like_one_device(plans, tmp_path):
    first, again = plans
    ckpt = str(tmp_path / "ckpt")
    saved = autopar.launch(save_under, 8, first.to_json(), ckpt)
    model, args = gpt(0)
    check = check_checkpoint(model, ckpt)
    assert check.loadable, check.lines()
    loaded = autopar.launch(load_under, 6, again.plan.to_json(), ckpt)
    losses, params = single_device(2)
    assert saved[0]["loss"] == pytest.approx(losses[0], rel=1e-5)
    assert loaded[0]["placements"] != saved[0]["placements"], "the two plans place the state differently"
    for r in loaded:
        for name, p in saved[0]["params"].items():  # the saved state, exactly
            assert torch.equal(r["loaded"][name], p), name
        assert r["loss"] == pytest.approx(losses[1], rel=1e-5), "the step after loading is the model's second"
        # and the step the single device takes (AdamW: compared by the relative error of the whole tensor)
        worst = max((r["params"][n].double() - p.double()).norm().item() / p.double().norm().item()
                    for n, p in params.items())
        assert worst <= 1e-4, worst


def test_cli_replan_saves_the_new_plan_and_prints_what_moved(plans, tmp_path, capsys):
    import pathlib

    import torch.distributed.checkpoint as dcp

    from autopar.cli import main

    first, _ = plans
    first.save(tmp_path / "plan.json")
    model, _ = gpt(0)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    target = f"{pathlib.Path(__file__).with_name('_replan_helpers.py')}:gpt"
    argv = ["replan", str(tmp_path / "plan.json"), target, "--devices", "6", "--checkpoint", str(tmp_path / "ckpt"),
            "--search-time", "2", "-o", str(tmp_path / "new.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "to 6 devices" in out and "all" in out and "what moved:" in out
    assert autopar.load_plan(tmp_path / "new.json").mesh_search["devices"] == 6
    dcp.save({"model": {"wte.weight": model.wte.weight}}, checkpoint_id=str(tmp_path / "other"), no_dist=True)
    assert main(argv[:6] + [str(tmp_path / "other")] + argv[7:]) == 1
    assert "does not hold" in (err := capsys.readouterr().err) and re.search(r"\d+ tensors missing, 0 of another shape \(blocks.0.attn.proj.bias missing", err)
    assert main(argv[:6] + [str(tmp_path)] + argv[7:]) == 1
    assert "no .metadata" in capsys.readouterr().err
