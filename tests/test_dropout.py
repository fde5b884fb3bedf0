"""Dropout and random ops: the counter-based draw (``autopar.ir.rules.random_ops``), its placement
independence, sharded programs against their own 1-device program, and the step in the state dict."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from _dropout_helpers import SEED, P, build_gpt, close, corpus_programs, corpus_step_on_rank, train_and_restore_on_rank

import autopar
from autopar.errors import CaptureError
from autopar.ir.capture import capture
from autopar.ir.graph import Ref, TensorSpec
from autopar.ir.placement import local_block
from autopar.ir.rules import strategies
from autopar.ir.rules.base import LocalCtx, OpCall
from autopar.ir.rules.proof.interp import device_coords
from autopar.ir.rules.random_ops import (
    SUPPORTED,
    draw,
    draw_key,
    draw_local,
    global_index,
    hash_indices,
    splitmix,
)
from autopar.parallel import RANDOM_KEY

FUSED = "autopar.attention.default"

N = 1 << 20
#: 64-bit wraparound of the reference computation (Python ints do not overflow)
M64 = (1 << 64) - 1


def _dropout_mask(key: int, n: int = N, p: float = P) -> torch.Tensor:
    x = torch.ones(n, dtype=torch.float64)
    return draw("aten.native_dropout.default", (x, p, True), {}, [x], torch.arange(n), key)[1]


def _within_4_sigma(rate: float, expected: float, n: int) -> bool:
    return abs(rate - expected) <= 4 * math.sqrt(expected * (1 - expected) / n)


# -- the generator ----------------------------------------------------------------------------------

def test_hash_is_splitmix64_of_the_index():
    """The vectorized int64 hash is splitmix64 exactly (so int64 overflow wraps as it must)."""
    key = 0x0123456789ABCDEF
    idx = torch.arange(500, dtype=torch.int64) * 7919 + (1 << 40)
    got = [v & M64 for v in hash_indices(key, idx).tolist()]
    assert got == [splitmix((key + i * 0x9E3779B97F4A7C15) & M64) for i in idx.tolist()]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_within_4_sigma_of_1_minus_p(p):
    keep = _dropout_mask(draw_key(1234, 0, "native_dropout"), p=p)
    assert _within_4_sigma(keep.double().mean().item(), 1 - p, N)
    x = torch.ones(N, dtype=torch.float64)
    out, mask = draw("aten.native_dropout.default", (x, p, True), {}, [x], torch.arange(N), 7)
    assert torch.equal(out[mask], torch.full_like(out[mask], 1 / (1 - p))) and (out[~mask] == 0).all()


def test_other_draws_follow_their_distributions():
    x = torch.zeros(N, dtype=torch.float64)
    idx, key = torch.arange(N), draw_key(5, 3, "op")
    b = draw("aten.bernoulli.p", (x, 0.25), {}, [x], idx, key)[0]
    assert set(b.unique().tolist()) == {0.0, 1.0} and _within_4_sigma(b.mean().item(), 0.25, N)
    probs = torch.linspace(0, 1, N, dtype=torch.float64)
    bp = draw("aten.bernoulli.default", (probs,), {}, [probs], idx, key)[0]
    assert abs(bp.mean().item() - 0.5) <= 4 * math.sqrt(1 / 6 / N)  # var of Bernoulli(U): 1/6
    u = draw("aten.rand_like.default", (x,), {}, [x], idx, key)[0]
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean().item() - 0.5) <= 4 * math.sqrt(1 / 12 / N)
    z = draw("aten.randn_like.default", (x,), {}, [x], idx, key)[0]
    assert abs(z.mean().item()) <= 4 / math.sqrt(N) and abs(z.var().item() - 1) <= 4 * math.sqrt(2 / N)


def test_masks_differ_across_steps_ops_and_elements():
    """Two independent masks agree on a fraction p^2 + (1-p)^2 of the elements (within 4 sigma):
    so do masks of other steps, other ops, other seeds, and neighbouring elements of one mask."""
    base = _dropout_mask(draw_key(1, 0, "native_dropout"))
    agree = P * P + (1 - P) * (1 - P)
    for other in (draw_key(1, 1, "native_dropout"), draw_key(1, 0, "native_dropout_1"),
                  draw_key(2, 0, "native_dropout")):
        rate = (base == _dropout_mask(other)).double().mean().item()
        assert _within_4_sigma(rate, agree, N), rate
    half = N // 2
    rate = (base[0::2] == base[1::2]).double().mean().item()  # neighbours
    assert _within_4_sigma(rate, agree, half), rate
    rate = (base[:half] == base[half:]).double().mean().item()  # far apart
    assert _within_4_sigma(rate, agree, half), rate
    assert torch.equal(base, _dropout_mask(draw_key(1, 0, "native_dropout")))  # a recomputation redraws it


# -- placement independence -------------------------------------------------------------------------

def _dropout_call(shape, blocks=()) -> OpCall:
    spec = TensorSpec(tuple(shape), torch.float64, blocks)
    return OpCall("aten.native_dropout.default", torch.ops.aten.native_dropout.default, (Ref("x", 0), P, True), {},
                  [spec], [spec, TensorSpec(tuple(shape), torch.bool, blocks)])


@pytest.mark.parametrize("shape,blocks", [((4, 6, 8), ()), ((4, 12, 6), ((1, 3),))], ids=["plain", "blocks"])
def test_every_piece_draws_the_whole_tensors_piece_and_copies_agree(shape, blocks):
    """On a (2, 2) mesh, under every strategy the rule offers (block-split dims included), each
    device's output and mask are its block of the 1-device draw; replicated copies hence agree."""
    call = _dropout_call(shape, blocks)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    key = draw_key(9, 4, "native_dropout_2")
    one = draw_local(LocalCtx(call, strategies(call, (1,))[0], (1,), (0,)), [x], key)
    mesh = (2, 2)
    strats = strategies(call, mesh)
    assert len(strats) > 4 and any(any(str(s.outputs[0]).startswith("S") for s in st) for st in strats)
    for st in strats:
        pl_in = [s.inputs[0] for s in st]
        for c in device_coords(mesh):
            ctx = LocalCtx(call, st, mesh, c)
            got = draw_local(ctx, [local_block(x, pl_in, mesh, c, blocks)], key)
            for j in (0, 1):
                want = local_block(one[j], ctx.out_placements(j), mesh, c, blocks)
                assert torch.equal(got[j], want), (st, c, j)


