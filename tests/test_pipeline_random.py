"""Dropout under pipelined plans (``runtime/random_state.batch_dims``, ``program.RandomState.micro``):
each micro-batch draws its block of the whole batch's draw, so the simulated pipelined step equals the
single-device program's step on the whole batch (autopar's masks are its 1-device program's, see
``tests/test_dropout.py``), on pp=2 x dp=2 (1F1B) and pp=2 x tp=2 (ZBVZeroBubble, the backward split:
the attention backward redraws its forward's mask in the input-gradient part), in float64; and once on
gloo through the mesh runtime."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar.models import make

P = 0.3  # high, so a wrong mask shows in the loss


def _gpt():
    torch.manual_seed(0)
    return make("gpt", "tiny", batch=4, seq=16, dtype=torch.float64, dropout=P, n_layer=4)


def _simulate(model, plan, args, seed=5):
    torch.manual_seed(seed)  # simulate draws the run's seed from torch's default generator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.simulate(model, plan, args)


def _plan(model, args, axes, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, autopar.Mesh(axes, device="cpu"), args, progress=False, **kw)


@pytest.fixture(scope="module")
def reference():
    model, args = _gpt()
    return _simulate(model, _plan(model, args, {"a": 1}), args)


@pytest.mark.parametrize("axes,schedule", [({"pp": 2, "dp": 2}, "1F1B"), ({"pp": 2, "tp": 2}, "ZBVZeroBubble")])
def test_pipelined_dropout_draws_the_whole_batchs_masks(reference, axes, schedule):
    model, args = _gpt()
    plan = _plan(model, args, axes, pipeline={"schedule": schedule, "microbatches": 2})
    loss, grads = _simulate(model, plan, args)
    ref_loss, ref_grads = reference
    assert abs(loss.item() - ref_loss.item()) <= 1e-9 * abs(ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    for k, g in ref_grads.items():
        assert torch.allclose(grads[k], g, rtol=1e-9, atol=1e-9 * g.abs().max().item()), k
    # the draw matters: no dropout is another loss (and without the micro-batch's place in the whole
    # batch, each micro-batch would draw the first one's masks: another loss too)
    model.eval()
    assert abs(model(*args).item() - ref_loss.item()) > 1e-6


def test_gloo_pipelined_dropout_equals_the_one_device_program():
    """The mesh runtime (``runtime/pipeline_mesh.py``) on 4 gloo ranks, ZBVZeroBubble on pp=2 x tp=2,
    float64: one step's loss (a float64 on every rank: it is broadcast in the model's dtype) and
    gradients equal the 1-device program's with the same torch seed within 1e-9 (each micro-batch's
    forward, input- and weight-gradient parts at its place in the whole batch), the collectives and
    transfers that ran are the predicted ones, bytes included (the plan, at the default "fp32",
    prices the float64 run's 8-byte elements: ``cost_model.precision.AS_CAPTURED``), and the step
    advanced; the seed (rank 0's on every rank) and the step are in the state_dict and load back."""
    from _dropout_helpers import pipelined_dropout_step_on_rank

    model, args = _gpt()
    plan = _plan(model, args, {"pp": 2, "tp": 2}, pipeline={"schedule": "ZBVZeroBubble", "microbatches": 2})
    want, want_grads = _simulate(model, _plan(model, args, {"a": 1}), args, seed=7)
    results = autopar.launch(pipelined_dropout_step_on_rank, 4, plan.to_json(), 7, torch.float64, timeout=600)
    held = set()
    for rank, r in enumerate(results):
        assert r["dtype"] == "torch.float64", (rank, r["dtype"])
        assert abs(r["loss"] - want.item()) <= 1e-9 * abs(want.item()), (rank, r["loss"], want)
        for k, g in r["grads"].items():
            assert (g - want_grads[k]).norm() <= 1e-9 * want_grads[k].norm(), (rank, k)
        held |= set(r["grads"])
        assert r["differences"] == [], (rank, r["differences"])
        assert r["step"] == 1
        assert r["saved"] == [results[0]["saved"][0], 1] and r["loaded_step"] == 5, (rank, r["saved"])
    assert held == {n for n, _ in model.named_parameters()}  # every gradient held by some rank


def test_gloo_pp_alone_dropout_equals_the_one_device_program():
    """The pipeline axis alone (``runtime/pipeline.py``: each stage interprets its aten ops eagerly,
    its random ops drawn as the 1-device program draws them, at the micro-batch's place) on 2 gloo
    ranks, ZBVZeroBubble, float64: one step's loss (a float64 on every rank) and gradients equal the
    1-device program's with the same torch seed within 1e-9, for the dropout GPT and for Hugging
    Face's BERT (its own attention code, 13 dropouts); the seed (rank 0's on every rank) and the next
    step are in the state_dict and load back."""
    from _dropout_helpers import dropout_model, pp_alone_dropout_step_on_rank

    cases, refs, names = [], [], []
    for name in ("gpt", "hf_bert"):
        model, args, kwargs = dropout_model(name)
        names.append({n for n, _ in model.named_parameters()})
        one = _plan(model, args, {"a": 1}, example_kwargs=kwargs)
        torch.manual_seed(7)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            refs.append(autopar.simulate(model, one, args, kwargs))
        plan = _plan(model, args, {"pp": 2}, example_kwargs=kwargs,
                     pipeline={"schedule": "ZBVZeroBubble", "microbatches": 2})
        cases.append((name, plan.to_json()))
    results = autopar.launch(pp_alone_dropout_step_on_rank, 2, cases, 7, timeout=600)
    for k, ((name, _), (want, want_grads)) in enumerate(zip(cases, refs)):
        held = set()
        for rank in range(2):
            r = results[rank][k]
            assert r["dtype"] == "torch.float64", (name, rank, r["dtype"])
            assert abs(r["loss"] - want.item()) <= 1e-9 * abs(want.item()), (name, rank, r["loss"], want.item())
            # the rank's gradients as one vector (some are zero in exact arithmetic: BERT's key bias)
            got = torch.cat([g.flatten() for g in r["grads"].values()])
            ref = torch.cat([want_grads[n].flatten() for n in r["grads"]])
            assert (got - ref).norm() <= 1e-9 * ref.norm(), (name, rank, ((got - ref).norm() / ref.norm()).item())
            held |= set(r["grads"])
            assert r["saved"] == [results[0][k]["saved"][0], 1] and r["loaded_step"] == 5, (name, rank, r["saved"])
        assert held == names[k], name  # every gradient held by some rank
