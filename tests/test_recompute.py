"""Activation checkpointing executed (``passes/lower/emitter.py``): a checkpointed layer instance's
forward ops are not saved but run again in the backward, reshardings and collectives included.
Checked against the single-device model (loss and every gradient), against the same plan without
checkpointing (mixed precision, dropout: the same values), and on the collectives that run, which
are the plan's prediction; one gloo case per mesh shape trains 3 AdamW steps."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from _dropout_helpers import build_gpt
from _parity import build, plan_json, rel, simulated_errors, train_on_rank

import autopar
from autopar.errors import ArgumentError
from autopar.ir.capture import capture
from autopar.passes.lower.emitter import lower
from autopar.passes.lower.resolve import resolve
from autopar.runtime.accounting import differences


def _moe():
    """The tiny MoE with two layers (one is nothing to recompute), in float64 (routing ties)."""
    from autopar.models import make

    torch.manual_seed(0)
    model, args = make("moe", "tiny", batch=8, n_layers=2)
    return model.double(), tuple(a.double() if a.is_floating_point() else a for a in args)


def _program(model, plan, args):
    """Rank 0's program of ``plan``."""
    res = resolve(capture(model, args), plan)
    return lower(res, (0,) * len(plan.mesh["axes"]))


def _recipe(model, args, axes: dict, recipe: str, **kw) -> autopar.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(autopar.recipes, recipe)(model, autopar.Mesh(axes, device="cpu"), args, progress=False, **kw)


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("family", ["gpt", "llama", "moe"])
def test_checkpointed_plans_on_2x3_compute_what_one_device_computes(family, mode):
    """Every layer checkpointed under torchtitan's layout on (2, 3) (uneven pieces on the tensor
    axis): the loss and every gradient equal the single-device model's, rank 0 saves fewer values
    for the backward and its backward runs forward ops again."""
    model, args = build(family) if family != "moe" else _moe()
    kw = {"precision": "fp64"} if family == "moe" else {}
    plain = _recipe(model, args, {"dp": 2, "tp": 3}, "fsdp_tp", **kw)
    plan = _recipe(model, args, {"dp": 2, "tp": 3}, "fsdp_tp", checkpointing=mode, **kw)
    assert plan.placements == plain.placements
    (group,) = plan.layer_groups
    assert plan.checkpointing == {p: mode for p in group["paths"]}
    loss, grads = simulated_errors(model, plan, args)
    tol = 1e-9 if family == "moe" else 1e-5
    assert loss <= tol and max(grads.values()) <= tol, (loss, grads)
    ours, theirs = _program(model, plan, args), _program(model, plain, args)
    assert ours.n_saved < theirs.n_saved
    assert any(n.meta.get("autopar_recomputed") for n in ours.backward.graph.nodes)
    assert not any(n.meta.get("autopar_recomputed") for n in theirs.backward.graph.nodes)


def test_recomputed_collectives_are_the_predicted_ones():
    """Sequence-parallel LLaMA, every layer recomputed: the backward re-runs the layers' activation
    gathers from the saved residual stream. Every device runs exactly the collectives the plan
    lists (the re-run ones are listed as ``recompute`` reshardings), more than without it."""
    model, args = build("llama")
    runs = {}
    for mode in ("none", "full"):
        plan = _recipe(model, args, {"dp": 2, "tp": 2}, "megatron_sp", checkpointing=mode)
        trace: dict = {}
        model.zero_grad(set_to_none=True)
        loss, grads = simulated_errors(model, plan, args, trace=trace)
        assert loss <= 1e-5 and max(grads.values()) <= 1e-5
        for coords, ran in trace.items():
            assert differences(plan, ran) == [], (mode, coords)
        runs[mode] = (len(trace[(0, 0)]), sum(r["kind"] == "recompute" for r in plan.reshardings))
    assert runs["none"][1] == 0 and runs["full"][1] > 0
    assert runs["full"][0] > runs["none"][0]


def test_bf16_mixed_checkpointed_plan_computes_what_the_plan_without_it_computes():
    """Re-running a layer in bf16 gives the values the forward saved: under ``precision="plan"``
    the loss and gradients equal those of the same placements without checkpointing."""
    model, args = build("llama")
    out = {}
    for mode in ("none", "selective"):
        plan = _recipe(model, args, {"dp": 2, "tp": 2}, "fsdp_tp", checkpointing=mode, precision="bf16-mixed")
        out[mode] = autopar.simulate(model, plan, args, precision="plan")
    (la, ga), (lb, gb) = out["selective"], out["none"]
    assert rel(la, lb) <= 1e-6
    for k in gb:
        assert rel(ga[k], gb[k]) <= 1e-6, k


def test_a_model_without_repeated_layers_cannot_be_checkpointed():
    """Asking to checkpoint a model with nothing to recompute is an error, not a plan that silently
    saves everything."""
    model, args = build("moe")  # one layer
    with pytest.raises(ArgumentError, match=re.escape("checkpointing='full': the model has no repeated")):
        _recipe(model, args, {"dp": 2}, "ddp", checkpointing="full")


def test_dropout_is_redrawn_alike_when_recomputed():
    """A recomputed dropout draws the mask its forward drew: the checkpointed program on (2, 2)
    equals the plain program on one device (the same seed)."""
    model, args = build_gpt()

    def run(axes, mode):
        plan = _recipe(model, args, axes, "megatron_tp", checkpointing=mode)
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.simulate(model, plan, args)

    (la, ga), (lb, gb) = run({"dp": 2, "tp": 2}, "full"), run({"dp": 1}, "none")
    assert rel(la, lb) <= 1e-9
    for k in gb:
        assert rel(ga[k], gb[k]) <= 1e-9, k


@pytest.fixture(scope="module")
def pool(gloo_pool4):
    """Four gloo ranks: the pytest process's shared pool (tests/conftest.py)."""
    return gloo_pool4()


@pytest.mark.parametrize("family,axes,recipe,mode", [
    ("llama", (("a", 4),), "fsdp", "full"),
    ("gpt", (("a", 2), ("b", 2)), "megatron_sp", "selective"),
], ids=["llama-4-fsdp-full", "gpt-2x2-megatron_sp-selective"])
def test_checkpointed_plans_train_like_one_device_on_gloo(pool, family, axes, recipe, mode):
    """3 AdamW steps on 4 gloo processes; rank 0 runs exactly the predicted collectives."""
    model, args = build(family)
    text = _recipe(model, args, dict(axes), recipe, checkpointing=mode).to_json()
    assert json.loads(text)["checkpointing"]
    assert text != plan_json(family, axes, recipe)
    results = pool.run(train_on_rank, family, axes, text)
    for rank, r in enumerate(results):
        assert r["loss"] <= 1e-4 and r["grad"] <= 1e-4 and r["param"] <= 1e-4, (rank, r)
    assert results[0]["differences"] == [], results[0]["differences"]
