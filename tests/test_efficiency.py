"""Efficiency as a function of shape, the optimizer step's price and the model FLOPs utilization."""

from __future__ import annotations

import math

import pytest
import torch

import autopar
from autopar.cost_model import efficiency as eff
from autopar.cost_model.calibrate import fit_half
from autopar.cost_model.compute import compute_time, model_flops, optimizer_time, tokens_per_step
from autopar.cost_model.efficiency import Efficiency
from autopar.cost_model.hardware import PRESETS, Hardware
from autopar.cost_model.memory import param_state_bytes
from autopar.cost_model.precision import get_precision
from autopar.ir.graph import Ref, TensorSpec
from autopar.ir.placement import B, S
from autopar.ir.rules.base import OpCall

H100, A100 = PRESETS["h100"], PRESETS["a100"]
BF16 = get_precision("bf16-mixed", H100)
ATTN = "autopar.attention.default"


def _call(op, in_shapes, out_shapes, args=None):
    refs = tuple(Ref(f"x{i}") for i in range(len(in_shapes)))
    return OpCall(op=op, target=None, args=args if args is not None else refs, kwargs={},
                  in_specs=[TensorSpec(tuple(s), torch.float32) for s in in_shapes],
                  out_specs=[TensorSpec(tuple(s), torch.float32) for s in out_shapes])


def _mm_rate(hw, m, n, k):
    """Achieved FLOP/s of an (m x k) @ (k x n) matmul, launch floor excluded."""
    t = compute_time(_call("aten.mm.default", [(m, k), (k, n)], [(m, n)]), [(m, k), (k, n)], [(m, n)], hw, BF16)
    return 2 * m * n * k / (t - hw.launch_floor)


def test_matmul_efficiency_saturates_with_parallel_work_and_reduction_length():
    big = _mm_rate(H100, 8192, 8192, 8192)
    assert big / 989e12 < H100.efficiency.mm_max  # never above the best measured shape
    assert big / 989e12 > 0.9 * H100.efficiency.mm_max  # and close to it for a large square one
    # few output tiles (a quarter of a wave and less) leave SMs idle; a short K pays per-tile overhead
    few_tiles = _mm_rate(H100, 256, 1024, 8192)
    short_k = _mm_rate(H100, 8192, 8192, 128)
    assert few_tiles < 0.5 * big and short_k < 0.6 * big
    # monotone in each dimension
    rates = [_mm_rate(H100, m, 4096, 4096) for m in (128, 512, 2048, 8192)]
    assert rates == sorted(rates)


def test_attention_efficiency_by_sequence_head_dim_and_causality():
    e = H100.efficiency
    fwd = [eff.attention(e, "fwd", s, 128, False) for s in (256, 1024, 4096, 16384)]
    assert fwd == sorted(fwd) and fwd[-1] < e.attn_fwd
    # a causal row of s keys fills tiles like a full row of s/2
    assert eff.attention(e, "fwd", 2048, 128, True) == pytest.approx(eff.attention(e, "fwd", 1024, 128, False))
    # the backward runs below the forward (FlashAttention-2's figures), head dim 64 below 128,
    # and a head dim the kernel pads (112 -> 128) pays the padding
    assert eff.attention(e, "bwd", 4096, 128, False) < eff.attention(e, "fwd", 4096, 128, False)
    assert eff.head_factor(e, 128) == 1.0 and eff.head_factor(e, 64) < 1.0
    assert eff.head_factor(e, 112) == pytest.approx(112 / 128)
    # the A100's flash attention reaches a larger share of its (smaller) peak than the H100's
    assert eff.attention(A100.efficiency, "fwd", 2048, 128, True) > eff.attention(e, "fwd", 2048, 128, True)
    # compute_time takes the causal flag from the call: causal does half the work, at a lower rate
    q = (4, 16, 2048, 128)
    full = _call(ATTN, [q] * 3, [q, q[:3]], args=(Ref("q"), Ref("k"), Ref("v"), 0.0, False))
    causal = _call(ATTN, [q] * 3, [q, q[:3]], args=(Ref("q"), Ref("k"), Ref("v"), 0.0, True))
    t_full = compute_time(full, [q] * 3, [q, q[:3]], H100, BF16)
    t_causal = compute_time(causal, [q] * 3, [q, q[:3]], H100, BF16)
    assert 0.5 * t_full < t_causal < t_full


