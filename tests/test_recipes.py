"""The named recipes lay weights out as the systems they are named after do (Megatron-LM,
torchtitan's FSDP x TP, FSDP2, DDP), on autopar's GPT and LLaMA and on Hugging Face's GPT-2 and
LLaMA as they are written (GPT-2's ``Conv1D`` stores its weights transposed: the column-parallel
split is then its dim 1). Placements are written per mesh axis, ``"dp, tp"``."""

from __future__ import annotations

import json
import re

import pytest
import torch

import autopar

from _parity import build, plan_json, simulated_errors

try:
    import transformers
except ImportError:
    transformers = None

needs_hf = pytest.mark.skipif(transformers is None, reason="transformers is not installed")

#: Megatron's roles of autopar's and Hugging Face's weights: column-parallel (split along their
#: output features), row-parallel (input features), the vocabulary-parallel token embedding and
#: head, and what stays whole on the tensor axis.
COLUMN = r"(attn\.qkv|mlp\.fc|wq|wk|wv|w1|w3|q_proj|k_proj|v_proj|gate_proj|up_proj|c_attn|mlp\.c_fc)\.weight$"
ROW = r"(attn\.proj|mlp\.proj|wo|w2|o_proj|down_proj|attn\.c_proj|mlp\.c_proj)\.weight$"
COLUMN_BIAS = r"(attn\.qkv|mlp\.fc|c_attn|mlp\.c_fc)\.bias$"
VOCAB = r"(wte|tok_embeddings|embed_tokens|output|lm_head)\.weight$"


def megatron_dim(fqn: str, transposed: bool = False) -> int | None:
    """The dim Megatron splits parameter ``fqn`` along on the tensor axis (None: replicated).
    ``transposed``: weights stored (in, out), as GPT-2's ``Conv1D``."""
    if re.search(COLUMN, fqn):
        return 1 if transposed else 0
    if re.search(ROW, fqn):
        return 0 if transposed else 1
    if re.search(COLUMN_BIAS, fqn) or re.search(VOCAB, fqn):
        return 0
    return None  # norms, row-parallel biases, the position embedding, rotary buffers


def params_of(plan) -> dict[str, str]:
    return {k: v for k, v in plan.placements.items() if "." in k and not k.endswith("inv_freq")}


def check_megatron(plan, transposed: bool = False, data: str = "B") -> None:
    """Every weight on the tensor axis (the last) as Megatron's; ``data``: on the data axis, B (DDP)."""
    for fqn, pl in params_of(plan).items():
        d = megatron_dim(fqn, transposed)
        want = "B" if d is None else f"S({d})"
        got = [p.strip() for p in re.split(r",\s*(?![^(]*\))", pl)]
        assert got[-1] == want, (fqn, pl)
        if len(got) > 1:
            assert got[0] == data, (fqn, pl)


def check_fsdp_tp(plan, transposed: bool = False) -> None:
    """torchtitan's FSDP x TP: Megatron's split on the tensor axis, and every parameter sharded on
    the data axis along another dim (a vector split on the tensor axis stays whole on the data axis)."""
    for fqn, pl in params_of(plan).items():
        d = megatron_dim(fqn, transposed)
        dp, tp = [p.strip() for p in re.split(r",\s*(?![^(]*\))", pl)]
        assert tp == ("B" if d is None else f"S({d})"), (fqn, pl)
        if d is None:
            assert dp == "S(0)", (fqn, pl)
        elif "bias" in fqn:
            assert dp == "B", (fqn, pl)
        else:
            assert dp == f"S({1 - d})", (fqn, pl)


def _plan(family: str, axes: dict, recipe: str):
    model, args = build(family)
    return getattr(autopar.recipes, recipe)(model, autopar.Mesh(axes, device="cpu"), args, progress=False)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_megatron_tp_and_sp_are_megatrons_layout(family):
    for recipe in ("megatron_tp", "megatron_sp"):
        check_megatron(_plan(family, {"dp": 2, "tp": 2}, recipe))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_fsdp_tp_is_torchtitans_layout(family):
    check_fsdp_tp(_plan(family, {"dp": 2, "tp": 2}, "fsdp_tp"))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_fsdp_shards_dim_0_and_ddp_replicates(family):
    fsdp, ddp = _plan(family, {"dp": 4}, "fsdp"), _plan(family, {"dp": 4}, "ddp")
    assert set(params_of(fsdp).values()) == {"S(0)"}, params_of(fsdp)
    assert set(params_of(ddp).values()) == {"B"}, params_of(ddp)


