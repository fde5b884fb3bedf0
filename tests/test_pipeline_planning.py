"""Planning with a pipeline axis (``planner/pipelined.py``, ``passes/search/pipeline_split.py``,
``cost_model/pipeline_price.py``): stages, micro-batches and schedule chosen by replay, ``plan.pipeline``
(schema version 5), and the pipeline winning or losing against the plain plan of the same devices."""

from __future__ import annotations

import itertools
import json
import math

import pytest

import autopar
from autopar.plans import SCHEMA_VERSION
from autopar import models
from autopar.cost_model.pipeline_price import Segment, price_pipeline
from autopar.cost_model.schedules import closed_form_bubble
from autopar.errors import ArgumentError
from autopar.planner.pipelined import UNPIPELINED_NOTE
from autopar.passes.search.pipeline_split import ModelSegments, split


@pytest.fixture(scope="module")
def pinned():
    """A tiny 4-layer GPT (tied embedding and head) on pp=2 x dp=2, 1F1B pinned at 4 micro-batches."""
    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=4)
    mesh = autopar.Mesh({"pp": 2, "dp": 2}, device="cpu")
    plan = autopar.plan(model, mesh, inputs, pipeline={"schedule": "1F1B", "microbatches": 4}, progress=False)
    return model, inputs, mesh, plan


def test_pinned_pipeline_plan_says_what_it_chose(pinned):
    _, inputs, _, plan = pinned
    pl = plan.pipeline
    assert (pl.axis, pl.degree, pl.schedule, pl.microbatches, pl.virtual_stages) == ("pp", 2, "1F1B", 4, 1)
    assert pl.mesh_names == ["pp", "dp"] and pl.mesh_shape == [2, 2]
    assert plan.axis_names == ("dp",)  # placements are on the other axes
    stages = pl.stages
    assert len(stages) == 2
    assert "wte" in stages[0] and "lm_head" in stages[-1]  # embedding first, head last
    blocks = [p for s in stages for p in s if p.startswith("blocks.")]
    assert blocks == [f"blocks.{i}" for i in range(4)]  # every layer once, in order
    # step time: the replayed makespan plus the exposed synchronisation; peak: the largest rank's
    assert plan.step_time == pytest.approx(pl.makespan + pl.sync_time)
    assert plan.peak_memory == max(pl.rank_memory)
    assert sum(plan.memory.values()) == plan.peak_memory
    assert 0 < pl.bubble < 1
    assert pl.in_flight == [2, 1]  # 1F1B: p - s micro-batches in flight on stage s
    text = plan.summary()
    assert "pipeline on axis 'pp'" in text and "1F1B, 4 micro-batches" in text and "stage 1 (rank 1)" in text
    assert "pipeline stage 1 of 2" in plan.explain("blocks.3")
    # throughput of the whole step (every micro-batch) over every device of the whole mesh
    batch, seq = inputs[0].shape
    assert plan.tokens_per_step == batch * seq
    assert plan.tokens_per_second_per_device == pytest.approx(batch * seq / (plan.step_time * 4))


def test_pipeline_plan_round_trips_and_older_plans_load_without_pipeline(pinned, tmp_path):
    _, _, _, plan = pinned
    assert plan.schema_version == SCHEMA_VERSION and plan.pipeline.stage_buckets is True
    path = tmp_path / "p.json"
    plan.save(path)
    again = autopar.load_plan(path)
    assert again.to_json() == plan.to_json()
    assert again.pipeline.stages == plan.pipeline.stages
    d = json.loads(plan.to_json())
    d["schema_version"] = 6  # a version 6 pipelined plan: its buckets as listed (they may span stages)
    del d["pipeline"]["stage_buckets"]
    assert autopar.Plan.from_dict(d).pipeline.stage_buckets is False
    d["schema_version"] = 4
    del d["pipeline"]
    assert autopar.Plan.from_dict(d).pipeline is None
    assert "pipeline: 1F1B -> none" in plan.diff(autopar.Plan.from_dict(d))
    bad = json.loads(plan.to_json())
    bad["pipeline"]["schedule"] = "2F2B"
    with pytest.raises(autopar.errors.PlanError, match="pipeline.schedule"):
        autopar.Plan.from_dict(bad)


