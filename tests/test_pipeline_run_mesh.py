"""Pipelined plans with other mesh axes (``runtime/pipeline/sharded.py``: each stage runs its slice of the
plan's lowered sharded program on the stage mesh), gloo, 4 processes: pp=2 x dp=2 on a GPT (tied
embedding and head: its two partial gradients summed over the pipeline) and pp=2 x tp=2 on a LLaMA
(RoPE tables once per step), pp=2 x dp=2 GPT under ZBVZeroBubble (the split backward) and pp=2 x dp=2
LLaMA under Interleaved1F1B (two stages per rank in loop placement): one run per schedule. The loss, every gradient and the parameters after 3 AdamW steps equal the
single-device model's, and every rank runs the collectives and point-to-point transfers the plan
predicts for it (count and bytes; each transfer the size the plan's ``p2p_time`` prices). The LLaMA
plan is made under a memory budget its stages meet by recomputing layers (per-stage recomputation:
the backward re-runs their forward ops and reshardings, listed in the plan's collectives). The three
cases run in turn in one launch of 4 ranks (each launch starts processes importing torch and autopar:
seconds each); each test checks its case's results."""

from __future__ import annotations

import pytest

import autopar
from autopar.cost_model.comm import LOCAL_KINDS
from _pipeline_mesh_helpers import build, train_cases

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

LAYERS = 4
#: family, schedule, mesh, batch, sequence (None: the preset's), memory budget as a share of the unbudgeted
#: plan's largest rank (None: no budget)
CASES = [("gpt", "1F1B", (("pp", 2), ("dp", 2)), 8, None, None),
         ("llama", "GPipe", (("pp", 2), ("tp", 2)), 4, 128, 0.6),
         ("gpt", "ZBVZeroBubble", (("pp", 2), ("dp", 2)), 8, None, None),
         ("llama", "Interleaved1F1B", (("pp", 2), ("dp", 2)), 8, None, None)]


#: the recomputing case's tokens split on the sequence over tp with attention in the gather form, so
#: the layers it re-runs in the backward re-gather keys and values (the searched plan of the plain
#: case re-runs none of its collectives)
REGATHER = dict(hints={"input:0": "tp=S(1)", "input:1": "tp=S(1)"}, attention={"tp": "gather"})


def _plan(family, schedule, axes, batch, seq, share):
    """The case's plan and the bytes its p2p price stands for."""
    model, inputs = build(family, LAYERS, batch, seq)
    mesh = autopar.Mesh(dict(axes), device="cpu")
    pin = {"schedule": schedule, "microbatches": 4}
    kw = REGATHER if share is not None else {}
    plan = autopar.plan(model, mesh, inputs, pipeline=pin, progress=False, **kw)
    if share is not None:  # a budget under which the stages recompute layers (per-stage recomputation)
        budget = share * max(plan.pipeline.rank_memory)
        plan = autopar.plan(model, mesh, inputs, pipeline=pin, memory_budget=budget, progress=False, **kw)
    link = mesh.link("pp")  # the plan prices one transfer at latency + bytes / bandwidth
    return plan, round((plan.pipeline.p2p_time - link.latency) * link.bandwidth)


@pytest.fixture(scope="module")
def runs():
    """Per case: its plan, every rank's results and the priced transfer bytes; one launch for all."""
    planned = [_plan(*case) for case in CASES]
    cases = [(family, LAYERS, batch, axes, plan.to_json(), seq)
             for (family, _, axes, batch, seq, _), (plan, _) in zip(CASES, planned)]
    # the launch took up to 112 s under load: a hang fails in minutes
    results = autopar.launch(train_cases, 4, cases, timeout=360)
    return [(plan, [r[k] for r in results], priced) for k, (plan, priced) in enumerate(planned)]


def _check(family, results, priced, batch, seq, crossings=1):
    names = {n for n, _ in build(family, LAYERS, batch, seq)[0].named_parameters()}
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


def test_pp_dp_gpt_tied_matches_single_device(runs):
    plan, results, priced = runs[0]
    assert plan.pipeline.schedule == CASES[0][1]
    _check("gpt", results, priced, *CASES[0][3:5])


def test_pp_tp_llama_recomputing_matches_single_device(runs):
    """Each stage recomputes layers (a budget under the unbudgeted plan's ranks): the backward re-runs
    them, with their all-gathers of keys and values on tp, and what runs still equals the plan's
    prediction."""
    plan, results, priced = runs[1]
    assert plan.pipeline.schedule == CASES[1][1]
    assert plan.fits and plan.checkpointing
    assert all(s.layers for s in plan.pipeline.recompute)
    # the re-runs' collectives are the plan's, and they are among the predicted ones checked below
    assert any(st["kind"] not in LOCAL_KINDS for r in plan.reshardings if r["kind"] == "recompute"
               for st in r["steps"])
    _check("llama", results, priced, *CASES[1][3:5])


def test_pp_dp_gpt_zero_bubble_matches_single_device(runs):
    """ZBVZeroBubble (V placement: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2), each stage's
    backward split into its input- and weight-gradient parts: two boundaries between ranks per rank."""
    plan, results, priced = runs[2]
    assert plan.pipeline.schedule == CASES[2][1]
    _check("gpt", results, priced, *CASES[2][3:5], crossings=2)


def test_pp_dp_llama_interleaved_matches_single_device(runs):
    """Interleaved1F1B (loop placement: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3, one layer
    each): every boundary is between ranks, so each rank touches three."""
    plan, results, priced = runs[3]
    assert plan.pipeline.schedule == CASES[3][1]
    _check("llama", results, priced, *CASES[3][3:5], crossings=3)
