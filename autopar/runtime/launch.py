"""Real process groups on one machine: ``launch`` runs a function on N local processes (or, under
torchrun, on this process), and ``ensure_process_group`` says clearly when there is no group.

Why its own launcher rather than ``torch.multiprocessing.spawn``: a rank that dies without raising
(``os._exit``, a segfault, the OOM killer) must fail the whole run within seconds, while the other
ranks sit blocked in a collective that will never complete. So the parent never just waits on a
queue: it waits on every child's result pipe *and* its process sentinel at once, and stops all
ranks on the first failure or when the run's deadline (if it has one) passes. What a child runs is
in ``_rank.py``, which imports nothing from autopar (see there why).

Rendezvous: the launching process hosts a ``TCPStore`` on a port the OS picks (port 0, so two
launches on one machine cannot race for a port); the children join it as clients and initialise the
default group from it. ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` are set in every child, so code that reads them works.

Results and arguments travel with plain ``pickle`` (tensors by value). torch's shared-memory
pickling is avoided on purpose: it needs the sending process alive while the receiver unpickles,
and a launched rank exits right after it returns.
"""

from __future__ import annotations

import datetime
import math
import multiprocessing as mp
import os
import pickle
import runpy
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from autopar.errors import LaunchError
from autopar.runtime import _rank
from autopar.runtime.faults import fault_key
from autopar.validate import check_launch_args

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "LaunchError", "ensure_process_group", "in_torchrun", "launch",
           "run_deadline"]

#: Each collective's timeout (s) when launch is given none: it bounds a stall, not a run's length.
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
#: After the first failure, how long the parent keeps listening for other ranks' reports before it
#: stops them: long enough to see a death that caused a peer's "connection closed" error.
_FAILURE_GRACE_S = 0.5
#: After a rank died, how long the parent waits for the others to say (on the store) which step they were in.
_STEP_WAIT_S = 3.0
#: How long a stopped child gets between SIGTERM and SIGKILL.
_TERMINATE_GRACE_S = 2.0
#: How long a rank that has reported may take to exit on its own before it is stopped.
_EXIT_GRACE_S = 30.0


# ----------------------------------------------------------------------------------------------
# Public API