def test_pipeline_entry_is_the_file_schemas_record(pinned):
    """``plan.pipeline`` is the file schema's own model (``plans/entries.py``), not a second description:
    the planner builds it, the validator checks the file with it, and every key written is one of its
    fields; a round trip keeps the record, its keys and the bytes; a version 5 file (without the keys
    versions 6 and 7 added) loads with them None (``stage_buckets`` false) and writes back without them."""
    from dataclasses import fields
    from typing import get_type_hints

    from autopar.plans import entries, schema
    from autopar.plans.entries import ComparedSchedule, PipelineChoice, PlanFile, StageRecompute

    _, _, _, plan = pinned
    pl = plan.pipeline
    assert isinstance(pl, PipelineChoice) and isinstance(pl.recompute[0], StageRecompute)
    assert all(isinstance(c, ComparedSchedule) for c in pl.compared)
    written = plan.to_dict()["pipeline"]
    assert set(written) <= set(PipelineChoice.model_fields)
    assert set(written) == {k for k, v in pl if v is not None}  # every field the planner sets is written
    assert set(written) == set(PipelineChoice.model_fields)  # and it sets them all
    # the file's validation and the typed records are the same classes
    assert PipelineChoice in PlanFile.model_fields["pipeline"].annotation.__args__
    assert get_type_hints(schema.Plan, vars(schema))["pipeline"] == PipelineChoice | None
    assert {f.name for f in fields(schema.Plan)} == set(PlanFile.model_fields) - {"axis_names", "timing"}
    for name in ("NodeEntry", "Resharding", "ReshardingStep", "Collective", "Alternative", "ModuleEntry",
                 "LayerGroupEntry", "Baseline", "Fingerprint", "GraphSummary", "PipelineChoice"):
        assert getattr(schema, name) is getattr(entries, name) and name in schema.__all__
    again = autopar.Plan.from_dict(plan.to_dict())
    assert again == plan and again.pipeline == pl and again.to_json() == plan.to_json()
    d = json.loads(plan.to_json())
    d["schema_version"] = 5
    for k in ("recompute", "batch_coupled", "reference", "stage_buckets"):
        del d["pipeline"][k]
    for c in d["pipeline"]["compared"]:
        c.pop("recomputed"), c.pop("estimated", None)
    old = autopar.Plan.from_dict(d)
    assert old.pipeline.recompute is None and old.pipeline.reference is None and old.pipeline.stage_buckets is False
    assert old.pipeline.compared[0].recomputed is None and old.pipeline.stages == pl.stages
    back = old.to_dict()["pipeline"]
    assert set(back) == set(d["pipeline"]) | {"stage_buckets"} and "recomputed" not in back["compared"][0]
    assert autopar.Plan.from_dict(old.to_dict()) == old
    assert "pipeline stage 1 of 2" in old.explain("blocks.3") and "bubble" in old.summary()
    # a module path pydantic cannot read (a lone surrogate; torch takes any str) is kept as it is
    odd = json.loads(plan.to_json())["pipeline"]
    odd["stages"][0][0] += "\ud800"
    assert entries.dump(entries.record(PipelineChoice, odd)) == odd
    with pytest.raises(ValueError, match="pipline"):
        entries.record(PipelineChoice, {**odd, "pipline": 1})  # a key it lacks is refused


def test_pipeline_plans_are_deterministic_and_zbv_uses_v_placement(pinned):
    model, inputs, mesh, plan = pinned
    again = autopar.plan(model, mesh, inputs, pipeline={"schedule": "1F1B", "microbatches": 4}, progress=False)
    assert again.to_json() == plan.to_json()
    zbv = autopar.plan(model, mesh, inputs, pipeline={"schedule": "ZBVZeroBubble", "microbatches": 4}, progress=False)
    pl = zbv.pipeline
    assert pl.virtual_stages == 2 and pl.stage_ranks == [0, 1, 1, 0] and len(pl.stages) == 4
    assert "wte" in pl.stages[0] and "lm_head" in pl.stages[3]  # both ends on rank 0
    assert len(pl.rank_memory) == 2


