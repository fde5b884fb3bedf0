"""Ring attention (``ir.rules.ring``): the attention op's ``ring`` and ``ring:balanced`` strategies
proven on the op by execution, forced on whole models whose loss and every gradient the simulator
(and one gloo run) computes as the single-device model does, and priced step by step."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.cost_model.hardware import Link
from autopar.cost_model.precision import get_precision
from autopar.cost_model.ring import ring_inflight_bytes, ring_time, step_works
from autopar.ir.attention import ATTN_BWD, ATTN_FWD, attention, attention_backward
from autopar.ir.graph import Ref, TensorSpec
from autopar.ir.rules import signatures, strategies
from autopar.ir.rules.base import OpCall
from autopar.ir.rules.proof.interp import check_strategy
from autopar.ir.rules.ring import FORMS, RING, RING_BALANCED, forced_form, ring_axis
from autopar.runtime.accounting import differences, predicted

from _parity import rel, simulated_errors, train_on_rank

MESHES = {"cp4": (("cp", 4),), "dp2xcp2": (("dp", 2), ("cp", 2))}
SEQ_HINTS = {"input:0": "cp=S(1)", "input:1": "cp=S(1)"}


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(t.shape), t.dtype)


def _calls(causal: bool, kv_heads: int, seq: int = 16):
    """The forward and backward attention calls on real float64 values, as the rules see them."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, seq, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    out, lse = attention(q, k, v, 0.0, causal)
    g = torch.randn(out.shape, dtype=out.dtype, generator=gen)
    fwd = OpCall(ATTN_FWD, attention, (Ref("q"), Ref("k"), Ref("v"), 0.0, causal), {}, [_spec(q), _spec(k), _spec(v)],
                 [_spec(out), _spec(lse)])
    bwd = OpCall(ATTN_BWD, attention_backward, (Ref("g"), Ref("q"), Ref("k"), Ref("v"), Ref("o"), Ref("l"), 0.0, causal),
                 {}, [_spec(t) for t in (g, q, k, v, out, lse)], [_spec(q), _spec(k), _spec(v)])
    return [(fwd, [q, k, v]), (bwd, [g, q, k, v, out, lse])]


@pytest.mark.parametrize("causal, kv_heads", [(True, 4), (True, 2), (False, 2)])
@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
def test_ring_strategies_proven_on_the_op(causal, kv_heads, mesh):
    """Every ring strategy of the forward and the backward (GQA too, with batch or head splits on
    the other axis) reassembles to the op on whole tensors; each form appears on each axis."""
    seen = set()
    for call, ins in _calls(causal, kv_heads):
        rings = [st for st in strategies(call, mesh) if ring_axis(st) is not None]
        for st in rings:
            res = check_strategy(call, st, mesh, ins)
            assert res.ok, f"{call.op} {[s.tag for s in st]}: {res.error}"
            seen.add((call.op, ring_axis(st)))
    assert seen == {(op, (a, f)) for op in (ATTN_FWD, ATTN_BWD) for a in range(len(mesh)) for f in FORMS}


def test_ring_strategies_compose_only_where_they_hold():
    """One ring axis per strategy, no other sequence split beside it, equal blocks (2n chunks for
    the balanced layout); never with a mask tensor or dropout."""
    (fwd, _), (bwd, _) = _calls(True, 2, seq=12)
    for st in strategies(fwd, (2, 3)) + strategies(bwd, (2, 3)):
        rings = [s.tag for s in st if s.tag in FORMS]
        assert len(rings) <= 1
        if rings:
            assert not any(s.tag in ("S:s", "S:t") for s in st)
    # 12 tokens cut into 2 or 3 blocks, 4 or 6 chunks: both forms on both axes
    forms = {ring_axis(st) for st in strategies(fwd, (2, 3))} - {None}
    assert forms == {(0, RING), (0, RING_BALANCED), (1, RING), (1, RING_BALANCED)}
    (fwd10, _), _ = _calls(True, 2, seq=10)  # 10 tokens: 2 blocks, but not 4 equal chunks
    assert {ring_axis(st) for st in strategies(fwd10, (2,))} - {None} == {(0, RING)}
    masked = dataclasses.replace(fwd, in_specs=fwd.in_specs + [TensorSpec((12, 12), torch.bool)])
    dropped = dataclasses.replace(fwd, args=fwd.args[:3] + (0.1, True))
    for call in (masked, dropped):
        assert not [s for s in signatures(call) if s.tag in FORMS]