def in_torchrun() -> bool:
    """True when this process is one rank of an externally started job (torchrun, or a rank that
    ``launch`` started): ``RANK`` and ``WORLD_SIZE`` are set and torch.distributed is available."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and dist.is_available()


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    /,
    *args: Any,
    timeout: Optional[float] = None,
    collective_timeout: Optional[float] = None,
    backend: Optional[str] = None,
    **kwargs: Any,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` ranks of a default torch.distributed group and
    return the ranks' return values in rank order.

    Two modes, so that one user script works both ways:

    * **Local spawn** (the usual case): starts ``nprocs`` fresh processes (multiprocessing *spawn*),
      joins them into a default process group of ``backend``, runs ``fn`` on each and
      destroys the group at the end. ``fn``, its arguments and its return values must be picklable:
      define ``fn`` at module level of an importable module (a script's functions work when the
      script guards its entry point with ``if __name__ == "__main__":``). Each child gets
      ``OMP_NUM_THREADS=1`` unless it is set, and the env variables ``RANK``, ``WORLD_SIZE``,
      ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
    * **Already a rank** (under ``torchrun``, i.e. ``RANK`` and ``WORLD_SIZE`` are set): spawns
      nothing. Initialises the default group from the environment if it is not initialised yet
      (and destroys it again afterwards), calls ``fn`` here and returns ``[result]``: this rank's
      result only. An exception from ``fn`` propagates unchanged. A ``nprocs`` different from
      ``WORLD_SIZE`` only warns; the job's world size wins.

    Failures (local spawn): if a rank raises, ``LaunchError`` names the rank and carries its
    exception type, message and traceback; if a rank dies without raising, ``LaunchError`` gives
    its exit code or signal within about a second; a rank that hangs (never enters a collective the
    others wait in) is named once the others' collectives time out. Either way the other ranks are
    stopped, and the message gives the step (``ParallelModule``'s count of forward calls) the ranks
    were in. ``collective_timeout`` (seconds, default ``DEFAULT_COLLECTIVE_TIMEOUT_S`` = 300) is every
    process group's collective timeout, including the mesh groups ``autopar.compile`` makes: a
    collective that a peer never joins fails after it, so a stalled run stops without a whole-run
    limit. ``timeout`` (seconds, default None: no limit) bounds the whole run: past it, every rank is
    stopped and ``LaunchError`` says it timed out. Start-up (the ranks meeting) is bounded by
    ``timeout`` when given, else by ``collective_timeout``. Under torchrun, ``collective_timeout`` is
    the timeout of the group launch initialises (a group you initialise has yours).

    ``backend`` (default): ``"nccl"`` when CUDA is available and every rank of this machine has a GPU
    of its own (``nprocs``, or under torchrun ``LOCAL_WORLD_SIZE``, at most the GPU count), else
    ``"gloo"`` (CPU). With NCCL each rank uses GPU ``LOCAL_RANK`` (``torch.cuda.set_device`` before
    the group starts, and the group is bound to it).

    ``fn`` cannot receive keyword arguments named ``timeout``, ``collective_timeout`` or ``backend``
    (they are launch's).
    """
    if backend is None:
        backend = default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", nprocs)) if in_torchrun() else nprocs)
    check_launch_args(fn, nprocs, timeout, backend, collective_timeout)
    if getattr(mp.current_process(), "_inheriting", False):  # a rank importing the script that launched it
        raise LaunchError("autopar.launch was called while this process was starting as a rank of a launch: the "
                          "script calls launch when it is imported; call it under `if __name__ == \"__main__\":`")
    collective_timeout = DEFAULT_COLLECTIVE_TIMEOUT_S if collective_timeout is None else collective_timeout
    if in_torchrun():
        return [_run_in_this_rank(fn, nprocs, args, kwargs, collective_timeout, backend)]
    payload = _pickle_task(fn, args, kwargs, "launch")
    start_s = collective_timeout if timeout is None else timeout
    group = _Group.start("launch", nprocs, backend, start_s, payload, collective_timeout_s=collective_timeout)
    try:
        outcome = group.collect(run_deadline(timeout, time.monotonic()), _FAILURE_GRACE_S)
    except BaseException:
        group.stop()
        raise
    if outcome.failures or outcome.pending:
        died = any(f.kind == "died" and f.step is None for f in outcome.failures)
        outcome.read_steps(group.store, _STEP_WAIT_S if died else 0.0)
        group.stop()
        raise outcome.error(f"launch({_name(fn)}, nprocs={nprocs})", timeout, "the ranks still running were stopped",
                            collective_timeout)
    # Every rank has reported and is now leaving its group and exiting; a torch process takes a
    # second or more to shut down, which the caller need not wait for.
    group.reap_later(_EXIT_GRACE_S)
    return [outcome.results[r] for r in range(nprocs)]


def run_deadline(timeout: Optional[float], now: float) -> Optional[float]:
    """When a run started at ``now`` (``time.monotonic()``) is stopped: ``now + timeout``, or None (never)
    when ``timeout`` is None, launch's default: a stall is caught per collective instead."""
    return None if timeout is None else now + timeout