def test_global_index_numbers_a_block_by_its_place_in_the_whole_tensor():
    from autopar.ir.placement import B, Split

    shape, blocks = (4, 12, 6), ((1, 3),)
    whole = torch.arange(math.prod(shape)).view(shape)
    for pl in [(Split(0), Split(1)), (Split(1), Split(2)), (B, Split(1)), (Split(2), B)]:
        for c in device_coords((2, 2)):
            assert torch.equal(global_index(shape, pl, (2, 2), c, blocks), local_block(whole, pl, (2, 2), c, blocks))


# -- whole programs -------------------------------------------------------------------------------

def _plan(model, args, axes, kwargs=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, autopar.Mesh(axes, device="cpu"), args, kwargs, progress=False, **kw)


def _simulate(model, plan, args, kwargs=None, seed=5, graph=None):
    """``graph``: the model's capture, shared by a test's plans and simulations (a capture costs
    seconds; it draws nothing from torch's generator)."""
    torch.manual_seed(seed)  # simulate draws the run's seed from torch's default generator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.simulate(model, plan, args, kwargs, graph=graph)


def _assert_same(a, b, tol):
    (la, ga), (lb, gb) = a, b
    assert abs(la.item() - lb.item()) <= tol * abs(lb.item()), (la, lb)
    assert ga.keys() == gb.keys()
    for k in ga:
        assert torch.allclose(ga[k], gb[k], rtol=tol, atol=tol * gb[k].abs().max().item()), k


@pytest.fixture(scope="module")
def gpt_plans():
    model, args = build_gpt()
    return {"one": _plan(model, args, {"a": 1}), "search": _plan(model, args, {"a": 2, "b": 2}),
            "megatron_tp": _plan(model, args, {"a": 2, "b": 2}, recipe="megatron_tp")}


