"""Kept gathers (``passes/search/kept.py``, ``passes/lower/emitter.py``): a layer instance whose
gathered parameters are kept from the forward for the backward runs no gather for them in the
backward, computes what the single-device model computes, runs exactly the collectives its plan
lists, and the plan prices the kept blocks' bytes; the search keeps them where that is faster and
fits; one gloo case per mesh shape trains 3 AdamW steps."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from _parity import build, plan_json, rel, simulated_errors, train_on_rank

import autopar
from autopar.errors import ArgumentError, InfeasibleError, LoweringError
from autopar.runtime.accounting import differences


def _moe():
    """The tiny MoE with two layers, in float64 (routing ties)."""
    from autopar.models import make

    torch.manual_seed(0)
    model, args = make("moe", "tiny", batch=8, n_layers=2)
    return model.double(), tuple(a.double() if a.is_floating_point() else a for a in args)


def _recipe(model, args, axes: dict, recipe: str, **kw) -> autopar.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(autopar.recipes, recipe)(model, autopar.Mesh(axes, device="cpu"), args, progress=False, **kw)


def _backward_gathers(plan) -> int:
    return sum(1 for r in plan.reshardings if r["kind"] == "param"
               and any(s["kind"] == "all_gather" for s in r["steps"])
               and (r.get("phase") == "backward" or next(n for n in plan.nodes if n["name"] == r["consumer"])["phase"]
                    == "backward"))


@pytest.mark.parametrize("family,checkpointing", [("gpt", "none"), ("llama", "none"), ("moe", "none"),
                                                  ("gpt", "full"), ("llama", "selective")])
def test_kept_gathers_on_2x3_compute_what_one_device_computes(family, checkpointing):
    """FSDP over both axes of (2, 3), every layer's gathers kept (and every layer recomputed too):
    the loss and every gradient equal the single-device model's; the plan lists no backward
    gather of the kept layers, every device runs exactly the gathers the plan lists, fewer than
    without keeping, and the plan's memory grows by the kept blocks."""
    model, args = build(family) if family != "moe" else _moe()
    kw = {"precision": "fp64"} if family == "moe" else {}
    plain = _recipe(model, args, {"dp": 2, "tp": 3}, "fsdp", checkpointing=checkpointing, **kw)
    plan = _recipe(model, args, {"dp": 2, "tp": 3}, "fsdp", checkpointing=checkpointing, kept_gathers="all", **kw)
    assert plan.placements == plain.placements and not plain.kept_gathers
    (group,) = plan.layer_groups
    assert plan.kept_gathers == group["paths"] and group["kept"] == group["count"] and group["kept_bytes"] > 0
    # ``plan.memory`` splits the walked peak, whose moment may move: the kept blocks are saved values there
    assert plan.memory["activations"] >= plain.memory["activations"] + group["count"] * group["kept_bytes"]
    assert plan.peak_memory > plain.peak_memory
    assert _backward_gathers(plan) < _backward_gathers(plain)
    trace: dict = {}
    loss, grads = simulated_errors(model, plan, args, trace=trace)
    tol = 1e-9 if family == "moe" else 1e-5
    assert loss <= tol and max(grads.values()) <= tol, (loss, grads)
    plain_trace: dict = {}
    autopar.simulate(model, plain, args, trace=plain_trace)
    assert differences(plan, trace[(0, 0)]) == []
    for coords, ran in trace.items():
        # (a last tensor-axis rank holds smaller uneven pieces than the rank 0 the plan prices: where
        # the plan without kept gathers already differs there, only rank 0 is compared)
        if not differences(plain, plain_trace[coords]):
            assert differences(plan, ran) == [], coords
        gathers = [sum(1 for e in t[coords] if e.kind == "all_gather") for t in (trace, plain_trace)]
        assert gathers[0] < gathers[1], (coords, gathers)


