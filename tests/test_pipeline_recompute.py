"""Recomputation chosen per pipeline stage (``cost_model/pipeline_price.choose_recompute``): under 1F1B the
first stages hold more micro-batches in flight, so where a rank does not fit its budget it recomputes
layer instances, the first ranks more, and the re-runs are priced in the replay; the stages are split
again with the re-runs charged; a recomputing pipelined plan runs (simulated) like the single-device model."""

from __future__ import annotations

import pytest

import autopar
from autopar import models
from autopar.cost_model.pipeline_price import Recompute, Segment, price_pipeline
from autopar.passes.search.pipeline_split import ModelSegments, best_pipelines, split, stages_of
from _pipeline_mesh_helpers import rel

GIB = 2.0**30


def _stage(s: int, layers: int = 4) -> Segment:
    """A stage of ``layers`` alike instances: 1 GiB saved per instance and micro-batch; recomputing one
    keeps 0.1 GiB and costs 0.5 s (full) or keeps 0.7 GiB and costs 0.1 s (selective)."""
    paths = tuple(f"layers.{s * layers + i}" for i in range(layers))
    options = {"full": Recompute(0.9 * GIB, 0.5, 1.0 * GIB), "selective": Recompute(0.3 * GIB, 0.1, 0.5 * GIB)}
    return Segment(forward=1.0, input_grad=1.0, weight_grad=1.0, activations=layers * GIB,
                   memory={"params": GIB, "activations": layers * GIB}, paths=paths,
                   recompute=tuple((p, options) for p in paths))


def test_first_stages_recompute_more_and_the_replay_prices_it():
    pp, m = 4, 8
    stages = [_stage(s) for s in range(pp)]
    free = price_pipeline(stages, "1F1B", pp, m, 1, 0.0, 0.0)
    assert free.replay.in_flight == (4, 3, 2, 1)
    # rank memory: 1 GiB of parameters + in_flight x 4 GiB: 17, 13, 9, 5 GiB
    assert [round(x / GIB) for x in free.rank_memory] == [17, 13, 9, 5]
    budget = 10 * GIB
    priced = price_pipeline(stages, "1F1B", pp, m, 1, 0.0, 0.0, budget)
    assert priced.peak_memory <= budget
    # rank 0 (7 GiB over): selective saves at most 4 x 4 x 0.3 - 0.5 = 4.3 GiB, so full: 3 instances
    # (3 x 4 x 0.9 - 1 = 9.8 GiB off); rank 1 (3 GiB over): selective on all 4 (4 x 3 x 0.3 - 0.5 = 3.1 GiB,
    # 0.4 s) is cheaper than full on 2 (1.0 s); ranks 2 and 3 fit and recompute nothing
    assert priced.recomputed == (("full", ("layers.0", "layers.1", "layers.2")),
                                 ("selective", ("layers.4", "layers.5", "layers.6", "layers.7")),
                                 ("none", ()), ("none", ()))
    # the re-runs are in the replay: each stage's backward grows by its recomputed instances' seconds
    assert priced.stages == free.stages
    assert priced.step_time > free.step_time
    assert priced.replay.busy[0] == pytest.approx(free.replay.busy[0] + m * 3 * 0.5)
    assert priced.replay.busy[1] == pytest.approx(free.replay.busy[1] + m * 4 * 0.1)
    assert priced.rank_memory[0] == pytest.approx((17 - 3 * 4 * 0.9 + 1.0) * GIB)
    # without a budget, or within it, nothing recomputes
    assert all(not paths for _, paths in free.recomputed)
    roomy = price_pipeline(stages, "1F1B", pp, m, 1, 0.0, 0.0, 20 * GIB)
    assert all(not paths for _, paths in roomy.recomputed) and roomy.step_time == free.step_time


def test_a_pipeline_that_fits_only_by_recomputing_its_first_stage(tmp_path):
    """A tiny LLaMA on pp=2 x dp=2, 1F1B at 4 micro-batches: with a budget between the two ranks'
    memory without recomputation, the plan recomputes layer instances on stage 0 only, says so per
    stage and in ``checkpointing`` (what the lowering re-runs), and fits."""
    model, inputs = models.make("llama", "tiny", batch=8, n_layers=4)
    mesh = autopar.Mesh({"pp": 2, "dp": 2}, device="cpu")
    pin = {"schedule": "1F1B", "microbatches": 4}
    free = autopar.plan(model, mesh, inputs, pipeline=pin, progress=False)
    mem = free.pipeline.rank_memory
    assert mem[0] > mem[1] and all(s.mode == "none" for s in free.pipeline.recompute)
    budget = (mem[0] + mem[1]) / 2
    plan = autopar.plan(model, mesh, inputs, pipeline=pin, memory_budget=budget, progress=False)
    redo = plan.pipeline.recompute
    assert redo[0].layers and not redo[1].layers
    assert set(redo[0].layers) <= set(plan.pipeline.stages[0])
    assert plan.checkpointing == {p: redo[0].mode for p in redo[0].layers}
    assert plan.fits and plan.peak_memory <= budget
    assert plan.step_time > free.step_time
    assert f"recomputes {len(redo[0].layers)} layer(s)" in plan.summary()
    plan.save(tmp_path / "p.json")
    again = autopar.load_plan(tmp_path / "p.json")
    assert again.to_json() == plan.to_json() and again.pipeline.recompute == redo
    # run (simulated on every stage-mesh device): stage 0's backward re-runs its recomputed layers, and
    # the loss and every gradient equal the single-device model's
    loss, grads = autopar.simulate(model, plan, inputs)
    ref = model(*inputs)
    ref.backward()
    assert rel(loss, ref) <= 1e-5
    for name, p in model.named_parameters():
        assert rel(grads[name], p.grad) <= 1e-4, name


def test_the_split_accounts_for_recomputation():
    """Stages split before recomputation is chosen can be unbalanced by it: 8 alike layers on 2 ranks
    under 1F1B (rank 0 holds 2 micro-batches in flight, rank 1 one) and a budget rank 0 meets only by
    recomputing 2 layers (3 s each): split again with those re-runs charged, rank 0 takes 3 layers and
    recomputes none, and the step is shorter (69 against 80 s) within the budget."""
    units = tuple(Segment(forward=1.0, input_grad=1.0, weight_grad=1.0, activations=10.0,
                          memory={"activations": 10.0}, paths=(f"layers.{i}",),
                          recompute=((f"layers.{i}", {"full": Recompute(9.0, 3.0, 1.0)}),)) for i in range(8))
    model = ModelSegments(Segment(), units, Segment(), 0.0)
    naive = split(model, 2)
    assert naive == [(0, 4), (4, 8)]
    before = price_pipeline(stages_of(model, naive), "1F1B", 2, 4, 1, 0.0, 0.0, 60.0)
    assert before.recomputed[0] == ("full", ("layers.0", "layers.1")) and before.step_time == pytest.approx(80.0)
    (price, ranges), *_ = best_pipelines(model, 2, 4, 0.0, "1F1B", 1, 60.0)
    assert ranges == [(0, 3), (3, 8)] and all(not paths for _, paths in price.recomputed)
    assert price.step_time == pytest.approx(69.0) and price.peak_memory <= 60.0
    # with room to spare nothing recomputes and the split is the plain one
    (roomy, ranges), *_ = best_pipelines(model, 2, 4, 0.0, "1F1B", 1, 100.0)
    assert ranges == naive and roomy.step_time == pytest.approx(60.0)