def test_memory_bound_ops_reach_their_bandwidth_only_when_large():
    e = H100.efficiency
    assert eff.memory(e, 1 << 30) == pytest.approx(e.mem_max, rel=1e-3)
    assert eff.memory(e, e.mem_half_bytes) == pytest.approx(e.mem_max / 2)


def test_a_flat_efficiency_prices_as_the_old_constants():
    flat = Hardware.from_dict({**H100.to_dict(), "efficiency": Efficiency.flat(0.7, 0.8).to_dict()})
    for m, n, k in ((64, 64, 64), (8192, 8192, 8192)):
        t = compute_time(_call("aten.mm.default", [(m, k), (k, n)], [(m, n)]), [(m, k), (k, n)], [(m, n)], flat, BF16)
        assert t == pytest.approx(max(2 * m * n * k / (989e12 * 0.7), 2 * (m * k + k * n + m * n) / (3.35e12 * 0.8))
                                  + flat.launch_floor)
    # a hardware description with the two constants (plans of schema version 4) reads as flat
    old = {k: v for k, v in H100.to_dict().items() if k != "efficiency"}
    assert Hardware.from_dict({**old, "matmul_efficiency": 0.7, "memory_efficiency": 0.8}).efficiency == \
        Efficiency.flat(0.7, 0.8)
    with pytest.raises(ValueError, match="mm_max"):
        Efficiency.from_dict({**Efficiency.flat(0.7, 0.8).to_dict(), "mm_max": -1.0})


def test_optimizer_step_reads_and_writes_every_state_once():
    mesh = autopar.Mesh({"dp": 8}, device="h100")
    shape = (4096, 4096)
    whole = param_state_bytes(shape, (B,), mesh, BF16)
    sharded = param_state_bytes(shape, (S(0),), mesh, BF16)
    n = 4096 * 4096
    # AdamW, bf16-mixed: read 4 + 4 + 8, write 4 + 8 = 28 bytes per element of the stored block
    t = optimizer_time(whole, H100)
    assert t == pytest.approx(28 * n / (3.35e12 * eff.memory(H100.efficiency, 28 * n)))
    assert optimizer_time(sharded, H100) == pytest.approx(t / 8, rel=0.05)  # FSDP steps its shard only
    sgd = get_precision("bf16-mixed", H100, optimizer="sgd")
    assert optimizer_time(param_state_bytes(shape, (B,), mesh, sgd), H100) < t
    assert optimizer_time({"params": 4 * n, "grads": 0, "optimizer": 0}, H100) == 0.0  # inference


def test_mfu_counts_model_flops_once_whatever_the_plan():
    """GPT: model FLOPs = 6 N tokens + 12 L h s tokens (N the matmul weights), the same for every
    plan; MFU and tokens/s follow from the plan's step time."""
    layers, width, seq, batch, vocab = 2, 64, 32, 8, 128
    from autopar.models import make

    model, inputs = make("gpt", size="tiny", batch=batch, seq=seq)
    from autopar.ir.capture import capture

    graph = capture(model, tuple(inputs))
    tokens = batch * seq
    matmul_weights = layers * 12 * width * width + width * vocab  # qkv, proj, fc, fc-proj; the head
    assert model_flops(graph) == pytest.approx(6 * matmul_weights * tokens + 12 * layers * width * seq * tokens)
    assert tokens_per_step(graph) == tokens
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")
    plans = [autopar.plan(model, mesh, inputs, recipe=r, progress=False) for r in ("ddp", "megatron_tp")]
    for plan in plans:
        assert plan.model_flops == pytest.approx(model_flops(graph))
        assert plan.mfu == pytest.approx(plan.model_flops / (plan.step_time * 4 * 989e12))
        assert plan.tokens_per_second_per_device == pytest.approx(tokens / (plan.step_time * 4))
        assert "MFU" in plan.summary() and "tokens/s per device" in plan.summary()
    # the faster plan has the higher MFU
    fast, slow = sorted(plans, key=lambda p: p.step_time)
    assert fast.mfu >= slow.mfu


def test_fit_half_recovers_the_curve_it_is_measured_on():
    h = 300.0
    for x in (16.0, 64.0, 1000.0):
        assert fit_half(x, x / (x + h)) == pytest.approx(h)
    assert fit_half(10.0, 1.0) == 0.0 and fit_half(10.0, 1.3) == 0.0  # not slower: flat
    assert math.isclose(eff.matmul(Efficiency.flat(0.5, 0.5), 1.0, 1.0), 0.5)