def default_backend(local_ranks: int) -> str:
    """``"nccl"`` when CUDA is available with a GPU for each of this machine's ``local_ranks`` ranks, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() and 0 < local_ranks <= torch.cuda.device_count() else "gloo"


def bind_device(backend: str) -> Optional[torch.device]:
    """Under a backend with NCCL, make GPU ``LOCAL_RANK`` this process's current device (before the
    first collective: NCCL stages object collectives through the current device, and ranks left on
    ``cuda:0`` collide) and return it; None for a CPU backend."""
    if "nccl" not in backend or not torch.cuda.is_available():
        return None
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def ensure_process_group(world_size: int, what: str = "this mesh") -> None:
    """Raise ``LaunchError`` unless a default torch.distributed group of ``world_size`` ranks is
    initialised in this process. ``what`` names who needs it (e.g. ``"mesh {'dp': 2, 'tp': 2}"``).
    With an NCCL group, GPU ``LOCAL_RANK`` becomes the current device (``bind_device``)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise LaunchError(
            f"{what} needs {world_size} processes but there is no torch.distributed process group: "
            f"run your code with autopar.launch(fn, nprocs={world_size}), or start the script with "
            f"`torchrun --standalone --nproc-per-node {world_size} script.py` (autopar.compile starts the "
            "group from torchrun's environment), or call torch.distributed.init_process_group first"
        )
    have = dist.get_world_size()
    if have != world_size:
        raise LaunchError(
            f"{what} needs {world_size} processes but the torch.distributed process group has {have}: "
            f"start {world_size} processes (autopar.launch(fn, nprocs={world_size}) or torchrun "
            f"--nproc-per-node {world_size}), or use a mesh of {have} devices"
        )
    if "LOCAL_RANK" in os.environ:
        bind_device(str(dist.get_backend()))


# ----------------------------------------------------------------------------------------------
# Under torchrun: run here


def _run_in_this_rank(fn: Callable[..., Any], nprocs: int, args: tuple, kwargs: dict, timeout: float, backend: str) -> Any:
    world_size = int(os.environ["WORLD_SIZE"])
    if nprocs != world_size:
        warnings.warn(
            f"launch(nprocs={nprocs}) runs inside an existing job of WORLD_SIZE={world_size} "
            f"(RANK={os.environ['RANK']}): fn runs on this rank of the {world_size}-rank job",
            RuntimeWarning,
            stacklevel=3,
        )
    created = not dist.is_initialized()
    if created:
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise LaunchError(
                f"RANK and WORLD_SIZE are set, so launch runs fn in this process as one rank, but "
                f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: start the job with "
                "torchrun, or unset RANK and WORLD_SIZE to let launch spawn local processes"
            )
        device = bind_device(backend)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), device_id=device)
    try:
        return fn(*args, **kwargs)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# What the parent knows of a failed rank


@dataclass
class _Failure:
    """One rank's failure as the parent sees it: ``kind`` is "raised" (with the remote exception's
    type, message and traceback as text), "died" (with ``exitcode``), "hung" (it never reported while
    the others' collectives failed) or "unreadable". ``step`` is the rank's step where known;
    ``absent`` the ranks its roll call did not hear from (see ``report_collective_failure``)."""

    rank: int
    kind: str
    type_name: str = ""
    message: str = ""
    traceback: str = ""
    distributed: bool = False  # a torch.distributed error: usually a consequence of a peer's failure
    exitcode: Optional[int] = None
    step: Optional[int] = None
    absent: Optional[list] = None

    def headline(self, world_size: int) -> str:
        at = f" in step {self.step}" if self.step is not None else ""
        if self.kind == "died" and self.step is None:  # at start-up: an import, or a script's launch run on import
            return (f"rank {self.rank} of {world_size} {_describe_exit(self.exitcode)} before returning a result "
                    "(os._exit, a crash, a kill, a failed start-up import, or a script that calls autopar.launch "
                    "outside `if __name__ == \"__main__\":`, which each rank runs again on import: its stderr may "
                    "say which)")
        if self.kind == "died":
            return (f"rank {self.rank} of {world_size} {_describe_exit(self.exitcode)}{at} before returning a result "
                    "(os._exit, a crash, a kill, or a failed start-up import: its stderr may say which)")
        if self.kind == "hung":
            return (f"rank {self.rank} of {world_size} hung{at}: it never joined the collective that rank(s) "
                    f"{self.message} failed in after the collective timeout, nor returned")
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        if len(first) > 200:
            first = first[:200] + "..."
        return f"rank {self.rank} of {world_size} raised {self.type_name}{at}" + (f": {first}" if first else "")


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "exited (exit code unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


# ----------------------------------------------------------------------------------------------
# Parent side (shared with the worker pool)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _pickle_task(fn: Callable[..., Any], args: tuple, kwargs: dict, where: str) -> bytes:
    try:
        return pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise LaunchError(
            f"{where}: cannot pickle {_name(fn)} or its arguments for the child processes ({exc}); "
            "fn must be a module-level function of an importable module (no lambda, no nested "
            "function) and its arguments must be picklable"
        ) from exc


