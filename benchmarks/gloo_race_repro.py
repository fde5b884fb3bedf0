"""Reproduction of the gloo heap corruption without autopar: torch's functional collectives only.

torch 2.13's ``ProcessGroupGloo`` runs a group's collectives on two worker threads; after
finishing one, a worker writes the group's status string (``lastCompletedWorkName``) without
holding the group's lock. When two collectives of one group finish together, both assign it and
one heap buffer is freed twice (op names over 15 characters, such as the functional all-gather's
"ALLGATHER_COALESCED", are heap strings). glibc then aborts ("double free or corruption
(fasttop)", "malloc(): unaligned tcache chunk detected") or a worker segfaults while the main
thread sits in ``wait_tensor``, or a worker spins for ever in ``~UnboundBuffer`` on a control
block whose counts were overwritten (a hang: the other ranks' collectives then time out).

The loop below has the shape of an FSDP program whose parameter gathers are issued early: small
all-gathers left in flight while larger collectives are issued and waited one by one, on one
group of 4 gloo processes. ``--threads 1`` builds the groups with one gloo worker thread
(autopar's workaround, ``autopar.runtime.collectives.single_worker_gloo_groups``).

    OMP_NUM_THREADS=1 python benchmarks/gloo_race_repro.py [--secs 300] [--threads 2|1]

Prints rank 0's progress and the iterations completed, or the error of the process that died
(a hang surfaces as a gloo timeout after ``TIMEOUT_S``).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
TIMEOUT_S = 60


def _group(threads: int):
    """The group the loop runs on: the default one (two workers), or a new one with ``threads``."""
    if threads == 2:
        return dist.group.WORLD
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import ProcessGroupGloo

    class Workers(ProcessGroupGloo):
        def __init__(self, store, rank, size, timeout):
            opts = ProcessGroupGloo._Options()
            opts._timeout, opts._threads = timeout, threads
            opts._devices = [ProcessGroupGloo.create_default_device()]
            super().__init__(store, rank, size, opts)

    saved, c10d.ProcessGroupGloo = c10d.ProcessGroupGloo, Workers
    try:
        return dist.new_group(list(range(WORLD)), backend="gloo")
    finally:
        c10d.ProcessGroupGloo = saved


def run(rank: int, store_path: str, secs: float, threads: int) -> None:
    from torch.distributed import _functional_collectives as fc

    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    g = _group(threads)
    x = torch.randn(64, 64)
    t0, it = time.time(), 0
    while True:
        stop = torch.tensor([float(time.time() - t0 > secs)])
        dist.all_reduce(stop)
        if stop.item():
            break
        for _layer in range(4):
            early = [fc.all_gather_single(torch.randn(64), 0, g) for _ in range(6)]  # left in flight
            for _ in range(4):  # issued and waited at once, under the early ones
                fc.all_gather_single(torch.randn(256, 64), 0, g).wait()
                fc.all_to_all_single(torch.randn(4, 2, 64, 64), None, None, g).wait()
                fc.all_reduce(torch.randn(8, 64, 64), "sum", g).wait()
                x = torch.tanh(x @ x)
            for y in early:
                y.wait()
        it += 1
        if rank == 0 and it % 200 == 0:
            print(f"{time.time() - t0:.0f} s: {it} iterations", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"threads={threads}: {it} iterations in {time.time() - t0:.0f} s, no crash", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--secs", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=2, choices=(1, 2))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(os.path.join(tmp, "store"), args.secs, args.threads), nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