@pytest.mark.parametrize("which", ["search", "megatron_tp"])
def test_gpt_with_dropout_on_2x2_equals_its_one_device_program(gpt_plans, which):
    model, args = build_gpt()
    graph = capture(model, args)
    assert "aten.native_dropout.default" in {n.op for n in graph.ops()}
    one = _simulate(model, gpt_plans["one"], args, graph=graph)
    _assert_same(_simulate(model, gpt_plans[which], args, graph=graph), one, 1e-9)
    # the draw matters: another seed, or no dropout, is another loss
    assert abs(_simulate(model, gpt_plans["one"], args, seed=6, graph=graph)[0].item() - one[0].item()) > 1e-6
    model.eval()
    plain = model(*args).item()
    assert abs(plain - one[0].item()) > 1e-6


@pytest.mark.parametrize("which", ["search", "megatron_tp"])
def test_the_plans_split_the_dropout_masks(gpt_plans, which):
    """The parity above is not vacuous: dropout runs on a device's piece of its tensor."""
    drops = [n for n in gpt_plans[which].nodes if n["op"] == "aten.native_dropout.default"]
    assert len(drops) == 5 and any("S(" in n["outputs"][1] for n in drops), drops
    attn = [n for n in gpt_plans[which].nodes if n["op"].startswith("autopar.attention")]
    assert len(attn) == 4 and all("S(" in n["outputs"][0] for n in attn), attn
    if which == "megatron_tp":  # heads split on the tensor axis, with the dropout inside
        assert all(n["outputs"][0] == "S(0), S(1)" for n in attn if n["phase"] == "forward"), attn


def test_attention_with_dropout_and_a_learned_mask_takes_the_math_path():
    """A mask that requires grad (T5's position bias) has no gradient from the fused op: that
    attention runs torch's math path, its dropout drawn like any other, and it still shards."""

    class BiasAttn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24).double()
            self.bias = torch.nn.Parameter(torch.randn(1, 2, 6, 6, dtype=torch.float64))

        def forward(self, x):
            q, k, v = self.qkv(x).view(4, 6, 3, 2, 4).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, self.bias, dropout_p=P).pow(2).sum()

    torch.manual_seed(0)
    model, x = BiasAttn(), torch.randn(4, 6, 8, dtype=torch.float64)
    g = capture(model, (x,))
    assert "aten.native_dropout.default" in g.op_names() and FUSED not in g.op_names()
    one = _simulate(model, _plan(model, (x,), {"a": 1}), (x,))
    assert one[1]["bias"].abs().sum() > 0
    _assert_same(_simulate(model, _plan(model, (x,), {"a": 2, "b": 2}, recipe="ddp"), (x,)), one, 1e-9)


def test_hugging_face_bert_with_a_padding_mask_and_default_dropout_on_2x2_equals_its_one_device_program():
    """An encoder: no causal mask, a padding mask passed to the fused attention with dropout."""
    transformers = pytest.importorskip("transformers")
    from transformers import BertConfig, BertForMaskedLM

    transformers.logging.set_verbosity_error()
    cfg = BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=100, max_position_embeddings=64)  # both dropouts: their default 0.1
    torch.manual_seed(0)
    model = BertForMaskedLM(cfg).to(torch.float64)
    model.config._attn_implementation = "sdpa"
    model.train()
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(4, 16, dtype=torch.long)
    pad[0, 12:] = 0
    kwargs = dict(input_ids=ids, attention_mask=pad, labels=ids)
    graph = capture(model, (), kwargs)  # one capture for the three plans and their simulations
    fused = [n for n in graph.ops() if n.op == FUSED]
    assert len(fused) == 2 and all(n.args[3] == 0.1 and "attn_mask" in n.kwargs for n in fused)
    one = _simulate(model, _plan(model, (), {"a": 1}, kwargs, graph=graph), (), kwargs, graph=graph)
    for recipe in (None, "ddp"):
        plan = _plan(model, (), {"a": 2, "b": 2}, kwargs, recipe=recipe, graph=graph)
        (loss, grads) = _simulate(model, plan, (), kwargs, graph=graph)
        assert abs(loss.item() - one[0].item()) <= 1e-9 * abs(one[0].item())
        # one scale for all gradients: the key biases' are zero up to roundoff (softmax ignores a shift)
        scale = max(g.abs().max().item() for g in one[1].values())
        for k, g in grads.items():
            assert torch.allclose(g, one[1][k], rtol=1e-9, atol=1e-9 * scale), (recipe, k)


