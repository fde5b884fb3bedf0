"""Activation checkpointing chosen by the search (``passes/search/checkpoint.py``): the memory it
saves and the time it costs are priced per group of alike layers, the search recomputes only when
the fastest plan does not fit, and ``checkpointing=`` pins the choice."""

from __future__ import annotations

import functools
import re

import pytest

import autopar
from autopar import models
from autopar.errors import ArgumentError, InfeasibleError
from autopar.ir.capture import capture
from autopar.ir.layers import layers
from autopar.ir.recompute import recompute_peak_share
from autopar.validate import parse_size


def _gpt(layers: int = 4):
    return models.make("gpt", "tiny", batch=8, n_layer=layers)


@functools.cache
def _swept():
    """The 4-layer GPT of ``_gpt`` on a 1-D mesh, its graph and its plan without a budget (made once:
    the budget sweeps and the model-state error read them)."""
    model, inputs = _gpt()
    graph = capture(model, inputs)
    mesh = autopar.Mesh({"dp": 2}, device="cpu")
    return model, inputs, graph, mesh, autopar.plan(model, mesh, inputs, progress=False, graph=graph)


@functools.cache
def _at(fraction: float):
    """The plan of ``_swept``'s model within ``fraction`` of its free peak, or the ``InfeasibleError``
    where none fits (made once per budget: the two sweeps share their budgets)."""
    model, inputs, graph, mesh, free = _swept()
    try:
        return autopar.plan(model, mesh, inputs, memory_budget=int(free.peak_memory * fraction), progress=False,
                            graph=graph)
    except InfeasibleError as e:
        return e


def test_a_budget_sweep_recomputes_only_when_needed_and_time_never_falls_as_memory_shrinks():
    """Solved exactly (CP-SAT, a 1-D mesh, every count of recomputed layers tried): each plan fits
    its budget, the largest budget recomputes nothing, the smallest feasible one recomputes, and
    the estimated step time never decreases as the budget shrinks."""
    free = _swept()[4]  # (captured once for every budget)
    assert free.checkpointing == {}
    rows = []
    for fraction in (1.0, 0.95, 0.9, 0.8, 0.7, 0.5):  # (0.7: nothing fits any more)
        budget = int(free.peak_memory * fraction)
        plan = _at(fraction)
        if isinstance(plan, InfeasibleError):
            break
        assert plan.peak_memory <= budget
        rows.append((fraction, plan.step_time, len(plan.checkpointing)))
    assert rows[0][2] == 0 and rows[-1][2] > 0 and len(rows) >= 3, rows
    times = [t for _, t, _ in rows]
    assert all(a <= b * (1 + 1e-9) for a, b in zip(times, times[1:])), rows


def test_pinned_recomputation_prices_what_it_saves_and_costs():
    """Under one placement (the ddp recipe), recomputing every instance changes the activation
    memory by what ``layer_groups`` reports: ``(c - p) * saved - c * kept`` less (the backward of
    a recomputed instance holds ``p * saved`` of re-run values at most, ``p`` from
    ``ir.recompute.recompute_peak_share``), and adds its re-run time."""
    model, inputs = _gpt()
    graph = capture(model, inputs)
    mesh = autopar.Mesh({"dp": 2}, device="cpu")
    plain = autopar.recipes.ddp(model, mesh, inputs, progress=False)
    for mode in ("full", "selective"):
        plan = autopar.recipes.ddp(model, mesh, inputs, checkpointing=mode, progress=False)
        assert plan.placements == plain.placements
        (group,) = plan.layer_groups
        c = group["count"]
        assert group["checkpointed"] == c and group["mode"] == mode
        assert plan.checkpointing == {p: mode for p in group["paths"]}
        p = recompute_peak_share(graph, layers(graph), ("blocks", 0), mode)
        assert 0 < p < 1
        less = (c - p) * group["saved_bytes"] - c * group["input_bytes"]
        assert less > 0
        assert plain.memory["activations"] - plan.memory["activations"] == pytest.approx(less, abs=2 * c)
        assert plan.step_time - plain.step_time == pytest.approx(c * group["recompute_time"], rel=1e-6)
    full, selective = (autopar.recipes.ddp(model, mesh, inputs, checkpointing=m, progress=False).layer_groups[0]
                       for m in ("full", "selective"))
    # selective keeps the attention and every other matmul's outputs: more kept, less re-run
    assert selective["input_bytes"] > full["input_bytes"]
    assert selective["recompute_time"] < full["recompute_time"]


