"""Pipelined plans run on torch.distributed.pipelining (``runtime/pipeline/eager.py``), gloo, pp=2: loss on
every rank and every gradient equal the single-process model's, for each schedule torch 2.13 runs,
on an 8-layer GPT (tied embedding and head: gradients summed over the two ends) and an 8-layer LLaMA
(RoPE tables recomputed per stage; one case with unevenly ignored targets: the whole batch's mean)."""

from __future__ import annotations

import pytest
import torch

import autopar
from _pipeline_helpers import build, pipelined_cases, reference

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

CASES = [("gpt", "1F1B"), ("gpt", "ZBVZeroBubble"), ("llama", "GPipe"), ("llama", "Interleaved1F1B")]
#: the case run with most of the first sample's targets ignored: the loss is the whole batch's mean
#: (``runtime/pipeline/loss.py``), not the mean of the micro-batch means
UNEVEN = ("llama", "GPipe")
LAYERS, BATCH = 8, 8
#: parameters read by the first and the last stage (two stages of one rank under ZBV's V placement)
TIED = {"gpt": {"wte.weight"}}


def test_pipelined_step_matches_the_single_device_model():
    cases, refs = [], []
    for family, schedule in CASES:
        model, inputs = build(family, LAYERS, BATCH)
        plan = autopar.plan(model, autopar.Mesh({"pp": 2}, device="cpu"), inputs,
                            pipeline={"schedule": schedule, "microbatches": 4}, progress=False)
        assert plan.pipeline.schedule == schedule
        uneven = (family, schedule) == UNEVEN
        cases.append((family, LAYERS, BATCH, plan.to_json(), uneven))
        refs.append(reference(family, LAYERS, BATCH, uneven))
    results = autopar.launch(pipelined_cases, 2, cases, timeout=180)  # 60 s under load
    for k, ((family, schedule), (ref_loss, ref_grads)) in enumerate(zip(CASES, refs)):
        merged: dict[str, torch.Tensor] = {}
        for rank in range(2):
            loss, again, grads, alive, shared = results[rank][k]
            # the rank frees what it dropped; a stage's weight backward runs over its own parameters only
            assert alive == [], (family, schedule, rank, alive)
            assert set(shared) <= TIED.get(family, set()), (family, schedule, rank, shared)
            assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), (family, schedule, rank, loss, ref_loss)
            assert abs(again - ref_loss) <= 1e-4 * abs(ref_loss), (family, schedule, rank, again)  # under no_grad
            for fqn, g in grads.items():
                g = torch.tensor(g)
                if fqn in merged:  # held on both ranks: a tied weight, its gradients summed
                    assert torch.equal(merged[fqn], g), (family, schedule, fqn)
                merged[fqn] = g
        assert sorted(merged) == sorted(ref_grads), (family, schedule)
        for fqn, want in ref_grads.items():
            want = torch.tensor(want)
            err = (merged[fqn] - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
            assert err <= 1e-4, (family, schedule, fqn, err)
