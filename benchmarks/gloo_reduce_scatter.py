"""What torch's gloo backend runs for a reduce-scatter and an all-gather, and what they cost.

Two local gloo processes call ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` under
``torch.profiler`` and print the backend's own event names (``gloo:...``): on torch 2.13 the
reduce-scatter records ``gloo:all_reduce`` (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``
clones the input, all-reduces all of it and keeps its chunk). Then each kind is timed on the same
tensor (``--mib``, the group's view: the reduce-scatter's input, the all-gather's output), median
of ``--reps``, the slower rank's, next to the ring formulas' ratios: a ring reduce-scatter moves
half an all-reduce's bytes, gloo's moves all of them. This is why ``autopar.cost_model.hardware.Link``
has per-kind ``factors`` and ``autopar calibrate`` measures them.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/gloo_reduce_scatter.py [--mib 4] [--reps 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, port: int, mib: float, reps: int) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames the two calls
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        n = max(2, int(mib * (1 << 20)) // 4 // 2 * 2)
        full, half = torch.ones(n), torch.empty(n // 2)
        calls = {
            "all_reduce": lambda: dist.all_reduce(full),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(half, full),
            "all_gather": lambda: dist.all_gather_into_tensor(full, half),
        }
        with torch.profiler.profile() as prof:
            calls["reduce_scatter"]()
            calls["all_gather"]()
        names = sorted({e.name for e in prof.events() if e.name.startswith("gloo:")})
        times = {}
        for kind, fn in calls.items():
            fn()
            got = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                got.append(time.perf_counter() - t0)
            t = torch.tensor([statistics.median(got)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[kind] = t.item()
        if rank == 0:
            print(f"backend events of reduce_scatter_tensor + all_gather_into_tensor: {names}")
            print(f"{n * 4 / (1 << 20):.2f} MiB, 2 processes, median of {reps}, slower rank:")
            for kind, t in times.items():
                print(f"  {kind:15s} {t * 1e3:8.2f} ms  ({t / times['all_reduce']:.2f}x the all-reduce)")
            print("  ring formulas: reduce-scatter and all-gather 0.5x the all-reduce's bytes term")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=4.0, help="tensor size in MiB (the group's view)")
    ap.add_argument("--reps", type=int, default=9, help="timed calls per kind")
    args = ap.parse_args(argv)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    mp.spawn(_worker, args=(store.port, args.mib, args.reps), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
