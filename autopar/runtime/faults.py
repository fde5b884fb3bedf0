"""Faults in a running job: which step a rank is in (``note_step``/``current_step``: ``ParallelModule``
counts its forward calls) and, when a collective fails, which rank is to blame.

Why a roll call: a rank whose collective fails sees only that it failed (gloo says "Connection
closed by peer" or "Timed out waiting ... ms"), not which peer died, hung or raised. So each rank that
sees a failure writes its step on the job's TCPStore (the one ``MASTER_ADDR:MASTER_PORT`` names:
``launch``'s parent or torchrun's agent hosts it) and waits a bounded time for the others to do the
same; the ranks that never do are the culprits. ``launch``'s parent reads the same keys to say which
step the ranks were in. ``_rank`` (which imports nothing from autopar) reads ``current_step`` through
``sys.modules`` when this module is loaded.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Optional

import torch.distributed as dist

from autopar.errors import CollectiveError
from autopar.runtime import _rank

__all__ = ["current_step", "fault_key", "note_step", "report_collective_failure", "roll_call"]


#: The step this process is in (``ParallelModule`` counts its forward calls): failure reports carry it.
_STEP: list[Optional[int]] = [None]
#: Store keys of the roll call after a failed collective: ``<prefix><attempt>/rank<r>`` holds r's step.
_FAULT_PREFIX = "autopar/fault/"
#: The longest a rank waits in that roll call for the other ranks to report the failure too.
_ROLL_CALL_MAX_S = 10.0


def note_step(step: Optional[int]) -> None:
    """Record that this process has started step ``step`` (see ``current_step``); None: no step yet."""
    _STEP[0] = step


def current_step() -> Optional[int]:
    """The step this process is in (the number of ``ParallelModule`` forward calls so far), or None."""
    return _STEP[0]


def fault_key(rank: int) -> str:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{_FAULT_PREFIX}{attempt}/rank{rank}"


def roll_call(step: Optional[int], wait_s: float) -> Optional[list[int]]:
    """After a failed collective: report it on the job's store (``MASTER_ADDR:MASTER_PORT``, hosted by
    launch's parent or torchrun's agent), wait up to ``wait_s`` for every other rank to report too, and
    return the ranks that did not: they died, hung, or raised outside the collective. None when no
    store can be reached."""
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=wait_s + 5.0))
        store.set(fault_key(rank), str(-1 if step is None else step))
        missing = [r for r in range(world) if r != rank]
        until = time.monotonic() + wait_s
        while missing and time.monotonic() < until:
            missing = [r for r in missing if not store.check([fault_key(r)])]
            if missing:
                time.sleep(0.2)
        return missing
    except Exception:  # no store to ask (a group initialised another way): say nothing about the others
        return None


def report_collective_failure(exc: BaseException, what: str, timeout_s: Optional[float]) -> Optional[Exception]:
    """The ``CollectiveError`` to raise, from ``exc``, for a collective of ``what`` (e.g. "the forward")
    that failed on this rank; None when ``exc`` is not a failure of torch.distributed. It names this
    rank, the step, and (after a roll call of at most ``timeout_s`` and 10 s) the ranks that did not
    see the failure: the likely culprits. Its ``step`` and ``absent_ranks`` say the same for code."""
    if not _rank.is_distributed_error(exc):
        return None
    step = current_step()
    wait_s = min(_ROLL_CALL_MAX_S, timeout_s if timeout_s else _ROLL_CALL_MAX_S)
    absent = roll_call(step, wait_s)
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    at = f" of step {step}" if step is not None else ""
    if absent:
        blame = (f"rank(s) {', '.join(map(str, absent))} did not report it within {wait_s:g} s: they died, hung or raised "
                 "outside the collective (their own errors say which)")
    elif absent is None:
        blame = "which rank failed first is not known here (no store to ask)"
    else:
        blame = "every rank saw it fail"
    try:
        who = f"rank {dist.get_rank()} of {dist.get_world_size()}"
    except (RuntimeError, ValueError):  # the default group is gone: the failure itself still says what ran
        who = "this rank"
    err = CollectiveError(
        f"{who}: a collective{at} in {what} failed ({type(exc).__name__}: "
        f"{first}); {blame}; the collective timeout is autopar.launch(collective_timeout=...) or "
        "torch.distributed.init_process_group(timeout=...)")
    err.step, err.absent_ranks = step, absent
    return err