def test_forced_form_names_a_form():
    with pytest.raises(ValueError, match="unknown attention form 'ulysses'"):
        with forced_form("ulysses"):
            pass


# ---------------------------------------------------------------------------------------------
# Whole models, ring forced, against the single-device model


class Bidirectional(nn.Module):
    """A small encoder LM without a causal mask: token embedding, attention over all positions
    (``is_causal=False``), an MLP and a token-level loss."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4):
        super().__init__()
        self.emb, self.heads = nn.Embedding(vocab, dim), heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp, self.head = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)), nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        x = x + self.mlp(x)
        return F.cross_entropy(self.head(x).reshape(-1, self.head.out_features), targets.reshape(-1))


def _model(family: str):
    torch.manual_seed(0)
    if family == "bidirectional":
        model = Bidirectional()
        idx = torch.randint(0, 64, (2, 16))
        return model, (idx, torch.roll(idx, -1, 1))
    from autopar.models import make

    return make(family, "tiny", batch=2, seq=16)


def _forced_plan(model, args, axes: tuple, form: str):
    mesh = autopar.Mesh(dict(axes), device="cpu")
    with forced_form(form), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, mesh, args, hints=SEQ_HINTS, deterministic_time=0.5, progress=False)
    forms = [n["tags"][0] if len(axes) == 1 else "|".join(n["tags"]) for n in plan.nodes
             if "attention" in n["name"] or "flash" in n["name"]]
    assert forms and all(form in f.split("|") for f in forms), forms
    return plan


CASES = [(f, m, form) for f in ("gpt", "llama") for m in sorted(MESHES) for form in FORMS] + [
    ("bidirectional", "cp4", RING), ("bidirectional", "dp2xcp2", RING_BALANCED)]


@pytest.mark.parametrize("family, mesh, form", CASES)
def test_forced_ring_matches_the_single_device_model(family, mesh, form):
    """GPT (causal), LLaMA (causal, GQA, RoPE) and a bidirectional encoder, the sequence split on
    ``cp``: the loss and every gradient equal the model's own."""
    model, args = _model(family)
    plan, trace = _forced_plan(model, args, MESHES[mesh], form), {}
    loss_err, grad_errs = simulated_errors(model, plan, args, trace=trace)
    assert loss_err <= 1e-5
    n = dict(MESHES[mesh])["cp"]
    attn = [node["op"] for node in plan.nodes if node["op"] in (ATTN_FWD, ATTN_BWD)]
    own = sum(n - 1 if op == ATTN_FWD else 2 * n - 1 for op in attn)  # the ring's shifts (backward: and home)
    planned = sum(c for (kind, _, _), c in predicted(plan).items() if kind == "permute")  # to and from Z
    for records in trace.values():  # every reshard as the plan predicted; the ring's own exchanges besides
        assert [d for d in differences(plan, records) if not d.startswith("permute on cp")] == []
        assert sum(r.kind == "permute" for r in records) == own + planned >= len(attn) * (n - 1) > 0
    if form == RING_BALANCED and family != "bidirectional":  # the layout reaches the ops around the attention
        assert _balanced_nodes(plan) > len(attn), _balanced_nodes(plan)
    assert grad_errs.keys() == dict(model.named_parameters()).keys()
    assert max(grad_errs.values()) <= 1e-4, grad_errs


def _balanced_nodes(plan) -> int:
    """How many of the plan's ops read or write the balanced layout ``Z``."""
    return sum(any("Z(" in s for s in n["strategy"]) for n in plan.nodes)


@pytest.mark.parametrize("name, mesh, form", [("titan_llama", "cp4", RING_BALANCED), ("hf_llama", "dp2xcp2", RING),
                                              ("hf_llama", "cp4", RING_BALANCED),
                                              ("hf_llama", "dp2xcp2", RING_BALANCED)])
