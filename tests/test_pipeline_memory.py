"""A pipelined plan's memory per rank against the simulator's measurement of each pipeline rank
(``runtime/pipeline/memory.py``): a rank holds its own stages' gradient accumulators and one
micro-batch's temporaries, not the whole model's unreduced gradients (``cost_model/pipeline_price.py``)."""

from __future__ import annotations

import warnings

import autopar
from autopar.cost_model.pipeline_price import AFTER_STEP, Segment, price_pipeline
from autopar.models import make

#: predicted over measured peak: the band ``tests/test_memory.py`` holds the walk to
BAND = (0.9, 1.15)


def test_each_pipeline_rank_holds_its_stages_gradients_not_the_whole_models():
    """pp=4 x dp=2 under GPipe, eight layers: the whole model's unreduced gradients (what a walk of
    one whole micro-batch holds among its temporaries to the end of its backward) are four ranks'
    worth; each rank holds only its stages' accumulators, which stand in for their reduced gradients
    through the step. The fullest rank's gradients are the measured ones, and every rank's peak is
    within the band of its measurement."""
    model, args = make("gpt", "tiny", batch=16, seq=64, n_embd=64, n_layer=8, block_size=64)
    mesh = autopar.Mesh({"pp": 4, "dp": 2}, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, mesh, args, progress=False, pipeline={"schedule": "GPipe", "microbatches": 2})
    _, _, memory = autopar.simulate(model, plan, args, measure_memory=True)
    ranks = plan.pipeline.rank_memory
    assert len(ranks) == 4
    top = max(range(4), key=lambda r: (ranks[r], -r))
    measured = memory[(top, 0)]
    assert abs(plan.memory["grads"] - measured["grads"]) <= 0.02 * measured["grads"], (plan.memory, measured)
    # one micro-batch's values between ops (at the most, mid-step), not the whole model's unreduced
    # gradients at the end of its backward
    assert BAND[0] <= plan.memory["temporaries"] / measured["temporaries"] <= BAND[1], (plan.memory, measured)
    for rank, predicted in enumerate(ranks):
        got = memory[(rank, 0)]["peak"]
        assert BAND[0] <= predicted / got <= BAND[1], (rank, ranks, memory[(rank, 0)])


def test_a_rank_holds_the_larger_of_its_step_and_its_step_end():
    """Through the step a rank holds its gradient accumulators beside its micro-batches' saved values;
    at the step's end the reduced gradients instead (``AFTER_STEP``), with nothing in flight: a
    reduced gradient larger than the accumulator (an all-reduce to a wider dtype) can be its peak."""
    gib = 2.0 ** 30

    def rank(activations: float) -> dict:
        stage = Segment(forward=1.0, input_grad=1.0, weight_grad=1.0, activations=activations * gib,
                        memory={"params": gib, "grads": gib, "optimizer": 2 * gib, AFTER_STEP: 4 * gib})
        return price_pipeline([stage], "1F1B", 1, 2, 1, 0.0, 0.0).rank_memory_kinds[0]

    end = rank(1.0)
    assert end["grads"] == 4 * gib and end["activations"] == 0.0
    busy = rank(8.0)
    assert busy["grads"] == gib and busy["activations"] == 8 * gib