def test_unsupported_random_ops_are_refused_by_name_at_capture():
    """Before planning: the op and its module are named."""

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            return (y * torch.randint_like(y, 3)).sum()

    with pytest.raises(CaptureError, match=r"(?s)aten\.randint_like\.default in '<root>'.*native_dropout"):
        autopar.plan(Noisy(), autopar.Mesh({"a": 2}, device="cpu"), (torch.randn(4, 8),), progress=False)
    assert "aten.rand_like.default" in SUPPORTED


def test_drop_path_style_ops_run_placement_independently():
    """``new_empty(...).bernoulli_(p)`` (DropPath) and ``rand_like`` are drawn like dropout."""

    class DropPath(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8).double()

        def forward(self, x):
            y = self.lin(x)
            keep = y.new_empty((y.shape[0], 1)).bernoulli_(0.7)
            return (y * keep / 0.7 + 0.1 * torch.rand_like(y) * y).sum()

    model, x = DropPath(), torch.randn(16, 8, dtype=torch.float64)
    ops = {n.op for n in capture(model, (x,)).ops()}
    assert {"aten.bernoulli.p", "aten.rand_like.default"} <= ops
    one = _simulate(model, _plan(model, (x,), {"a": 1}), (x,))
    for recipe in ("ddp", None):
        _assert_same(_simulate(model, _plan(model, (x,), {"a": 2, "b": 2}, recipe=recipe), (x,)), one, 1e-9)


# -- gloo: the seed, the step and the state dict --------------------------------------------------

@pytest.fixture(scope="module")
def pool(gloo_pool4):
    """Four gloo ranks: the pytest process's shared pool (tests/conftest.py)."""
    return gloo_pool4()


def test_gloo_training_matches_simulation_and_the_state_dict_keeps_seed_and_step(pool, gpt_plans, tmp_path):
    """On 4 gloo ranks (megatron_tp on (2, 2)): the first loss and gradients equal the simulated
    program's with the same torch seed; the state dict carries [seed, step] (step 2 after two forwards), and a
    module compiled from another seed and other weights, after loading it, draws what the saved
    one draws next (saved and loaded with torch.distributed.checkpoint)."""
    plan = gpt_plans["megatron_tp"]
    model, args = build_gpt()
    torch.manual_seed(11)
    want, grads = autopar.simulate(model, plan, args)
    want = want.item()
    results = pool.run(train_and_restore_on_rank, plan.to_json(), 11, grads, str(tmp_path / "ckpt"))
    for rank, r in enumerate(results):
        assert abs(r["losses"][0] - want) <= 1e-9 * abs(want), (rank, r["losses"], want)
        assert r["grad"] <= 1e-9, (rank, r["grad"])  # the backward redraws its forward's attention masks
        assert r["losses"] == results[0]["losses"]
        assert r["random_is_dtensor"]
        seed, step = r["random"]
        assert step == 2 and seed == results[0]["random"][0]
        assert r["other_random"][1] == 0 and r["other_random"][0] != seed
        assert r["restored_random"] == [seed, 2]
        assert abs(r["restored_next"] - r["next"]) <= 1e-9 * abs(r["next"]), (rank, r)
    assert RANDOM_KEY == "_autopar_random"


def test_corpus_models_with_dropout_on_gloo_equal_their_one_device_program(pool):
    """Two corpus models with their dropout on (``nn.TransformerEncoder``: PyTorch's attention;
    Hugging Face BERT), compiled on 4 gloo ranks under their (2, 2) ``fsdp_tp`` plans after the seed
    their simulated 1-device program ran with: one step gives its loss and gradients on every rank
    (tests/test_corpus_dropout.py checks every corpus model so in the simulator). The next step's
    masks differ (another loss from the same weights) and agree across ranks."""
    pytest.importorskip("transformers")
    names = ("torch_encoder", "hf_bert")
    results = pool.run(corpus_step_on_rank, [(n, corpus_programs(n)[2].to_json()) for n in names], SEED)
    for rank, r in enumerate(results):
        for name in names:
            close(r[name], corpus_programs(name)[3], 1e-9, (rank, name))
            assert r[name + ":next"] == results[0][name + ":next"], (rank, name)
            assert abs(r[name + ":next"] - r[name][0]) > 1e-6 * abs(r[name][0]), (rank, name)