def test_forced_ring_on_model_code_autopar_did_not_write(name, mesh, form):
    """A torchtitan-style LLaMA (complex RoPE from a ``freqs_cis`` buffer, GQA) and Hugging Face's
    LLaMA (keyword inputs, an output object with the loss)."""
    from _corpus import build

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, args, kwargs = build(name)
    hints = {k: "cp=S(1)" for k in kwargs} if kwargs else SEQ_HINTS
    mesh_ = autopar.Mesh(dict(MESHES[mesh]), device="cpu")
    with forced_form(form), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, mesh_, tuple(args), kwargs or None, hints=hints, deterministic_time=0.5,
                            progress=False)
    assert all(form in n["tags"] for n in plan.nodes if n["op"] in (ATTN_FWD, ATTN_BWD))
    if form == RING_BALANCED:
        assert _balanced_nodes(plan) > 4
    loss, grads = autopar.simulate(model, plan, tuple(args), kwargs or None)
    out = model(*args, **(kwargs or {}))
    ref = out if isinstance(out, torch.Tensor) else out.loss
    ref.backward()
    assert rel(loss if isinstance(loss, torch.Tensor) else loss.loss, ref) <= 1e-5
    assert max(rel(grads[n], p.grad) for n, p in model.named_parameters() if p.grad is not None) <= 1e-4


@pytest.fixture(scope="module")
def pool(gloo_pool4):
    return gloo_pool4()


def test_balanced_ring_trains_on_gloo(pool):
    """LLaMA with balanced ring attention on 4 gloo ranks: AdamW steps next to the single-device
    model (the point-to-point permutations are gloo all-to-alls with one non-empty piece)."""
    from _parity import build

    model, args = build("llama")
    axes = MESHES["cp4"]
    with forced_form(RING_BALANCED):
        plan = autopar.plan(model, autopar.Mesh(dict(axes), device="cpu"), args, hints=SEQ_HINTS,
                            deterministic_time=0.5, progress=False)
    assert any(RING_BALANCED in n["tags"] for n in plan.nodes)
    for out in pool.run(train_on_rank, "llama", axes, plan.to_json()):
        assert out["loss"] <= 1e-5 and out["grad"] <= 1e-4 and out["param"] <= 1e-4, out
        # the plan's collectives ran as predicted; the ring's permutations, inside the ops, besides them
        assert out["differences"] and all(d.startswith("permute on cp") for d in out["differences"]), out


# ---------------------------------------------------------------------------------------------
# Pricing


def test_step_work_of_each_layout():
    """Causal: the contiguous ring pays a whole block at every step after the first (its last
    device), the balanced one half a block at every step; without a mask both pay a block."""
    n = 8
    whole = lambda works, chunk: sum(w * chunk + d * chunk / 2 for w, d in works)  # noqa: E731
    assert whole(step_works(n, True, False), 1.0) == n - 1 + 0.5
    assert whole(step_works(n, True, True), 0.25) == n / 2
    assert whole(step_works(n, False, False), 1.0) == whole(step_works(n, False, True), 0.25) == n


