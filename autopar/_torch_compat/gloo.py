"""gloo process groups with one worker thread, and whether a group is still alive (torch 2.13).

Why: ``ProcessGroupGloo::runLoop`` runs a group's collectives on its worker threads (two by
default), and each worker, after finishing one, writes the group's status record
(``pgStatus_->lastCompletedWorkName = opTypeToString(opType)``) without holding the group's lock.
Two collectives of one group finishing together race on that ``std::string``; names longer than 15
characters live on the heap (the functional all-gather's "ALLGATHER_COALESCED"), so the race
double-frees it: glibc aborts ("double free or corruption (fasttop)", "unaligned tcache/fastbin
chunk") or a later collective crashes. ``benchmarks/gloo_race_repro.py`` reproduces it without
autopar. With one worker a group's collectives run one after another on one thread.

On a torch upgrade: check whether ``runLoop`` updates the status under the lock (then this whole
module can go); that ``ProcessGroupGloo._Options`` keeps ``_timeout``, ``_devices``, ``_threads``;
that ``new_group`` still builds gloo backends through ``distributed_c10d.ProcessGroupGloo``; and
``distributed_c10d._world.pg_map``.
"""

from __future__ import annotations

import os
from typing import Any, Sequence


def _devices() -> list:
    """gloo's transport devices, picked as torch's own constructor picks them."""
    from torch.distributed import ProcessGroupGloo

    names = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if len(names) > 1:
        return [ProcessGroupGloo.create_device(interface=n) for n in names.split(",")]
    return [ProcessGroupGloo.create_default_device()]


def new_one_worker_gloo_groups(rank_lists: Sequence[Sequence[int]], timeout: Any) -> list:
    """``dist.new_group(ranks, backend="gloo", timeout=timeout)`` for each of ``rank_lists``, in
    order, with backends that run one worker thread. Collective over the world, like ``new_group``."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import ProcessGroupGloo

    class OneWorkerGloo(ProcessGroupGloo):
        def __init__(self, store, group_rank, group_size, timeout):
            opts = ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = _devices()
            opts._threads = 1
            super().__init__(store, group_rank, group_size, opts)

    saved = c10d.ProcessGroupGloo
    c10d.ProcessGroupGloo = OneWorkerGloo  # the class new_group builds gloo backends with
    try:
        return [dist.new_group(list(ranks), backend="gloo", timeout=timeout) for ranks in rank_lists]
    finally:
        c10d.ProcessGroupGloo = saved


def group_alive(group: Any) -> bool:
    """Whether ``group`` is still registered (not destroyed since it was made)."""
    import torch.distributed.distributed_c10d as c10d

    return group in c10d._world.pg_map


__all__ = ["group_alive", "new_one_worker_gloo_groups"]
