"""The published-runs check (``benchmarks/published.py``): how it prices the runs' own runtime, torch's
FSDP1, beside autopar's price. Cheap: no model is captured or planned here."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import pytest
import torch

import autopar
from autopar.cost_model.efficiency import Efficiency
from autopar.cost_model.hardware import PRESETS

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "published.py"
_spec = importlib.util.spec_from_file_location("_published", _PATH)
published = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(published)


def test_split_views_of_a_flat_parameter_concatenate_their_gradients():
    """The fact FSDP1's "concat" kernel rests on: gradients of views made by ``torch.split`` of one
    flat parameter (how FSDP1 hands a module its parameters) reach it through one ``aten::cat``."""
    flat = torch.nn.Parameter(torch.randn(6 + 12))
    with torch.enable_grad():
        a, b = torch.split(flat, [6, 12], dim=0)
        w1, w2 = a.view(2, 3), b.view(3, 4)
    loss = (torch.randn(5, 2) @ w1 @ w2).sum()
    with torch.profiler.profile() as prof:
        loss.backward()
    cats = [e for e in prof.events() if e.name == "aten::cat"]
    assert cats and any(e.cpu_parent is not None and "SplitWithSizesBackward" in e.cpu_parent.name for e in cats)
    assert flat.grad is not None and flat.grad.shape == (18,)


@pytest.mark.parametrize("reduce, per_param", [("fp32", 2 + 2 + 2 + 4 + 4 + 4), ("bf16", 2 + 2 + 2 + 2)])
def test_fsdp1_gradient_work_moves_its_bytes_per_parameter_at_the_memory_rate(reduce, per_param):
    """Concatenation (bf16 read + write), the cast to fp32 when reducing in fp32 (read 2, write 4)
    and the pre-division in the reduce dtype: 18 bytes per parameter in fp32, 8 in bf16, at the
    preset's memory bandwidth (a flat memory curve here, so the figure is exact)."""
    hw = dataclasses.replace(PRESETS["h100"], efficiency=Efficiency.flat(0.8, 0.5))
    params, layers = 12_000_000_000, 40
    got = published.fsdp1_grad_seconds(params, layers, reduce, hw)
    assert got == pytest.approx(per_param * params / (0.5 * hw.hbm_bandwidth), rel=1e-12)


def test_fsdp1_edges_are_the_first_gathers_and_last_reductions_less_what_autopar_already_charged():
    """8 H100 on NVLink (360 GB/s of NCCL bus bandwidth, 4 us a step): the root's and one layer's bf16 gathers
    and fp32 reductions at the ring price, times 1 - s (autopar charged s of them as slowed
    compute when it hid them)."""
    mesh = autopar.Mesh({"dp": 8}, device="h100")
    root, layer = 250_000_000, 300_000_000
    ring = lambda nbytes: 8 * 4e-6 + 7 / 8 * nbytes / 360e9  # noqa: E731
    want = ring(2 * root) + ring(2 * layer) + ring(4 * layer) + ring(4 * root)
    s = PRESETS["h100"].overlap_slowdown
    assert 0 < s < 1
    assert published.fsdp1_edge_seconds(root, layer, "fp32", mesh) == pytest.approx((1 - s) * want, rel=1e-9)
    # reductions in bf16 (the PURE row) move half the reduction bytes
    want_bf16 = ring(2 * root) + ring(2 * layer) + ring(2 * layer) + ring(2 * root)
    assert published.fsdp1_edge_seconds(root, layer, "bf16", mesh) == pytest.approx((1 - s) * want_bf16, rel=1e-9)


def test_runs_optimizer_is_composers_unfused_adamw_after_norm_clipping():
    """Composer's DecoupledAdamW (the runs' optimizer) moves 80 bytes per fp32 element in eight
    unfused kernels, against the 28 of the foreach AdamW autopar prices for its own runtime, after
    FSDP's clip_grad_norm_ reads every gradient and scales it (12 more)."""
    hw = dataclasses.replace(PRESETS["a100"], efficiency=Efficiency.flat(0.8, 0.5))
    params, layers, gpus = 7_000_000_000, 32, 8
    assert sum(published.RUNS_ADAMW_BYTES) == 80 and len(published.RUNS_ADAMW_BYTES) == 8
    assert sum(published.RUNS_CLIP_BYTES) == 12
    got = published.runs_optimizer_seconds(params, layers, gpus, hw)
    assert got == pytest.approx(92 * params / gpus / (0.5 * hw.hbm_bandwidth), rel=1e-12)


def test_fsdp1_accumulates_the_reduced_shard_on_every_micro_batch_but_the_first():
    """21 micro-batches a step (the 30B rows): 20 fp32 additions over the shard, 12 bytes per
    element each, averaged per micro-batch; one micro-batch a step: none. A shard reduced in bf16
    is also cast to fp32 every micro-batch (6 bytes per element)."""
    hw = dataclasses.replace(PRESETS["h100"], efficiency=Efficiency.flat(0.8, 0.5))
    params, layers, gpus = 30_000_000_000, 48, 8
    unit = params / gpus / (0.5 * hw.hbm_bandwidth)
    assert published.fsdp1_shard_seconds(params, layers, gpus, "fp32", 1, hw) == 0.0
    got = published.fsdp1_shard_seconds(params, layers, gpus, "fp32", 21, hw)
    assert got == pytest.approx(12 * 20 / 21 * unit, rel=1e-12)
    got = published.fsdp1_shard_seconds(params, layers, gpus, "bf16", 4, hw)
    assert got == pytest.approx((12 * 3 / 4 + 6) * unit, rel=1e-12)