def test_pipeline_pins_are_checked():
    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=2)
    mesh = autopar.Mesh({"pp": 2, "dp": 2}, device="cpu")
    with pytest.raises(ArgumentError, match="pipeline schedule"):
        autopar.plan(model, mesh, inputs, pipeline={"schedule": "PipeDream"})
    with pytest.raises(ArgumentError, match="unknown key"):
        autopar.plan(model, mesh, inputs, pipeline={"chunks": 4})
    with pytest.raises(ArgumentError, match="does not divide"):
        autopar.plan(model, mesh, inputs, pipeline={"microbatches": 3})
    with pytest.raises(ArgumentError, match="no pipeline schedule runs"):  # 1F1B needs m >= pp
        autopar.plan(model, mesh, inputs, pipeline={"schedule": "1F1B", "microbatches": 1})


def test_pipeline_wins_on_slow_outer_links():
    """A GPT-1.3B-wide model (8 layers) on pp=4 x dp=2 H100s whose pp axis is a slow link (5 GB/s, a
    40 Gb/s network): splitting that axis intra-op reduces gradients over it, a pipeline sends only
    activations. (At 1.25 GB/s the boundary transfers of 16 micro-batches cost as much as they save,
    with the matmuls priced at their shape's efficiency.) The plain plan of the same devices is the
    mesh with the axis renamed (a given ``pp`` axis pipelines: that plan is not made, the baselines
    say so)."""
    model, inputs = models.make("gpt", "1.3B", batch=16, seq=1024, device="meta", n_layer=8)
    mesh = autopar.Mesh({"pp": 4, "dp": 2}, device="h100", links={"pp": (2e-5, 5e9)})
    plan = autopar.plan(model, mesh, inputs, progress=False)
    assert plan.pipeline is not None and plan.fits
    assert plan.baselines["unpipelined"] == {"error": UNPIPELINED_NOTE} and "unpipelined" not in plan.phases
    plain = autopar.plan(model, autopar.Mesh({"x": 4, "dp": 2}, device="h100", links={"x": (2e-5, 5e9)}), inputs,
                         progress=False)
    assert plain.pipeline is None and plan.step_time < plain.step_time
    # one or two micro-batch counts solved; the others priced from a solve, marked estimated; the plan's
    # own count is a solved one
    pl = plan.pipeline
    rows = pl.compared
    solved = {c.microbatches for c in rows if not c.estimated}
    assert 1 <= len(solved) <= 2 and any(c.estimated for c in rows)
    assert pl.microbatches in solved
    assert {"stage_plans", "split", "pp_recipe", "total"} <= set(plan.phases)
    # the torchtitan-style pipelined recipe is priced alike; the plan is never slower than it
    recipe = plan.baselines["pp_fsdp_tp"]
    assert recipe["step_time"] >= plan.step_time * (1 - 1e-9) or plan.source == "recipe:pp_fsdp_tp"


def test_pipeline_loses_for_a_small_model_on_few_devices():
    """A tiny GPT on 4 CPUs: the bubble and the boundary transfers cost more than a fourth data axis
    used intra-op. The factorization search over pp in {1, 2} keeps the plain plan (``pipeline``
    None) and lists the pipelined shape, slower; given the ``pp`` axis, the plan pipelines as asked
    and says the unpipelined alternative was not planned (also in the summary)."""
    model, inputs = models.make("gpt", "tiny", batch=4, n_layer=4)
    plan = autopar.plan(model, autopar.Mesh.devices(4, device="cpu", pp=[1, 2], tp=[1]), inputs, progress=False)
    assert plan.pipeline is None and plan.mesh_search["chosen"] == {"pp": 1, "dp": 4, "tp": 1}
    piped = next(r for r in plan.mesh_search["compared"] if r["shape"]["pp"] == 2)
    assert piped["pipelined"] and piped["step_time"] > plan.step_time
    given = autopar.plan(model, autopar.Mesh({"pp": 2, "dp": 2}, device="cpu"), inputs, progress=False)
    assert given.pipeline is not None and given.step_time == pytest.approx(piped["step_time"], rel=1e-12)
    assert given.baselines["unpipelined"] == {"error": UNPIPELINED_NOTE}
    assert "Mesh.devices" in given.summary()


