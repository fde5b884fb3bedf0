"""Dropout under pipelined plans (``runtime/random_state.batch_dims``, ``program.RandomState.micro``):
each micro-batch draws its block of the whole batch's draw, so the simulated pipelined step equals the
single-device program's step on the whole batch (autopar's masks are its 1-device program's, see
``tests/test_dropout.py``), on pp=2 x dp=2 (1F1B) and pp=2 x tp=2 (ZBVZeroBubble, the backward split:
the attention backward redraws its forward's mask in the input-gradient part), in float64."""

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
