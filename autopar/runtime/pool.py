"""Persistent ranks for fast tests: ``WorkerPool(n)`` spawns n processes once, joins them into a
default gloo group once, then runs any number of functions on all of them.

Why: a fresh ``launch`` pays process start-up, ``import torch`` and the group's rendezvous in
every rank, seconds per call on a small machine. A test module that shares one pool
pays that once. The workers keep nothing between runs except their process group (and whatever
modules they have imported); each ``run`` gets a fresh unpickled copy of fn and its arguments.

Failure rules are ``launch``'s (see ``autopar.runtime.launch``): a raising rank becomes a
``LaunchError`` with its traceback, a dead rank fails the run within about a second, and every run has
a timeout. A run that leaves the group in an unknown state (a rank died, did not report, or failed
inside torch.distributed) stops all workers and marks the pool broken; a run in which every rank
reported, some with ordinary exceptions, leaves the pool usable.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Optional

from autopar.runtime import _rank
from autopar.runtime.launch import LaunchError, _Group, _name, _pickle_task

__all__ = ["WorkerPool"]

#: After one rank fails, how long a run waits for the others before it gives up on the group.
_POOL_GRACE_S = 1.0


class WorkerPool:
    """``nprocs`` persistent local ranks in a default ``backend`` group (context manager).

    ``run(fn, *args, **kwargs)`` calls ``fn(*args, **kwargs)`` on every rank and returns the results
    in rank order; ``timeout`` (seconds) bounds each run and is the group's collective timeout;
    ``start_timeout`` bounds start-up. ``fn`` must be picklable (module-level); ``run`` cannot pass
    fn a keyword argument named ``timeout``.
    """

    def __init__(self, nprocs: int, *, timeout: float = 120.0, start_timeout: float = 120.0, backend: str = "gloo"):
        if nprocs < 1:
            raise ValueError(f"WorkerPool needs nprocs >= 1, got {nprocs}")
        self.nprocs = nprocs
        self.timeout = timeout
        self._broken: Optional[str] = None
        self._closed = False
        self._group = _Group.start("pool", nprocs, backend, timeout)
        self._finalizer = weakref.finalize(self, _shutdown, self._group)
        try:
            outcome = self._group.collect(time.monotonic() + start_timeout, _POOL_GRACE_S)
        except BaseException:
            self._stop_now()
            raise
        if outcome.failures or outcome.pending:
            self._stop_now()
            raise outcome.error(f"WorkerPool({nprocs}) start-up", start_timeout, "the workers were stopped")
        #: The workers' process ids in rank order (stable for the pool's life).
        self.pids: list[int] = [outcome.results[r] for r in range(nprocs)]

    @property
    def broken(self) -> bool:
        """True once a run has left the group unusable (its workers are then stopped)."""
        return self._broken is not None

    def run(self, fn: Callable[..., Any], /, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; per-rank results in rank order."""
        if self._closed:
            raise LaunchError("WorkerPool.run on a closed pool: create a new WorkerPool")
        if self._broken is not None:
            raise LaunchError(f"WorkerPool.run on a broken pool ({self._broken}): create a new WorkerPool")
        timeout = self.timeout if timeout is None else timeout
        payload = _pickle_task(fn, args, kwargs, "WorkerPool.run")
        what = f"WorkerPool.run({_name(fn)})"
        group = self._group
        for conn in group.conns:
            try:
                conn.send_bytes(payload)
            except OSError:
                break  # that worker is gone: collect() below reports it as dead
        try:
            outcome = group.collect(time.monotonic() + timeout, _POOL_GRACE_S)
        except BaseException:  # e.g. KeyboardInterrupt: the workers are somewhere inside fn
            self._broken = "a run was interrupted"
            self._stop_now()
            raise
        if not (outcome.failures or outcome.pending):
            return [outcome.results[r] for r in range(self.nprocs)]
        if outcome.pending or any(f.kind == "died" or f.distributed for f in outcome.failures):
            primary = outcome.primary()
            self._broken = primary.headline(self.nprocs) if primary else f"a run timed out after {timeout:g} s"
            self._stop_now()
            raise outcome.error(what, timeout, "all workers were stopped and the pool is broken: create a new WorkerPool")
        raise outcome.error(what, timeout, "every rank reported; the pool is still usable")

    def _stop_now(self) -> None:
        """Stop the workers without asking: their group is in an unknown state."""
        self._finalizer.detach()
        self._group.stop()

    def close(self) -> None:
        """Shut the workers down: each leaves its group and exits; stragglers are killed."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _shutdown(group: _Group) -> None:
    """Ask live workers to exit, give them a few seconds, then stop the rest (also run at exit)."""
    for proc, conn in zip(group.procs, group.conns):
        if proc.is_alive():
            try:
                conn.send_bytes(_rank.SHUTDOWN)
            except OSError:
                pass
    group.join(5.0)
