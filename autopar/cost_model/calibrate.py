"""Measure this machine and write a hardware profile (the "cpu" preset with measured figures).

Measured: the float32 (and float64) matmul rate, memory bandwidth (a large copy), the per-op
launch floor, gloo ``all_reduce`` latency and bandwidth between ``nprocs`` local processes, and the
shape tables of ``autopar.cost_model.efficiency``: matmuls with few output elements and with a
short reduction, copies of a few sizes, and attention (SDPA forward and backward) at two sequence
lengths. The large-op rates are stored as peaks; the efficiency curves are fitted to the measured
ratios of small to large (``fit_half``), so the roofline reproduces the measurements. Planning never
measures: ``Mesh(..., device="cpu", profile=path)`` loads the file this writes.

    python -c "from autopar.cost_model.calibrate import calibrate; calibrate('cpu.json')"
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from typing import Callable

import torch

from autopar.cost_model import efficiency as eff
from autopar.cost_model.efficiency import Efficiency
from autopar.cost_model.hardware import PRESETS, Hardware, Link, save_profile


def _best_time(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def time_matmul(m: int, n: int, k: int, dtype: torch.dtype = torch.float32, reps: int = 5) -> float:
    """Seconds of one (m x k) @ (k x n) matmul (best of ``reps``)."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    out = torch.empty(m, n, dtype=dtype)
    inner = max(1, min(64, int(2e7 // max(1, m * n * k))))  # repeat tiny ones so the clock resolves them

    def run() -> None:
        for _ in range(inner):
            torch.mm(a, b, out=out)

    return _best_time(run, reps) / inner


def measure_matmul(n: int = 1024, dtype: torch.dtype = torch.float32, reps: int = 5) -> float:
    """FLOP/s of an ``n``-cubed matmul (best of ``reps``)."""
    return 2.0 * n**3 / time_matmul(n, n, n, dtype, reps)


def time_copy(nbytes: int, reps: int = 5) -> float:
    """Seconds of one copy of ``nbytes`` (float32) into a preallocated tensor."""
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    y = torch.empty_like(x)
    inner = max(1, min(64, int((8 << 20) // max(1, nbytes))))

    def run() -> None:
        for _ in range(inner):
            y.copy_(x)

    return _best_time(run, reps) / inner


def measure_memory_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Bytes/s of a large copy (read + write counted)."""
    return 2.0 * (nbytes // 4) * 4 / time_copy(nbytes, reps)


def time_attention(seq: int, head_dim: int = 64, heads: int = 4, reps: int = 3) -> tuple[float, float]:
    """Seconds of SDPA's forward and of its backward (float32, batch 1, not causal)."""
    q, k, v = (torch.randn(1, heads, seq, head_dim, requires_grad=True) for _ in range(3))
    f = torch.nn.functional.scaled_dot_product_attention
    t_fwd = _best_time(lambda: f(q, k, v), reps)

    def both() -> None:
        f(q, k, v).sum().backward()

    t_both = _best_time(both, reps)
    return t_fwd, max(t_both - t_fwd, 1e-9)


def fit_half(x_small: float, ratio: float) -> float:
    """The half-constant h of ``x / (x + h)`` that makes a size ``x_small`` run at ``ratio`` of
    the large size's rate (the large one taken as saturated); 0 (flat) when it is not slower."""
    if not 0 < ratio < 1:
        return 0.0
    return x_small * (1.0 / ratio - 1.0)


def _attention_flops(seq: int, head_dim: int, heads: int) -> float:
    return 4.0 * heads * seq * seq * head_dim


def fit_efficiency(base: Efficiency, quick: bool, launch: float, reps: int) -> tuple[Efficiency, float, float]:
    """Measure the shape tables on this machine: returns the fitted ``Efficiency`` with the float32
    matmul peak (FLOP/s) and memory bandwidth (bytes/s) it is relative to."""
    big = 384 if quick else 1024
    t_big = time_matmul(big, big, big, reps=reps)
    peak = 2.0 * big**3 / t_big

    def rate(m: int, n: int, k: int) -> float:
        return 2.0 * m * n * k / max(time_matmul(m, n, k, reps=reps) - launch, 1e-9)

    small_mn = 16 if quick else 32
    h_mn = fit_half(small_mn * small_mn, rate(small_mn, small_mn, big) / peak)
    small_k = 8 if quick else 16
    h_k = fit_half(small_k, rate(big, big, small_k) / peak)
    # mm_max: so the fitted curve passes through the large measurement (peak is its rate)
    mm_max = 1.0 / (eff._sat(big * big, h_mn) * eff._sat(big, h_k))

    nb_big = (32 << 20) if quick else (256 << 20)
    bw = 2.0 * nb_big / time_copy(nb_big, reps)
    nb_small = 64 << 10
    bw_small = 2.0 * nb_small / max(time_copy(nb_small, reps) - launch, 1e-9)
    h_mem = fit_half(2 * nb_small, bw_small / bw)
    mem_max = 1.0 / eff._sat(2 * nb_big, h_mem)

    d, heads = 64, 4
    s1, s2 = (64, 256) if quick else (128, 512)
    e = {}
    for s in (s1, s2):
        tf, tb = time_attention(s, d, heads, reps)
        fl = _attention_flops(s, d, heads)
        e[s] = (fl / (peak * max(tf - launch, 1e-9)), 2.5 * fl / (peak * max(tb - launch, 1e-9)))

    def two_point(e1: float, e2: float) -> tuple[float, float]:
        r = e1 / e2
        den = r * s2 - s1
        h = s1 * s2 * (1 - r) / den if den > 0 and r < 1 else 0.0
        return min(2.0, e2 * (s2 + h) / s2), h

    fwd, h_seq = two_point(e[s1][0], e[s2][0])
    bwd, _ = two_point(e[s1][1], e[s2][1])
    fitted = Efficiency(mm_max=min(mm_max, 2.0), mm_half_mn=h_mn, mm_half_k=h_k, attn_fwd=fwd, attn_bwd=min(bwd, 2.0),
                        attn_half_seq=h_seq, attn_half_head_dim=base.attn_half_head_dim, mem_max=min(mem_max, 2.0),
                        mem_half_bytes=h_mem)
    fitted.validate()
    return fitted, peak, bw


def measure_launch_floor(reps: int = 2000) -> float:
    """Seconds per tiny op (what a kernel launch costs here)."""
    x = torch.ones(1)

    def run() -> None:
        for _ in range(reps):
            torch.add(x, x)

    return _best_time(run, 3) / reps


def _gloo_worker(rank: int, world: int, port: int, out_path: str, big_bytes: int, reps: int) -> None:
    """One process of the link measurement; rank 0 writes ``{"t_small", "t_big"}`` (seconds).
    Joins the store the parent hosts on ``port`` as a client."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:

        def timed(t: torch.Tensor, k: int) -> float:
            for _ in range(2):
                dist.all_reduce(t)
            times = []
            for _ in range(k):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        t_small = timed(torch.ones(1), reps * 10)
        t_big = timed(torch.ones(big_bytes // 4), reps)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"t_small": t_small, "t_big": t_big, "big_bytes": big_bytes}, f)
    finally:
        dist.destroy_process_group()


def measure_link(nprocs: int = 2, big_bytes: int = 64 << 20, reps: int = 5) -> Link:
    """gloo link between ``nprocs`` local processes, from all_reduce times via the ring formula:
    latency a = t_tiny / (2(n-1)); bandwidth b = 2(n-1)/n * B / (t_big - 2(n-1) a)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    # the parent hosts the store on a port the OS picks (port 0): two measurements, or a
    # measurement beside a test run, cannot race for a port
    store = dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "link.json")
        mp.spawn(_gloo_worker, args=(nprocs, store.port, out, big_bytes, reps), nprocs=nprocs, join=True)
        with open(out) as f:
            r = json.load(f)
    del store
    n = nprocs
    alpha = max(r["t_small"] / (2 * (n - 1)), 1e-9)
    transfer = r["t_big"] - 2 * (n - 1) * alpha
    if transfer <= 0:
        transfer = r["t_big"]
    beta = 2 * (n - 1) / n * r["big_bytes"] / transfer
    return Link(latency=alpha, bandwidth=beta)


def calibrate(path: str | os.PathLike, nprocs: int = 2, quick: bool = False) -> Hardware:
    """Measure this machine, write the profile to ``path`` (``save_profile``) and return it.

    ``quick`` uses small sizes and few repetitions (a few seconds, mostly process start-up);
    ``nprocs`` < 2 keeps the preset's link figures.
    """
    base = PRESETS["cpu"]
    reps = 2 if quick else 5
    launch = measure_launch_floor(200 if quick else 2000)
    efficiency, fp32, mem = fit_efficiency(base.efficiency, quick, launch, reps)
    fp64 = measure_matmul(256 if quick else 1024, torch.float64, reps)
    ratio = fp32 / base.peak_flops["float32"]  # no fast 16-bit path measured: keep the preset's ratios
    flops = {k: v * ratio for k, v in base.peak_flops.items()}
    flops.update({"float32": fp32, "float64": fp64})
    link = base.intra_node
    if nprocs >= 2:
        link = measure_link(nprocs, (4 << 20) if quick else (64 << 20), 3 if quick else 10)
    hw = dataclasses.replace(
        base,
        name="cpu-calibrated",
        peak_flops=flops,
        hbm_bandwidth=mem,
        intra_node=link,
        inter_node=link,
        efficiency=efficiency,
        launch_floor=launch,
    )
    hw.validate()
    save_profile(hw, path, base="cpu")
    return hw


__all__ = ["calibrate", "fit_efficiency", "fit_half", "measure_link", "measure_launch_floor", "measure_matmul", "measure_memory_bandwidth"]
