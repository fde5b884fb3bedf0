"""Pipelined plans with other mesh axes (``runtime/pipeline_mesh.py``: each stage runs its slice of the
plan's lowered sharded program on the stage mesh), gloo, 4 processes: pp=2 x dp=2 on a GPT (tied
embedding and head: its two partial gradients summed over the pipeline) and pp=2 x tp=2 on a LLaMA
(RoPE tables once per step), and pp=2 x dp=2 GPT under ZBVZeroBubble (the split backward). The loss, every gradient and the parameters after 3 AdamW steps equal the
single-device model's, and every rank runs the collectives and point-to-point transfers the plan
predicts for it (count and bytes; each transfer the size the plan's ``p2p_time`` prices)."""

from __future__ import annotations

import autopar
from _pipeline_mesh_helpers import build, train_on_rank

LAYERS, BATCH = 4, 8
CASES = [("gpt", "1F1B", (("pp", 2), ("dp", 2))), ("llama", "GPipe", (("pp", 2), ("tp", 2))),
         ("gpt", "ZBVZeroBubble", (("pp", 2), ("dp", 2)))]


def _case(family, schedule, axes):
    model, inputs = build(family, LAYERS, BATCH)
    mesh = autopar.Mesh(dict(axes), device="cpu")
    plan = autopar.plan(model, mesh, inputs, pipeline={"schedule": schedule, "microbatches": 4}, progress=False)
    assert plan.pipeline["schedule"] == schedule
    link = mesh.link("pp")  # the plan prices one transfer at latency + bytes / bandwidth
    priced = round((plan.pipeline["p2p_time"] - link.latency) * link.bandwidth)
    return autopar.launch(train_on_rank, 4, family, LAYERS, BATCH, axes, plan.to_json(), timeout=600), priced


def _check(family, results, priced, crossings=1):
    names = {n for n, _ in build(family, LAYERS, BATCH)[0].named_parameters()}
    held = set()
    for rank, out in enumerate(results):
        assert out["loss"] <= 1e-4 and out["grad"] <= 1e-4 and out["param"] <= 1e-4, (family, rank, out)
        assert out["eval"] <= 1e-4, (family, rank, out["eval"])  # forward only, under no_grad
        assert out["differences"] == [], (family, rank, out["differences"])
        # one boundary value each way per micro-batch (4) per boundary between ranks that the rank's
        # stages touch, each the size the plan's p2p price has
        assert out["n_p2p"] == 2 * 4 * crossings, (family, rank, out)
        assert out["p2p"] == [("recv", priced), ("send", priced)], (family, rank, out)
        held |= set(out["held"])
    assert held == names  # every parameter's gradient is held by some stage


def test_pp_dp_gpt_tied_matches_single_device():
    _check("gpt", *_case(*CASES[0]))


def test_pp_tp_llama_matches_single_device():
    _check("llama", *_case(*CASES[1]))


def test_pp_dp_gpt_zero_bubble_matches_single_device():
    """ZBVZeroBubble (V placement: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2), each stage's
    backward split into its input- and weight-gradient parts: two boundaries between ranks per rank."""
    _check("gpt", *_case(*CASES[2]), crossings=2)