def _shapes(call: OpCall, n: int):
    ins = [tuple(s.shape[:2]) + (s.shape[2] // n,) + tuple(s.shape[3:]) for s in call.in_specs]
    outs = [tuple(s.shape[:2]) + (s.shape[2] // n,) + tuple(s.shape[3:]) for s in call.out_specs]
    return ins, outs


def _long_call(causal: bool, seq: int = 65536):
    q = TensorSpec((1, 32, seq, 128), torch.bfloat16)
    kv = TensorSpec((1, 8, seq, 128), torch.bfloat16)
    return OpCall(ATTN_FWD, attention, (Ref("q"), Ref("k"), Ref("v"), 0.0, causal), {}, [q, kv, kv],
                  [q, TensorSpec((1, 32, seq), torch.float32)])


def test_ring_price_overlaps_transfers_and_charges_the_imbalance():
    mesh = autopar.Mesh({"cp": 8}, device="h100")
    hw = mesh.hardware
    prec = get_precision("bf16", hw)
    link = mesh.link(0)
    sig = lambda tag: tuple(s for s in strategies(_long_call(True), (8,)) if ring_axis(s) == (0, tag))[0]  # noqa: E731
    causal, full = _long_call(True), _long_call(False)
    ins, outs = _shapes(causal, 8)
    contiguous = ring_time(causal, sig(RING), ins, outs, 8, link, hw, prec)
    balanced = ring_time(causal, sig(RING_BALANCED), ins, outs, 8, link, hw, prec)
    unmasked = ring_time(full, sig(RING), ins, outs, 8, link, hw, prec)
    assert balanced < 0.7 * contiguous < unmasked  # ~n/2 blocks against ~n-1/2 and n
    block = ins[1][0] * ins[1][1] * ins[1][2] * ins[1][3] * 2  # one k (or v) block's bytes
    # a link too slow to hide the transfers: each of the 7 steps before the last waits for its k and v
    slow = Link(latency=link.latency, bandwidth=link.bandwidth / 1e4)
    hop = 2 * block / slow.bandwidth
    assert 7 * hop < ring_time(causal, sig(RING), ins, outs, 8, slow, hw, prec) < 7 * hop + contiguous
    assert ring_inflight_bytes(causal, ins, prec) >= 4 * block  # two k and two v blocks in flight


def test_a_causal_query_split_is_priced_at_its_busiest_device():
    """The gather form (q split on the sequence, keys whole) under a causal mask: the last of N
    contiguous query blocks sees almost every key, so the op costs (2N - 1) / N of its averaged
    price; balanced ring then beats it, as it does when run."""
    from autopar.cost_model.compute import compute_time
    from autopar.cost_model.ring import causal_split_factor

    mesh = autopar.Mesh({"cp": 8}, device="h100")
    hw, link = mesh.hardware, mesh.link(0)
    prec = get_precision("bf16", hw)
    causal, full = _long_call(True), _long_call(False)
    gather = lambda call: next(s for s in strategies(call, (8,)) if s[0].tag == "S:s")  # noqa: E731
    assert causal_split_factor(causal, gather(causal), (8,)) == pytest.approx(15 / 8)
    assert causal_split_factor(full, gather(full), (8,)) == 1.0
    ring = next(s for s in strategies(causal, (8,)) if ring_axis(s) == (0, RING_BALANCED))
    assert causal_split_factor(causal, ring, (8,)) == 1.0  # ring prices its own steps
    ins, outs = _shapes(causal, 8)
    q_block = [ins[0]] + [tuple(x.shape) for x in causal.in_specs[1:]]  # the keys and values whole
    busiest = compute_time(causal, q_block, outs, hw, prec) * 15 / 8
    assert ring_time(causal, ring, ins, outs, 8, link, hw, prec) < busiest


def test_search_weighs_ring_against_the_other_forms():
    """Unforced, the search sees both ring forms among an attention op's candidates, priced."""
    from autopar.ir.capture import capture
    from autopar.passes.search.strategies import search_strategies

    model, args = _model("gpt")
    graph = capture(model, args)
    mesh = autopar.Mesh({"cp": 4}, device="h100")
    node = next(n for n in graph.nodes if n.op == ATTN_FWD)
    tags = {s[0].tag for s in search_strategies(graph, node, mesh)}
    assert {RING, RING_BALANCED, "S:s", "S:h"} <= tags


def test_search_picks_ring_where_heads_cannot_split():
    """64k tokens of a 4-head encoder on 8 H100s, the sequence split: the heads cannot cover the
    axis and a gathered key/value sequence costs more than blocks passed under compute, so the
    unforced search runs ring attention forward and backward."""
    torch.manual_seed(0)
    model = Bidirectional(vocab=1024, dim=1024, heads=4)
    idx = torch.randint(0, 1024, (1, 65536))
    plan = autopar.plan(model, autopar.Mesh({"cp": 8}, device="h100"), (idx, idx), hints=SEQ_HINTS,
                        deterministic_time=0.5, progress=False)
    tags = [n["tags"][0] for n in plan.nodes if n["op"] in (ATTN_FWD, ATTN_BWD)]
    assert len(tags) == 2 and all(t in FORMS for t in tags), tags