def test_fsdp_tp_computes_what_the_model_computes():
    """The layout runs: the simulator's loss and gradients on (2, 2) are the single device's."""
    plan = autopar.Plan.from_dict(json.loads(plan_json("llama", (("dp", 2), ("tp", 2)), "fsdp_tp")))
    check_fsdp_tp(plan)
    model, args = build("llama")
    loss_err, grad_errs = simulated_errors(model, plan, args)
    assert loss_err < 1e-6
    for name, err in grad_errs.items():
        assert err < 1e-6, name


def _hf(name: str):
    """Tiny Hugging Face GPT-2 or LLaMA with its default options (``test_materialize.hf_model``) and
    token ids as inputs and labels."""
    from test_materialize import hf_model

    torch.manual_seed(0)
    model = hf_model(name)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    return model, dict(input_ids=ids, labels=ids)


@needs_hf
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_models_get_the_same_layouts(name):
    model, kwargs = _hf(name)
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")
    transposed = name == "gpt2"  # Conv1D: (in, out)
    check_fsdp_tp(autopar.recipes.fsdp_tp(model, mesh, (), kwargs, progress=False), transposed)
    check_megatron(autopar.recipes.megatron_tp(model, mesh, (), kwargs, progress=False), transposed)


def test_the_layout_checks_can_fail():
    """The checks reject the old row-parallel-everywhere FSDP x TP layout."""

    class Fake:
        placements = {"layers.0.attention.wq.weight": "S(0), S(1)"}

    with pytest.raises(AssertionError):
        check_fsdp_tp(Fake())
    with pytest.raises(AssertionError):
        check_megatron(Fake())


def test_ddp_completes_as_ddp_when_a_collective_kind_is_priced_up(tmp_path):
    """DDP's completion (greedy + local search) keeps the activations on the batch split when a
    calibrated link prices reduce-scatter at 1.56x its ring time (gloo runs it as an all-reduce).
    Greedy alone fell into a plan gathering activations on GPT (2, 2): 22 collectives, 3.7x the
    price; the propagation's start, kept when cheaper, follows the recipe's input placements."""
    import dataclasses

    from autopar.cost_model.hardware import PRESETS, Link, save_profile
    from autopar.models import make

    link = Link(2343e-6, 1.26e9, {"reduce_scatter": 1.56})
    path = tmp_path / "profile.json"
    save_profile(dataclasses.replace(PRESETS["cpu"], intra_node=link, inter_node=link, overlap_slowdown=0.99),
                 str(path), base="cpu")
    model, inputs = make("gpt", "tiny", batch=8, device="meta")
    plan = autopar.recipes.ddp(model, autopar.Mesh({"dp": 2, "tp": 2}, device="cpu", profile=str(path)), inputs,
                               progress=False)
    assert {c["kind"] for c in plan.collectives} == {"all_reduce"}, plan.collectives


def test_a_baseline_is_a_greedy_completion_and_the_summary_says_so():
    """A tensor-parallel recipe leaves some ops open: the plan's baselines complete them greedily (a cheap start for
    the search), ``recipe=`` exactly. So the named recipe is never slower than its baseline (here it is faster),
    and the summary's baselines table says why the two differ."""
    from autopar.models import make

    model, args = make("mlp", "tiny", batch=8)
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")
    plan = autopar.plan(model, mesh, args, progress=False, deterministic_time=0.5)
    alone = autopar.recipes.megatron_tp(model, mesh, args)
    assert alone.step_time < plan.baselines["megatron_tp"]["step_time"]
    assert "completed greedily here, and exactly when planned alone with recipe=NAME" in plan.summary()