# -- attention with dropout: one fused op -------------------------------------------------------

def _attention_calls(b=2, h=4, hk=4, s=6, d=4, p=0.3, causal=True):
    from autopar.ir.rules.random_attention import ATTN_BWD, ATTN_FWD

    f64 = torch.float64
    q, k = TensorSpec((b, h, s, d), f64), TensorSpec((b, hk, s, d), f64)
    lse = TensorSpec((b, h, s), f64)
    fwd = OpCall(ATTN_FWD, None, (Ref("q", 0), Ref("k", 0), Ref("v", 0), p, causal), {}, [q, k, k], [q, lse])
    bwd = OpCall(ATTN_BWD, None, (Ref("g", 0), Ref("q", 0), Ref("k", 0), Ref("v", 0), Ref("o", 0), Ref("f", 1), p,
                                  causal), {}, [q, q, k, k, q, lse], [q, k, k])
    gen = torch.Generator().manual_seed(1)
    qkv = [torch.randn(t.shape, dtype=f64, generator=gen) for t in (q, k, k)]
    return fwd, bwd, qkv, torch.randn(q.shape, dtype=f64, generator=gen)


def test_attention_with_dropout_matches_autograd_of_its_own_forward():
    """On one device the fused op is softmax attention with the drawn mask: its backward is
    autograd's of that forward (GQA: 2 query heads per key head), and with p -> 0 it is SDPA."""
    from autopar.ir.rules.random_attention import attention_local, keep_mask

    for hk in (4, 2):
        fwd, bwd, (q, k, v), g = _attention_calls(hk=hk)
        one = lambda call: LocalCtx(call, strategies(call, (1,))[0], (1,), (0,))
        out, lse = attention_local(one(fwd), [q, k, v], 77)
        dq, dk, dv = attention_local(one(bwd), [g, q, k, v, out, lse], 77)
        keep = keep_mask(one(fwd), 0, k.shape[2], 77, 0.3, None).double()
        assert 0.5 < keep.mean().item() < 0.9
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ke, ve = kr.repeat_interleave(4 // hk, 1), vr.repeat_interleave(4 // hk, 1)
        sc = qr @ ke.transpose(-1, -2) / 2.0 + torch.full((6, 6), float("-inf"), dtype=torch.float64).triu(1)
        ref = (torch.softmax(sc, -1) * keep / 0.7) @ ve
        ref.backward(g)
        assert torch.allclose(out, ref, atol=1e-12)
        for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
            assert torch.allclose(got, want, atol=1e-12)
    fwd, _, (q, k, v), _ = _attention_calls(p=1e-300)
    out, _ = attention_local(LocalCtx(fwd, strategies(fwd, (1,))[0], (1,), (0,)), [q, k, v], 5)
    assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-12)


def _check_attention_blocks(call, st, ins, want, seed: int, label) -> None:
    """Strategy ``st`` of the fused attention ``call`` on (2, 2): every device runs its blocks of
    ``ins`` (drawing with ``seed``), and the reassembled outputs equal ``want``, the 1-device ones."""
    from autopar.ir.rules.proof.interp import collect
    from autopar.ir.rules.random_attention import attention_local

    mesh = (2, 2)
    per = {}
    for c in device_coords(mesh):
        ctx = LocalCtx(call, st, mesh, c)
        per[c] = attention_local(ctx, [local_block(x, ctx.in_placements(i), mesh, c) for i, x in enumerate(ins)], seed)
    for j, w in enumerate(want):
        got = collect({c: per[c][j] for c in per}, [s.outputs[j] for s in st], mesh, rtol=1e-9)
        assert torch.allclose(got, w, atol=1e-10), (label, st, j)


