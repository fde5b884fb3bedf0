"""Measure this machine and write a hardware profile (the "cpu" preset with measured figures).

Measured: the float32 (and float64) matmul rate, memory bandwidth (a large copy), the per-op
launch floor, and gloo ``all_reduce`` latency and bandwidth between ``nprocs`` local processes.
The measured rates are what large ops achieve, so the profile stores them as peaks with
efficiencies of 1.0 (the roofline then reproduces the measurements). Planning never measures:
``Mesh(..., device="cpu", profile=path)`` loads the file this writes.

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

from autopar.cost_model.hardware import PRESETS, Hardware, Link, save_profile


def _best_time(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul(n: int = 1024, dtype: torch.dtype = torch.float32, reps: int = 5) -> float:
    """FLOP/s of an ``n``-cubed matmul (best of ``reps``)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2.0 * n**3 / _best_time(lambda: torch.mm(a, b, out=out), reps)


def measure_memory_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Bytes/s of a large copy (read + write counted)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    return 2.0 * x.numel() * 4 / _best_time(lambda: y.copy_(x), reps)


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
    fp32 = measure_matmul(512 if quick else 1024, torch.float32, reps)
    fp64 = measure_matmul(256 if quick else 1024, torch.float64, reps)
    mem = measure_memory_bandwidth((32 << 20) if quick else (256 << 20), reps)
    launch = measure_launch_floor(200 if quick else 2000)
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
        matmul_efficiency=1.0,
        memory_efficiency=1.0,
        launch_floor=launch,
    )
    hw.validate()
    save_profile(hw, path, base="cpu")
    return hw


__all__ = ["calibrate", "measure_link", "measure_launch_floor", "measure_matmul", "measure_memory_bandwidth"]