def test_gradient_accumulation_without_a_pp_axis():
    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=2)
    mesh = autopar.Mesh({"dp": 2}, device="cpu")
    plain = autopar.plan(model, mesh, inputs, progress=False)
    acc = autopar.plan(model, mesh, inputs, pipeline={"microbatches": 4}, progress=False)
    pl = acc.pipeline
    assert (pl.degree, pl.schedule, pl.microbatches, pl.bubble) == (1, "1F1B", 4, 0.0)
    assert pl.in_flight == [1]  # accumulation: one micro-batch's activations at a time
    assert acc.memory["activations"] < plain.memory["activations"]


def test_split_is_the_best_contiguous_split():
    """``split`` minimises the slowest stage over every contiguous cut (brute force on uneven units)."""
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0]
    units = tuple(Segment(forward=c / 3, input_grad=c / 3, weight_grad=c / 3) for c in costs)
    model = ModelSegments(Segment(forward=2.0), units, Segment(forward=1.5), 0.0)
    for n_stages in (1, 2, 3, 4):
        got = split(model, n_stages)
        assert [a for a, _ in got][0] == 0 and got[-1][1] == len(costs)

        def worst(cuts):
            bounds = [0, *cuts, len(costs)]
            spans = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
            spans[0] += 2.0
            spans[-1] += 1.5
            return max(spans)

        best = min(worst(c) for c in itertools.combinations(range(1, len(costs)), n_stages - 1))
        assert worst([b for _, b in got[:-1]]) == pytest.approx(best)
    assert split(model, 8) is None


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_priced_bubble_sweep_equals_closed_form(schedule):
    """Equal stages, free transfers: ``price_pipeline``'s bubble is (p-1)/(m+p-1) for every shape, and
    the step is (m+p-1) stage times."""
    for pp in (1, 2, 3, 4, 8):
        for m in (pp, 2 * pp, 4 * pp + 1):
            stages = [Segment(forward=1.0, input_grad=1.0, weight_grad=1.0)] * pp
            price = price_pipeline(stages, schedule, pp, m, 1, 0.0, 0.0)
            assert price.replay.bubble == pytest.approx(closed_form_bubble(pp, m), abs=1e-12)
            assert price.step_time == pytest.approx((m + pp - 1) * 3.0)
            assert math.isclose(price.sync, 0.0)


def test_segments_add_up_to_the_plans_compute_and_activation_communication():
    """Read back per segment, a solved plan's forward, input- and weight-gradient times add up to the
    evaluator's compute plus activation communication, its memory to the plan's (the tied embedding and
    head counted at both ends), and its gathers and reductions to the parameter traffic."""
    from autopar.planner.intra import run_passes
    from autopar.planner.options import PlanOptions
    from autopar.passes.search.pipeline_split import segments
    from autopar.passes.search.problem import evaluate

    model, inputs = models.make("gpt", "tiny", batch=4, n_layer=3)
    mesh = autopar.Mesh({"dp": 2}, device="cpu")
    planned = run_passes(model, mesh, inputs, options=PlanOptions(progress=False))
    segs = segments(planned.graph, planned.folding, planned.problem, planned.choice, mesh, planned.precision)
    pre, units, post = segs.pre_paths, segs.unit_paths, segs.post_paths
    assert units == ["blocks.0", "blocks.1", "blocks.2"] and "wte" in pre and "lm_head" in post
    parts = [segs.pre, *segs.units, segs.post]
    cost = evaluate(planned.problem, planned.choice)
    total = sum(p.forward + p.backward for p in parts)
    # a parameter's comm is its optimizer step: once per step, kept out of the per-micro-batch times
    problem = planned.problem
    optimizer = sum(n.mult * n.comm[c] for n, c in zip(problem.nodes, planned.choice)
                    if planned.graph.node(n.name).is_placeholder)
    assert optimizer > 0
    # comm_time also holds the compute slowed by hidden collectives (``cost.contention``): not a segment time
    assert total == pytest.approx(cost.compute_time + cost.comm_time - cost.exposed_param_comm - cost.contention
                                  - optimizer, rel=1e-9)
    assert sum(p.optimizer for p in parts) >= optimizer * (1 - 1e-9)  # the tied weight's on both ends
    assert all(p.forward > 0 and p.input_grad >= 0 and p.weight_grad > 0 for p in segs.units)
    assert segs.post.input_grad > 0 and segs.pre.input_grad == 0  # the embedding's backward has no input gradient
    tied = max(planned.problem.nodes[planned.problem.index[planned.graph.params["wte.weight"]]].memory["params"])
    held = sum(p.memory["params"] for p in parts)
    assert cost.memory["params"] <= held <= cost.memory["params"] + tied
    assert segs.boundary_bytes > 0