@pytest.mark.parametrize("kind", ["additive", "bool"])
def test_attention_with_dropout_applies_its_attention_mask(kind):
    """A padding mask (``[b 1 1 t]``, as encoders pass it) reaches the fused op's math, forward and
    backward, on one device and under every (2, 2) strategy."""
    from autopar.ir.rules.random_attention import ATTN_BWD, ATTN_FWD, attention_local, keep_mask

    fwd, bwd, (q, k, v), g = _attention_calls(causal=False)
    valid = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    valid[0, ..., 4:] = False
    m = valid if kind == "bool" else torch.zeros(valid.shape, dtype=torch.float64).masked_fill(~valid, float("-inf"))
    mspec = TensorSpec(tuple(m.shape), m.dtype)
    fwd = OpCall(ATTN_FWD, None, fwd.args, {"attn_mask": Ref("m", 0)}, fwd.in_specs + [mspec], fwd.out_specs)
    bwd = OpCall(ATTN_BWD, None, bwd.args, {"attn_mask": Ref("m", 0)}, bwd.in_specs + [mspec], bwd.out_specs)
    one = lambda call: LocalCtx(call, strategies(call, (1,))[0], (1,), (0,))
    out, lse = attention_local(one(fwd), [q, k, v, m], 31)
    grads = attention_local(one(bwd), [g, q, k, v, out, lse, m], 31)
    keep = keep_mask(one(fwd), 0, 6, 31, 0.3, None).double()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    sc = (qr @ kr.transpose(-1, -2) / 2.0).masked_fill(~valid, float("-inf"))
    ref = (torch.softmax(sc, -1) * keep / 0.7) @ vr
    ref.backward(g)
    assert torch.allclose(out, ref, atol=1e-12)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert torch.allclose(got, want, atol=1e-12)
    for call, ins, want in ((fwd, [q, k, v, m], [out, lse]), (bwd, [g, q, k, v, out, lse, m], grads)):
        for st in strategies(call, (2, 2)):
            _check_attention_blocks(call, st, ins, want, 31, call.op)


@pytest.mark.parametrize("hk", [4, 2], ids=["mha", "gqa"])
def test_attention_with_dropout_draws_the_whole_mask_under_every_strategy(hk):
    """Every strategy of the fused forward and backward on (2, 2) (batch, heads, query positions,
    partial gradients) reassembles to the 1-device result: each block draws its part of the mask."""
    from autopar.ir.rules.random_attention import attention_local

    fwd, bwd, qkv, g = _attention_calls(hk=hk)
    one = lambda call: LocalCtx(call, strategies(call, (1,))[0], (1,), (0,))
    out, lse = attention_local(one(fwd), qkv, 123)
    whole = {"fwd": (qkv, [out, lse]), "bwd": ([g, *qkv, out, lse], attention_local(one(bwd), [g, *qkv, out, lse], 123))}
    mesh = (2, 2)
    for name, call in (("fwd", fwd), ("bwd", bwd)):
        ins, want = whole[name]
        strats = strategies(call, mesh)
        assert any(any(str(s.inputs[0]) == "S(2)" for s in st) for st in strats)  # query positions split
        for st in strats:
            _check_attention_blocks(call, st, ins, want, 123, name)


def test_attention_with_dropout_stays_one_fused_op_in_capture():
    model, args = build_gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "decomposed attention" warning either
        g = capture(model, args)
    from autopar.ir.rules.random_attention import ATTN_BWD, ATTN_FWD, attention_dropout

    fused = [n for n in g.ops() if n.op in (ATTN_FWD, ATTN_BWD)]
    assert len(fused) == 4 and all(attention_dropout(n.op, n.args, n.kwargs) == P for n in fused)
    assert not any(n.op in ("aten._safe_softmax.default", "aten._softmax.default") for n in g.ops())


def test_a_plain_state_dict_entry_sets_seed_and_step():
    """``model.load_state_dict`` of whole tensors (the user guide's single-device round trip) takes
    the random entry as a plain tensor too; a program without random ops ignores it."""
    from autopar.program.program import Program, RandomState
    from autopar.runtime.random_state import load_random_entry

    prog = Program((0,), (1,), ("a",), None, [], [], 0, random=RandomState(1, 2))
    load_random_entry(prog, torch.tensor([(1 << 62) + 5, 7]))
    assert (prog.random.seed, prog.random.step) == ((1 << 62) + 5, 7)
    plain = Program((0,), (1,), ("a",), None, [], [], 0)
    load_random_entry(plain, torch.tensor([3, 4]))
    assert plain.random is None