@dataclass
class _Outcome:
    """What ``_Group.collect`` heard: results by rank, failures in arrival order, ranks not heard, and
    the steps the ranks' roll calls left on the store (``read_steps``)."""

    world_size: int
    results: dict[int, Any]
    failures: list[_Failure]
    pending: list[int]
    steps: dict[int, int] = field(default_factory=dict)

    def read_steps(self, store: Any, wait_s: float = 0.0) -> None:
        """The step of each rank that reported a failed collective on ``store`` (see ``faults.roll_call``),
        waiting up to ``wait_s`` for a first one (a death's peers write theirs a moment after it)."""
        until = time.monotonic() + wait_s
        while True:
            for r in range(self.world_size):
                try:
                    if store.check([fault_key(r)]):
                        step = int(store.get(fault_key(r)))
                        if step >= 0:
                            self.steps[r] = step
                except Exception:  # the store is only a hint
                    return
            if self.steps or time.monotonic() >= until:
                return
            time.sleep(0.1)

    def primary(self) -> Optional[_Failure]:
        """The likely root cause: a non-distributed exception, else a death, else a rank that never
        reported while the others' collectives failed (hung), else the first failure."""
        for pick in (lambda f: f.kind == "raised" and not f.distributed, lambda f: f.kind == "died"):
            for f in self.failures:
                if pick(f):
                    return f
        comm = [f for f in self.failures if f.distributed]
        if self.pending and comm:
            named = [r for f in comm for r in (f.absent or ()) if r in self.pending]
            rank = named[0] if named else self.pending[0]
            others = _ranks(sorted(f.rank for f in comm))
            return _Failure(rank, "hung", message=others, step=self._others_step(rank))
        return self.failures[0] if self.failures else None

    def _others_step(self, rank: int) -> Optional[int]:
        """The step the ranks other than ``rank`` failed in (the most common one), if any said."""
        steps = [f.step for f in self.failures if f.rank != rank and f.step is not None]
        steps += [s for r, s in self.steps.items() if r != rank and not any(f.rank == r for f in self.failures)]
        return max(set(steps), key=steps.count) if steps else None

    def error(self, what: str, timeout: float, stopped: str, collective_timeout: Optional[float] = None) -> LaunchError:
        primary = self.primary()
        if primary is None:
            done = sorted(self.results)
            return LaunchError(
                f"{what} timed out after {timeout:g} s: rank(s) {_ranks(self.pending)} had not returned"
                + (f" (rank(s) {_ranks(done)} had)" if done else "")
                + f"; {stopped}. Pass a larger timeout= if the work is legitimately long; otherwise look "
                "for a rank stuck in a collective that another rank never entered"
            )
        if primary.step is None and primary.kind == "died":
            primary.step = self._others_step(primary.rank)
        head = primary.headline(self.world_size)
        if primary.kind == "hung" and collective_timeout is not None:
            head += f" (collective_timeout={collective_timeout:g} s)"
        lines = [f"{what} failed: {head}"]
        if primary.traceback:
            lines += [f"--- traceback from rank {primary.rank} ---", primary.traceback.rstrip()]
        others = [f for f in self.failures if f is not primary]
        lines += [f"also: {f.headline(self.world_size)}" for f in others]
        lines.append(stopped)
        return LaunchError("\n".join(lines), rank=primary.rank, exitcode=primary.exitcode)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