def test_the_search_keeps_gathers_where_they_are_exposed_and_fit():
    """On slow data-axis links the backward's gathers cannot hide under its compute: the search keeps
    them (a faster plan); with the budget just below that plan's peak it gathers again."""
    model, args = build("gpt")
    mesh = autopar.Mesh({"dp": 4}, device="h100", links={"dp": (2e-3, 1e8)})
    hints = {"blocks.*.weight": "S(0)", "blocks.*.bias": "S(0)"}

    def plan(**kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.plan(model, mesh, args, hints=hints, progress=False, deterministic_time=0.5, **kw)

    kept, again = plan(), plan(kept_gathers="none")
    assert kept.kept_gathers == ["blocks.0", "blocks.1"] and again.kept_gathers == []
    assert kept.step_time < again.step_time and kept.peak_memory > again.peak_memory
    tight = plan(memory_budget=kept.peak_memory - 1)
    assert tight.kept_gathers == [] and tight.peak_memory <= kept.peak_memory - 1
    assert "2 of 2 keep their gathered parameters" in kept.summary()
    assert "kept gathers: its parameters gathered in the forward are kept" in kept.explain("blocks.0")
    from autopar.plans.html import render_html

    page = render_html(kept)
    assert "gathers kept" in page and ">2 of 2</td>" in page.split('id="layer-groups"')[1]


def test_kept_gathers_pins():
    """Globs keep the instances they match (the rest gather again); an unknown glob or value is an
    error naming the argument; a recipe keeps nothing unless asked."""
    model, args = build("gpt")
    one = _recipe(model, args, {"dp": 2}, "fsdp", kept_gathers=["blocks.1"])
    assert one.kept_gathers == ["blocks.1"] and one.layer_groups[0]["kept"] == 1
    assert _recipe(model, args, {"dp": 2}, "fsdp", kept_gathers={"blocks.*": True, "blocks.0": False}).kept_gathers \
        == ["blocks.1"]
    assert _recipe(model, args, {"dp": 2}, "fsdp").kept_gathers == []
    loss, grads = simulated_errors(model, one, args)
    assert loss <= 1e-5 and max(grads.values()) <= 1e-5
    with pytest.raises(ArgumentError, match=re.escape("kept_gathers: 'layers.*' match no layer instance")):
        _recipe(model, args, {"dp": 2}, "fsdp", kept_gathers=["layers.*"])
    with pytest.raises(ArgumentError, match=re.escape("kept_gathers='some': expected 'none', 'all'")):
        _recipe(model, args, {"dp": 2}, "fsdp", kept_gathers="some")
    plain = _recipe(model, args, {"dp": 2}, "fsdp")
    with pytest.raises(InfeasibleError, match=r"kept_gathers: keeping the gathered parameters of blocks.0, "
                                                      r"blocks.1 needs .* over the memory budget"):
        _recipe(model, args, {"dp": 2}, "fsdp", kept_gathers="all", memory_budget=plain.peak_memory + 1)


def test_a_plan_keeping_an_unknown_layer_is_refused_before_it_runs():
    model, args = build("gpt")
    plan = _recipe(model, args, {"dp": 2}, "fsdp")
    edited = autopar.Plan.from_dict({**plan.to_dict(), "kept_gathers": ["layers.0"]})
    with pytest.raises(LoweringError, match=r"keeps the gathered parameters of 'layers.0', which is no layer instance"):
        autopar.simulate(model, edited, args)


@pytest.fixture(scope="module")
def pool(gloo_pool4):
    """Four gloo ranks: the pytest process's shared pool (tests/conftest.py)."""
    return gloo_pool4()


@pytest.mark.parametrize("family,axes,recipe", [
    ("llama", (("a", 4),), "fsdp"),
    ("gpt", (("a", 2), ("b", 2)), "fsdp"),
], ids=["llama-4-fsdp", "gpt-2x2-fsdp"])
def test_kept_gathers_train_like_one_device_on_gloo(pool, family, axes, recipe):
    """3 AdamW steps on 4 gloo processes with every layer's gathers kept; rank 0 runs exactly the
    predicted collectives."""
    model, args = build(family)
    text = _recipe(model, args, dict(axes), recipe, kept_gathers="all").to_json()
    assert json.loads(text)["kept_gathers"]
    assert text != plan_json(family, axes, recipe)
    results = pool.run(train_on_rank, family, axes, text)
    for rank, r in enumerate(results):
        assert r["loss"] <= 1e-4 and r["grad"] <= 1e-4 and r["param"] <= 1e-4, (rank, r)
    assert results[0]["differences"] == [], results[0]["differences"]


def test_bf16_mixed_kept_gathers_compute_what_gathering_again_computes():
    """Under bf16-mixed the kept block is the bf16 gathered weight the backward would gather again:
    the same loss and gradients bit for bit, and the plan's kept bytes are bf16 (half the fp32)."""
    model, args = build("llama")
    out, plans = {}, {}
    for kept in ("none", "all"):
        plans[kept] = _recipe(model, args, {"dp": 2, "tp": 2}, "fsdp", kept_gathers=kept, precision="bf16-mixed")
        out[kept] = autopar.simulate(model, plans[kept], args, precision="plan")
    fp32 = _recipe(model, args, {"dp": 2, "tp": 2}, "fsdp", kept_gathers="all")
    assert 2 * plans["all"].layer_groups[0]["kept_bytes"] == fp32.layer_groups[0]["kept_bytes"]
    (la, ga), (lb, gb) = out["all"], out["none"]
    assert rel(la, lb) == 0.0
    for k in gb:
        assert rel(ga[k], gb[k]) == 0.0, k


def test_a_backward_view_of_a_kept_block_is_derived_locally():
    """Where the backward reads a weight through another layout view than the forward (its
    transposes read the sharded weight view, so the consumer needs ``t(t(w))`` gathered), the view
    runs again on the forward's kept block: no gather, the single-device gradients."""
    from autopar.ir.capture import capture
    from autopar.ir.placement import format_placements
    from autopar.passes.lower.resolve import resolve
    from autopar.passes.search.strategies import input_placement, node_strategies, output_placement

    model, args = build("gpt")
    mesh = autopar.Mesh({"dp": 2}, device="cpu")
    plan = _recipe(model, args, {"dp": 2}, "fsdp", kept_gathers="all")
    g = capture(model, args)
    d = plan.to_dict()
    for entry in d["nodes"]:
        n = g.node(entry["name"])
        if (n.phase.value != "backward" or n.op != "aten.t.default" or not n.module_path.startswith("blocks.")
                or g.node(n.inputs[0].node).op != "aten.t.default"):
            continue
        s = next(s for s in node_strategies(g, n, mesh) if format_placements(input_placement(s, 0)) == "S(1)")
        entry.update(strategy=[str(x) for x in s], tags=[x.tag for x in s], inputs=["S(1)"],
                     outputs=[format_placements(output_placement(s, 0))])
    edited = autopar.Plan.from_dict(d)
    replayed = [k for k, v in resolve(g, edited).kept.items() if v.replay]
    assert len(replayed) == 2 * 4  # two layers' four matmul weights
    trace, kept_trace = {}, {}
    loss, grads = simulated_errors(model, edited, args, trace=trace)
    assert loss <= 1e-5 and max(grads.values()) <= 1e-5
    autopar.simulate(model, plan, args, trace=kept_trace)
    gathers = [sorted(e.bytes for e in t[(0,)] if e.kind == "all_gather") for t in (trace, kept_trace)]
    assert gathers[0] == gathers[1]


def test_kept_gathers_on_code_this_project_did_not_write():
    """Hugging Face's GPT-2 (``Conv1D`` weights stored (in, out), read untransposed in the forward)
    under FSDP on (2, 2) with every block's gathers kept: the eager model's loss and gradients,
    and every device runs the gathers the plan lists."""
    from _corpus import build as corpus_build

    from autopar.ir.capture import capture

    model, args, kwargs = corpus_build("hf_gpt2", dtype=torch.float64)
    graph = capture(model, args, kwargs)  # for the plan and the simulation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.recipes.fsdp(model, autopar.Mesh({"dp": 2, "tp": 2}, device="cpu"), args, kwargs,
                                    precision="fp64", progress=False, kept_gathers="all", graph=graph)
    assert plan.kept_gathers == ["transformer.h.0", "transformer.h.1"]
    trace: dict = {}
    loss, grads = autopar.simulate(model, plan, args, kwargs, trace=trace, graph=graph)
    model(*args, **kwargs).loss.backward()
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    got = torch.cat([grads[n].double().flatten() for n in names])
    want = torch.cat([dict(model.named_parameters())[n].grad.double().flatten() for n in names])
    assert rel(got, want) < 1e-6  # (GPT-2 computes its attention in fp32 inside: test_corpus.FP32_INSIDE)
    for coords, ran in trace.items():
        assert not [d for d in differences(plan, ran) if d.startswith("all_gather")], coords
