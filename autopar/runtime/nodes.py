"""Processes on nodes: the process group torchrun describes, and where the mesh's ranks really run.

Under ``torchrun`` (one node or many, c10d rendezvous) every rank finds ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (its node's index) and the rendezvous address in
its environment. ``start_from_environment`` starts the default group from them when the script has
not: NCCL where every local rank has a GPU of its own (after ``torch.cuda.set_device(LOCAL_RANK)``,
so the first collective already runs on the rank's GPU), gloo otherwise.

The plan prices each mesh axis by where its groups run (``cost_model.mesh``: the inner axes within a
node of ``devices_per_node`` ranks). torchrun numbers ranks node by node, so a device mesh laid out
row-major over them keeps the inner axes inside a node exactly when every node runs
``devices_per_node`` ranks. ``node_mismatch`` says when a job's nodes disagree with that.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Optional, Sequence

import torch.distributed as dist

from autopar.runtime.launch import bind_device, default_backend

#: What torchrun (and any launcher that sets up ``env://`` rendezvous) puts in each rank's environment.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_launcher() -> bool:
    """Whether this process is one rank of a job a launcher started (``env://`` variables set)."""
    return all(v in os.environ for v in TORCHRUN_VARIABLES)


def start_from_environment(timeout: Optional[float] = None) -> bool:
    """Start the default process group from the launcher's environment unless one exists; True when
    this call started it. With NCCL the rank's GPU is made current first."""
    if dist.is_initialized() or not under_launcher():
        return False
    backend = default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    device = bind_device(backend)
    kw: dict = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    if device is not None:
        kw["device_id"] = device
    dist.init_process_group(backend, **kw)
    return True


def node_key() -> str:
    """This rank's node: torchrun's ``GROUP_RANK`` with the host name (two agents on one host are
    two nodes to the job)."""
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '0')}"


def node_mismatch(nodes: Sequence[str], devices_per_node: int, axes: dict) -> Optional[str]:
    """Why the ranks' nodes (``nodes[r]``: rank ``r``'s ``node_key``) disagree with a mesh priced at
    ``devices_per_node`` ranks per node, or None when they agree (or the job runs on one node, which
    holds every group whatever the plan assumed about larger jobs)."""
    order: list[str] = []
    for n in nodes:
        if not order or order[-1] != n:
            order.append(n)
    if len(set(nodes)) == 1:
        return None
    if len(order) != len(set(nodes)):
        return "ranks of one node are not numbered together (start one launcher agent per node)"
    sizes = sorted({nodes.count(n) for n in order})
    per_node = min(devices_per_node, len(nodes))
    if sizes != [per_node]:
        shape = " x ".join(f"{k}={v}" for k, v in axes.items())
        got = "/".join(map(str, sizes))
        return (f"the job runs {got} ranks per node on {len(order)} nodes, but the plan for mesh {shape} prices "
                f"{per_node} devices per node, so the axes it priced as inside a node cross nodes (or the "
                f"reverse): start {per_node} processes per node (torchrun --nproc-per-node {per_node}), or plan "
                f"with autopar.Mesh(..., devices_per_node={sizes[0]})")
    return None


def check_node_layout(devices_per_node: int, axes: dict) -> Optional[str]:
    """``node_mismatch`` for this job's ranks (an all-gather of every rank's ``node_key``): the same
    answer on every rank."""
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, node_key())
    return node_mismatch(got, devices_per_node, axes)


__all__ = ["TORCHRUN_VARIABLES", "check_node_layout", "node_key", "node_mismatch", "start_from_environment",
           "under_launcher"]
