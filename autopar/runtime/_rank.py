"""What one spawned rank runs, for ``launch`` (one task, then exit) and ``WorkerPool`` (tasks until
told to stop).

This file imports nothing from autopar, on purpose: the parent starts it with ``runpy.run_path``
(see ``autopar.runtime.launch._Group.start``) instead of importing it, so a rank pays for
``import torch`` only (about 2 s here) rather than for the whole autopar package (about 4 s), and a
rank still starts while some unrelated autopar module is broken. For the same reason everything it
sends to the parent is built from builtins: nothing defined here is importable by name there.

Protocol on the rank's pipe, pickled bytes: rank -> parent ``("ok", value)`` or
``("raised", failure)`` with ``failure`` a dict (see ``failure_of``); parent -> pool worker a pickled
``(fn, args, kwargs)`` or ``SHUTDOWN``.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
import traceback
from typing import Any, Optional

import torch
import torch.distributed as dist

#: ``run_name`` the parent gives ``runpy.run_path``; the entry point below runs only under it.
RUN_NAME = "__autopar_rank__"
#: Tells a pool worker to leave its group and exit (never a pickle: those start with b"\x80").
SHUTDOWN = b"shutdown"
HOST = "127.0.0.1"


def prepare(rank: int, world_size: int, port: int) -> None:
    """The environment a rank's code may read, set before any user code runs."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
    )
    if "OMP_NUM_THREADS" not in os.environ:
        # torch is imported already, so setting the variable alone would be too late for it.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def init_group(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
               collective_timeout_s: Optional[float] = None) -> None:
    """Join the parent's TCPStore and initialise the default group. ``collective_timeout_s``
    (default ``timeout_s``) bounds every collective, so one that a peer never enters fails instead of
    waiting forever; the ranks first wait (up to ``timeout_s``) for each other on the store, so that a
    slow start-up is not held against a short collective timeout."""
    store = dist.TCPStore(HOST, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    arrived = store.add("autopar/arrived", 1)
    until = time.monotonic() + timeout_s
    while arrived < world_size and time.monotonic() < until:
        time.sleep(0.05)
        arrived = store.add("autopar/arrived", 0)
    device = None
    if "nccl" in backend and torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    td = datetime.timedelta(seconds=collective_timeout_s or timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=td, device_id=device)


def destroy_group() -> None:
    """Destroy this rank's process group, if any (a rank's last step)."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # the parent already has this rank's report; a failed teardown changes nothing
        pass


#: Words in the message of a torch.distributed failure that is a plain RuntimeError.
_DISTRIBUTED_WORDS = ("gloo", "NCCL", "Connection closed by peer", "caused pair closure")


def is_distributed_error(exc: BaseException) -> bool:
    """A failure of the communication layer, usually a consequence of a peer's failure. On torch
    2.13 gloo's "Connection closed by peer" and its timeouts are plain ``RuntimeError``s (not
    ``DistError``) whose message names gloo's source file, or says "Application timeout caused pair
    closure" (a peer's pair timed out first). An exception raised *from* one (autopar's
    ``CollectiveError``) counts too."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, dist.DistError):
            return True
        text = str(exc)
        if isinstance(exc, RuntimeError) and any(k in text for k in _DISTRIBUTED_WORDS):
            return True
        exc, seen = exc.__cause__, seen + 1
    return False


def failure_of(rank: int, exc: BaseException, message: Optional[str] = None) -> dict:
    """The failure report a rank sends back for exception ``exc``, with the step this rank was in
    (``autopar.runtime.faults.current_step``, when that module is loaded) and the ranks a failed
    collective's roll call did not hear from (``absent_ranks``)."""
    faults = sys.modules.get("autopar.runtime.faults")
    return {
        "rank": rank,
        "kind": "raised",
        "type_name": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc) if message is None else message,
        "traceback": "".join(traceback.format_exception(exc)),
        "distributed": is_distributed_error(exc),
        "step": getattr(exc, "step", None) if getattr(exc, "step", None) is not None else
        (faults.current_step() if faults is not None else None),
        "absent": getattr(exc, "absent_ranks", None),
    }


def send(conn: Any, rank: int, message: tuple) -> None:
    """Send one report; a return value that cannot be pickled becomes a failure report."""
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        note = f"the return value of fn on rank {rank} cannot be pickled: {exc}"
        data = pickle.dumps(("raised", failure_of(rank, exc, note)), protocol=pickle.HIGHEST_PROTOCOL)
    conn.send_bytes(data)


def run_task(conn: Any, rank: int, payload: bytes) -> None:
    """Unpickle ``(fn, args, kwargs)``, call it, report the result or the exception."""
    try:
        fn, args, kwargs = pickle.loads(payload)
        message: tuple = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the parent must hear of them
        message = ("raised", failure_of(rank, exc))
    send(conn, rank, message)


def main(mode: str, rank: int, world_size: int, port: int, backend: str, timeout_s: float, conn: Any,
         argv0: str, payload: Optional[bytes] = None, collective_timeout_s: Optional[float] = None) -> None:
    """``mode`` "launch": run ``payload`` once. ``mode`` "pool": report ready (with the pid), then
    run tasks until ``SHUTDOWN`` or until the parent goes away. The group is destroyed at the end."""
    sys.argv[0] = argv0  # run_path set it to this file; user code should see the parent's, as with spawn
    prepare(rank, world_size, port)
    try:
        try:
            init_group(rank, world_size, port, backend, timeout_s, collective_timeout_s)
        except BaseException as exc:
            send(conn, rank, ("raised", failure_of(rank, exc)))
            return
        if mode == "launch":
            assert payload is not None
            run_task(conn, rank, payload)
            return
        send(conn, rank, ("ok", os.getpid()))
        while True:
            try:
                task = conn.recv_bytes()
            except (EOFError, OSError):
                break  # the parent has gone
            if task == SHUTDOWN:
                break
            run_task(conn, rank, task)
    finally:
        destroy_group()
        conn.close()


if __name__ == RUN_NAME:
    main(**globals()["ARGS"])  # ARGS comes from run_path's init_globals