def test_pins_by_module_path_glob_and_their_errors():
    model, inputs = _gpt()
    mesh = autopar.Mesh({"dp": 2}, device="cpu")
    plan = autopar.plan(model, mesh, inputs, checkpointing={"blocks.[01]": "full"}, progress=False)
    assert plan.checkpointing == {"blocks.0": "full", "blocks.1": "full"}
    assert plan.layer_groups[0]["checkpointed"] == 2
    assert autopar.plan(model, mesh, inputs, checkpointing="none", progress=False).checkpointing == {}
    with pytest.raises(ArgumentError, match=r"checkpointing='some': expected one of 'none', 'full', 'selective'"):
        autopar.plan(model, mesh, inputs, checkpointing="some")
    with pytest.raises(ArgumentError, match=r"recomputed instances must be the first ones \(blocks.2 asked\)"):
        autopar.plan(model, mesh, inputs, checkpointing={"blocks.2": "full"}, progress=False)
    with pytest.raises(ArgumentError, match=r"'decoder.\*' match no layer instance"):
        autopar.plan(model, mesh, inputs, checkpointing={"decoder.*": "full"}, progress=False)
    with pytest.raises(ArgumentError, match=r"take one mode \(full and selective asked\)"):
        autopar.plan(model, mesh, inputs, checkpointing={"blocks.0": "full", "blocks.1": "selective"},
                     progress=False)


def test_when_model_state_alone_exceeds_the_budget_the_error_says_recomputing_cannot_help():
    model, inputs, _, mesh, free = _swept()
    state = free.memory["params"] + free.memory["grads"] + free.memory["optimizer"]
    with pytest.raises(InfeasibleError, match=r"Recomputing activations cannot help: with every layer recomputed "
                                              r"the leanest plan needs .*, and the model state alone"):
        autopar.plan(model, mesh, inputs, memory_budget=state // 4, progress=False)


def test_the_infeasible_headline_is_the_least_memory_with_the_recomputation_the_search_uses():
    """"The leanest possible plan needs N" bounds every plan the planner can find from below, those
    that recompute included: a plan the search fits by recomputing needs at least N, and a budget
    under N is what no plan meets."""
    model, inputs, graph, mesh, free = _swept()
    recomputing = None
    for fraction in (0.9, 0.8, 0.7, 0.6, 0.5):
        plan = _at(fraction)
        if isinstance(plan, InfeasibleError):
            break
        if plan.checkpointing:
            recomputing = plan
    assert recomputing is not None
    with pytest.raises(InfeasibleError) as info:
        autopar.plan(model, mesh, inputs, memory_budget=recomputing.peak_memory // 4, progress=False, graph=graph)
    headline = re.search(r"the leanest possible plan needs ([0-9.]+ [KMG]?i?B) per device", str(info.value))
    assert headline, str(info.value)
    # (the figure is rounded to 3 digits: within 0.5% of the exact bytes)
    assert parse_size(headline.group(1)) <= recomputing.peak_memory * 1.005, (str(info.value), recomputing.peak_memory)


def test_a_plan_saved_with_checkpointing_loads_and_shows_it(tmp_path):
    model, inputs = _gpt()
    mesh = autopar.Mesh({"dp": 2}, device="cpu")
    plan = autopar.plan(model, mesh, inputs, checkpointing={"blocks.0": "selective"}, progress=False)
    plan.save(tmp_path / "p.json")
    again = autopar.load_plan(tmp_path / "p.json")
    assert again.checkpointing == {"blocks.0": "selective"} and again.to_json() == plan.to_json()
    text = plan.summary()
    assert "activation checkpointing" in text and "1 of 4 recomputed (selective: blocks.0)" in text
    assert "checkpointed (selective)" in plan.explain("blocks.0")
    from autopar.plans.html import render_html

    page = render_html(plan)
    assert '<section id="layer-groups">' in page and ">1 of 4</td><td>selective</td><td><code>blocks.0</code>" in page
    assert 'id="layer-groups"' not in render_html(autopar.Plan.from_dict({**plan.to_dict(), "layer_groups": []}))


def test_a_two_axis_sequence_mesh_that_needs_recomputation_gets_it_from_the_search():
    """LLaMA (16 layers, one sequence of 2,048 tokens) on a cp x tp mesh with a budget that only
    plans recomputing most layers fit: the search's own recomputation finds one. The walked peak
    (temporaries between ops) puts the first levels the linear memory admits over the budget, so
    the search climbs past them instead of stopping where recomputing more stops being faster."""
    model, inputs = models.make("llama", "tiny", batch=1, seq=2048, n_layers=16, max_seq_len=2048)
    graph = capture(model, inputs)
    mesh = autopar.Mesh({"cp": 2, "tp": 2}, device="h100")
    full = autopar.plan(model, mesh, inputs, checkpointing="full", progress=False, graph=graph)
    budget = int(full.peak_memory * 0.7)
    plan = autopar.plan(model, mesh, inputs, memory_budget=budget, progress=False, graph=graph)
    assert plan.fits and plan.peak_memory <= budget
    assert 0 < len(plan.checkpointing) < 16
    assert plan.step_time < full.step_time