class _Group:
    """``world_size`` spawned children, one result pipe each, around a TCPStore hosted here."""

    def __init__(self, store: Any, procs: list[BaseProcess], conns: list[Connection]):
        self.store = store  # kept alive: the children's group uses it for rendezvous and new_group
        self.procs = procs
        self.conns = conns

    @property
    def world_size(self) -> int:
        return len(self.procs)

    @classmethod
    def start(cls, mode: str, world_size: int, backend: str, timeout_s: float, payload: Optional[bytes] = None,
              collective_timeout_s: Optional[float] = None) -> "_Group":
        """Spawn ``world_size`` ranks running ``_rank.main(mode, ...)``; ``timeout_s`` bounds their
        rendezvous, ``collective_timeout_s`` (default ``timeout_s``) their collectives. They are started with
        ``runpy.run_path`` on ``_rank.py``, not by importing it, so that a rank never imports the
        autopar package (seconds per process, see ``_rank``'s docstring)."""
        store = dist.TCPStore(_rank.HOST, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        ctx = mp.get_context("spawn")
        group = cls(store, [], [])
        try:
            for rank in range(world_size):
                ours, theirs = ctx.Pipe(duplex=(mode == "pool"))
                args = dict(mode=mode, rank=rank, world_size=world_size, port=store.port, backend=backend,
                            timeout_s=timeout_s, conn=theirs, argv0=sys.argv[0] if sys.argv else "", payload=payload,
                            collective_timeout_s=collective_timeout_s or timeout_s)
                proc = ctx.Process(
                    target=runpy.run_path,
                    args=(_rank.__file__,),
                    kwargs={"init_globals": {"ARGS": args}, "run_name": _rank.RUN_NAME},
                    name=f"autopar-rank{rank}",
                    daemon=False,  # fn may start processes of its own (e.g. DataLoader workers)
                )
                proc.start()
                theirs.close()  # so that a dead child reads as EOF here
                group.procs.append(proc)
                group.conns.append(ours)
        except BaseException:
            group.stop()
            raise
        return group

    def collect(self, deadline: Optional[float], grace: float) -> _Outcome:
        """Wait for one message from each rank until ``deadline`` (``time.monotonic()``; None: no
        deadline), or for its death. After the first failure, listen ``grace`` seconds more, then stop
        listening; ranks not heard from by then are ``pending``."""
        pending = set(range(self.world_size))
        out = _Outcome(self.world_size, {}, [], [])
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            by_handle: dict[Any, tuple[str, int]] = {}
            for r in pending:
                by_handle[self.conns[r]] = ("conn", r)
                by_handle[self.procs[r].sentinel] = ("proc", r)
            ready = wait(list(by_handle), timeout=left)
            # Messages first: a rank that reported and then exited is not a death.
            ready.sort(key=lambda h: by_handle[h][0] != "conn")
            for handle in ready:
                kind, r = by_handle[handle]
                if r not in pending:
                    continue
                conn = self.conns[r]
                if kind == "conn" or conn.poll():
                    try:
                        tag, value = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        out.failures.append(self._death(r))
                    except Exception as exc:
                        out.failures.append(_Failure(r, "unreadable", type(exc).__name__,
                                                     f"the parent cannot unpickle rank {r}'s message: {exc}"))
                    else:
                        if tag == "ok":
                            out.results[r] = value
                        else:
                            out.failures.append(_Failure(**value))
                else:
                    out.failures.append(self._death(r))
                pending.discard(r)
            if out.failures:
                deadline = min(deadline if deadline is not None else math.inf, time.monotonic() + grace)
        out.pending = sorted(pending)
        return out

    def _death(self, rank: int) -> _Failure:
        proc = self.procs[rank]
        proc.join(1.0)
        return _Failure(rank, "died", exitcode=proc.exitcode)

    def stop(self) -> None:
        """Stop every child still running: SIGTERM, then SIGKILL after a grace period."""
        alive = [p for p in self.procs if p.is_alive()]
        for p in alive:
            p.terminate()
        until = time.monotonic() + _TERMINATE_GRACE_S
        for p in alive:
            p.join(max(0.0, until - time.monotonic()))
        for p in alive:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for c in self.conns:
            c.close()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for children that are exiting on their own, then ``stop``."""
        until = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, until - time.monotonic()))
        self.stop()

    def reap_later(self, timeout_s: float) -> None:
        """``join(timeout_s)`` in a daemon thread: exiting children are waited for (and, if stuck,
        stopped) without holding up the caller; the thread keeps the store alive meanwhile."""
        threading.Thread(target=self.join, args=(timeout_s,), name="autopar-reaper", daemon=True).start()
