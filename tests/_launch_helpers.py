"""Functions that ranks run in tests/test_launch.py.

A module of its own so that spawned children can import it cheaply: it imports torch and nothing
of pytest or autopar (``report_and_mismatch`` imports autopar's launch module when it runs).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def report(tag: str) -> dict:
    """This rank's identity, its environment, and a real all_reduce over the group."""
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": t.item(), "tag": tag,
            "env": env, "pid": os.getpid()}


def report_and_mismatch(tag: str) -> dict:
    """``report`` plus, on rank 0 (the others skip importing autopar: seconds each), what
    ensure_process_group says for the right and a wrong world size."""
    out = report(tag)
    if dist.get_rank() != 0:
        return out
    from autopar.runtime.launch import LaunchError, ensure_process_group

    ensure_process_group(dist.get_world_size())  # the right size passes
    try:
        ensure_process_group(3, what="mesh {'tp': 3}")
    except LaunchError as exc:
        out["mismatch"] = str(exc)
    return out


def gather_ranks(scale: int) -> list:
    """A second, different function for the pool: all_gather of scaled ranks, plus the pid."""
    mine = torch.tensor([dist.get_rank() * scale])
    parts = [torch.zeros(1, dtype=mine.dtype) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [int(p.item()) for p in parts] + [os.getpid()]


def _note_pid(pid_dir: str) -> None:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))


def raise_on_rank1(pid_dir: str) -> None:
    """Rank 1 raises; rank 0 is stuck (not in a collective, so only the launcher can stop it)."""
    _note_pid(pid_dir)
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    time.sleep(120)


def exit_before_all_reduce(pid_dir: str) -> float:
    """Rank 1 dies without raising; the others wait in an all_reduce that it never joins."""
    _note_pid(pid_dir)
    if dist.get_rank() == 1:
        time.sleep(0.3)  # let the others enter the collective first
        os._exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def raise_quickly_on_rank1() -> int:
    """Every rank reports at once (no collective): the pool stays usable after the exception."""
    if dist.get_rank() == 1:
        raise KeyError("no such thing on rank 1")
    return dist.get_rank()


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def fault_case() -> tuple:
    """``(model, example_inputs, mesh)`` of the fault tests: a tiny MLP on a dp=2 x tp=2 CPU mesh."""
    import autopar
    from autopar.models import make

    torch.manual_seed(0)
    model, args = make("mlp", "tiny", batch=8)
    return model, args, autopar.Mesh({"dp": 2, "tp": 2}, device="cpu")


def train_with_fault(kind: str, pid_dir: str, plan_json: str, bad_rank: int = 1, bad_step: int = 3) -> float:
    """Train ``fault_case`` under the plan ``plan_json`` through autopar's ParallelModule; rank ``bad_rank``, in
    step ``bad_step`` between its forward and its backward, is killed (SIGKILL), hangs (never joins
    the backward's collectives) or raises, as ``kind`` says. Returns the last loss (when no fault fires)."""
    import signal

    import json

    import autopar

    _note_pid(pid_dir)
    model, args, mesh = fault_case()
    pm = autopar.compile(model, mesh, args, plan=autopar.Plan.from_dict(json.loads(plan_json)))
    opt = torch.optim.SGD(pm.parameters(), lr=0.01)
    loss = None
    for step in range(1, bad_step + 2):
        loss = pm(*args)
        if dist.get_rank() == bad_rank and step == bad_step:
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "hang":
                time.sleep(600)
            elif kind == "raise":
                raise ValueError(f"injected fault on rank {bad_rank}")
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss.item())