def test_estimate_of_a_larger_micro_batch_grows_by_the_per_row_work_only():
    """``scaled`` estimates a micro-batch 4x as large from a solve at the smaller one (the driver's
    ranking of micro-batch counts): with the same layer plan (the ddp recipe), each segment's estimate
    is close to the exact price at that shape and not above it (but for a launch-bound embedding, by under 0.1%), where scaling linearly
    would be about 4x (the kernels' fixed parts and latencies do not grow)."""
    from autopar.planner.intra import run_passes
    from autopar.planner.options import PlanOptions
    from autopar.passes.search.pipeline_split import scaled, segments

    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=2)
    mesh = autopar.Mesh({"dp": 2}, device="h100")

    def segs(rows):
        planned = run_passes(model, mesh, tuple(x[:rows] for x in inputs),
                             options=PlanOptions(recipe="ddp", progress=False))
        return segments(planned.graph, planned.folding, planned.problem, planned.choice, mesh, planned.precision)

    small, large = segs(2), segs(8)
    est = scaled(small, 4.0)
    for e, x, s in [(est.pre, large.pre, small.pre), (est.units[0], large.units[0], small.units[0]),
                    (est.post, large.post, small.post)]:
        exact = x.forward + x.backward
        assert 0.9 * exact <= e.forward + e.backward <= exact * 1.01
        assert 4 * (s.forward + s.backward) > 1.5 * exact  # what a linear scale would say


def test_the_chosen_micro_batch_count_is_the_best_of_every_count_solved():
    """Only the counts an estimate says might win are solved; the estimates lean optimistic both ways,
    so the plan is as fast as the best of the counts each solved exactly (pinned). (Solving the middle
    count, 4, first with a linear estimate of 2 missed the faster m=2.)"""
    model, inputs = models.make("gpt", "tiny", batch=4, n_layer=4)
    mesh = autopar.Mesh({"pp": 2, "dp": 2}, device="cpu")
    plan = autopar.plan(model, mesh, inputs, progress=False)
    each = [autopar.plan(model, mesh, inputs, pipeline={"microbatches": m}, progress=False).step_time for m in (2, 4)]
    assert plan.step_time <= min(each) * (1 + 1e-12)


def test_pipeline_ties_go_to_the_schedule_with_less_memory():
    """Of pipelines equally fast (here schedules whose replays give the same step on 4 stages of one
    layer each), the plan takes the one that needs the least memory."""
    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=4)
    plan = autopar.plan(model, autopar.Mesh({"pp": 4}, device="cpu"), inputs, progress=False)
    exact = [c for c in plan.pipeline.compared if not c.estimated]
    ties = [c for c in exact if c.step_time == plan.step_time]
    assert len({(c.schedule, c.microbatches, c.virtual_stages) for c in ties}) >= 2, exact  # a tie
    assert len({c.peak_memory for c in ties}) >= 2, ties  # of different memory
    assert plan.peak_memory == min(c.peak_memory for c in ties), ties
