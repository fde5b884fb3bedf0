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


@pytest.mark.gloo
@pytest.mark.slow
def test_gloo_pipelined_dropout_equals_the_one_device_program():
    """The mesh runtime (``runtime/pipeline/sharded.py``) on 4 gloo ranks, ZBVZeroBubble on pp=2 x tp=2,
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
    # the run took 55 s under load
    results = autopar.launch(pipelined_dropout_step_on_rank, 4, plan.to_json(), 7, torch.float64, timeout=180)
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


@pytest.mark.gloo
@pytest.mark.slow
def test_gloo_pp_alone_dropout_equals_the_one_device_program():
    """The pipeline axis alone (``runtime/pipeline/eager.py``: each stage interprets its aten ops eagerly,
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
            out, grads = autopar.simulate(model, one, args, kwargs)
            refs.append((out if isinstance(out, torch.Tensor) else out["loss"], grads))  # HF: the model's output
        plan = _plan(model, args, {"pp": 2}, example_kwargs=kwargs,
                     pipeline={"schedule": "ZBVZeroBubble", "microbatches": 2})
        cases.append((name, plan.to_json()))
    results = autopar.launch(pp_alone_dropout_step_on_rank, 2, cases, 7, timeout=180)  # 53 s under load
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


@pytest.mark.parametrize("axes", [{"pp": 2}, {"pp": 2, "dp": 2}])
def test_pipelined_dropout_through_a_batch_merged_with_the_heads(axes):
    """``nn.TransformerEncoder`` (torch's own attention code: ``view(S, B*H, D)`` merges the batch,
    major, with the heads, after a ``(S*B, E)`` flatten with the batch minor, then ``view(B, H, S, D)``
    splits it back), dropout on, float64, 2 micro-batches: ``batch_dims`` follows the batch through
    the merges (it used to refuse the attention's dropout), and loss and gradients equal the 1-device
    program's within 1e-9."""
    from _corpus import build
    from _dropout_helpers import close

    model, args, _ = build("torch_encoder", dropout=True, dtype=torch.float64)  # no kwargs
    ref = _simulate(model, _plan(model, args, {"a": 1}), args)
    plan = _plan(model, args, axes, pipeline={"schedule": "1F1B", "microbatches": 2})
    close(_simulate(model, plan, args), ref, 1e-9, axes)


class _Heads(torch.nn.Module):
    """Dropout on the batch merged with 4 heads: ``(B*H, S, D)`` (batch major) or ``(S*B, E)``
    (batch minor)."""

    def __init__(self, major: bool):
        super().__init__()
        self.proj, self.major = torch.nn.Linear(16, 16), major

    def forward(self, x):
        b, s, e = x.shape
        h = self.proj(x)
        if self.major:
            h = h.view(b, s, 4, e // 4).transpose(1, 2).reshape(b * 4, s, e // 4)
        else:
            h = h.transpose(0, 1).reshape(s * b, e)
        return torch.nn.functional.dropout(h, P).sum()


@pytest.mark.parametrize("major", [True, False])
def test_batch_dims_follows_a_major_merged_batch_and_refuses_a_minor_one(major):
    """A dropout drawn on ``(B*H, S, D)`` (batch the major factor: micro-batch ``k`` is rows
    ``k*rows*H`` on) is placed on dim 0; one on ``(S*B, E)`` (the batch minor: a micro-batch is no
    contiguous block) is refused by name."""
    from autopar.errors import ArgumentError
    from autopar.ir.capture import capture
    from autopar.runtime.random_state import batch_dims

    graph = capture(_Heads(major).double(), (torch.randn(2, 8, 16, dtype=torch.float64),))
    if major:
        assert list(batch_dims(graph, 2).values()) == [0]
    else:
        with pytest.raises(ArgumentError, match="no dim is led by the batch"):
            batch_dims(graph, 2)
