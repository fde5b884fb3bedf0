"""A pipelined mixture of experts' memory per rank against the simulator's measurement of each
pipeline rank (``runtime/pipeline/memory.py``), in the style of ``test_pipeline_memory.py``: a rank
holds its own stages' experts, their gradient accumulators and one micro-batch's temporaries, not
the whole model's experts or unreduced gradients (``cost_model/pipeline_price.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar.models import make

#: predicted over measured peak: the band ``tests/test_memory.py`` holds the walk to
BAND = (0.9, 1.15)


@pytest.mark.parametrize("hints", [None, {"layers.*.moe.experts.w*": "dp=S(0)"}], ids=["searched", "experts-on-dp"])
def test_each_pipeline_rank_holds_its_stages_experts(hints):
    """pp=2 x dp=2 under GPipe (the order the simulator runs), the zoo's dropless MoE with a shared
    expert (four layers, eight experts, top-2, grouped products): every rank's predicted peak is
    within the band of its measurement, with the layer plan the search chooses and with the experts'
    weights split on dp by hints. A rank charged the whole model's experts or gradients would be
    about twice its measurement; one charged float32 gradients where its accumulators are bf16
    (a gradient made at its parameter's placement) twice the measured gradients."""
    torch.manual_seed(0)
    model, args = make("moe_dropless", "tiny", batch=16, experts="grouped_mm", n_shared=1, n_layers=4, dim=64,
                       ffn_dim=64, n_experts=8, seq_len=32, dtype=torch.bfloat16)
    mesh = autopar.Mesh({"pp": 2, "dp": 2}, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, mesh, args, progress=False, hints=hints,
                            pipeline={"schedule": "GPipe", "microbatches": 4})
    if hints:
        assert plan.placements["layers.0.moe.experts.w1"] == "S(0)"
    _, _, memory = autopar.simulate(model, plan, args, measure_memory=True)
    ranks = plan.pipeline.rank_memory
    assert len(ranks) == 2 and all(len(s) > 1 for s in plan.pipeline.stages)
    # the gradient accumulators in the compute dtype (bf16), also where a gradient is made at its
    # parameter's placement and needs no reduction: the fullest rank's as measured
    top = max(range(2), key=lambda r: (ranks[r], -r))
    measured = memory[(top, 0)]
    assert abs(plan.memory["grads"] - measured["grads"]) <= 0.02 * measured["grads"], (plan.memory, measured)
    for rank, predicted in enumerate(ranks):
        got = memory[(rank, 0)]
        assert BAND[0] <= predicted / got["peak"] <= BAND[1], (rank, ranks, got)
        # the rank's own stages' parameters: about half the model's each, not all of it
        assert got["params"] < 0.75 * sum(p.numel() * 4 for p in model.parameters())
