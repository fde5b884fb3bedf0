"""The local-process runtime on real gloo groups (no mocks): ``launch``, ``ensure_process_group``,
``WorkerPool`` and launch's torchrun mode.

The functions the ranks run live in ``tests/_launch_helpers.py``: spawned children unpickle them by
importing that module (pytest puts ``tests/`` on ``sys.path`` and the children inherit it), and it
imports only torch, not this file's pytest and autopar, which would cost each child seconds. Every
spawned process still costs about 2 s of ``import torch`` here, so each test checks several things
per launch.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _launch_helpers import (
    exit_before_all_reduce,
    fault_case,
    gather_ranks,
    raise_on_rank1,
    raise_quickly_on_rank1,
    report,
    report_and_mismatch,
    sleep,
    train_with_fault,
)

from autopar.errors import AutoparError
from autopar.runtime.launch import DEFAULT_COLLECTIVE_TIMEOUT_S, LaunchError, launch, run_deadline
from autopar.runtime.pool import WorkerPool

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# Helpers


def _pids(pid_dir: Path) -> dict[int, int]:
    return {int(p.stem): int(p.read_text()) for p in pid_dir.glob("*.pid")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, timeout=60) as p:
        yield p


# ---------------------------------------------------------------------------------------------
# launch


def test_launch_four_ranks_rank_order_all_reduce_env_kwargs_and_size_mismatch():
    # one launch for these checks (each launch starts processes that import torch: seconds each); the
    # positional arguments of fn: the failure tests below
    out = launch(report_and_mismatch, 4, timeout=120, tag="four")
    assert [r["rank"] for r in out] == [0, 1, 2, 3]
    assert all(r["world_size"] == 4 and r["sum"] == 10.0 and r["tag"] == "four" for r in out)  # 1 + 2 + 3 + 4
    assert [r["env"]["RANK"] for r in out] == ["0", "1", "2", "3"]
    assert all(r["env"]["WORLD_SIZE"] == "4" and r["env"]["LOCAL_RANK"] == r["env"]["RANK"] for r in out)
    assert len({r["env"]["MASTER_PORT"] for r in out}) == 1
    pids = [r["pid"] for r in out]
    assert len(set(pids)) == 4 and os.getpid() not in pids
    msg = out[0]["mismatch"]
    assert msg.startswith("mesh {'tp': 3} needs 3 processes but the torch.distributed process group has 4")
    assert "autopar.launch(fn, nprocs=3)" in msg and "\n" not in msg


def test_launch_raising_rank_gives_its_traceback_and_stops_the_others(tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(raise_on_rank1, 2, str(tmp_path), timeout=60)
    err = info.value
    assert isinstance(err, AutoparError) and err.rank == 1
    text = str(err)
    assert "rank 1 of 2 raised ValueError: rank one refuses" in text
    assert "Traceback (most recent call last)" in text and "in raise_on_rank1" in text
    pids = _pids(tmp_path)
    assert sorted(pids) == [0, 1] and not any(_alive(p) for p in pids.values())


def test_launch_rank_that_dies_fails_the_run_and_frees_ranks_blocked_in_a_collective(tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(exit_before_all_reduce, 2, str(tmp_path), timeout=60)
    err = info.value
    assert err.rank == 1 and err.exitcode == 3
    assert "rank 1 of 2 exited with code 3" in str(err)
    pids = _pids(tmp_path)
    assert sorted(pids) == [0, 1] and not any(_alive(p) for p in pids.values())


def test_launch_timeout_stops_everything():
    # Start-up alone may take seconds here; either way the run cannot finish inside the timeout.
    with pytest.raises(LaunchError, match="timed out after 2 s"):
        launch(sleep, 1, 120, timeout=2)


def test_launch_has_no_run_deadline_by_default():
    """A long training run is not stopped: launch's default ``timeout`` is None, which sets no deadline
    (a stall is caught per collective, whose own default stays 300 s); a given timeout sets one
    (``test_launch_timeout_stops_everything`` shows it stops a hang)."""
    params = inspect.signature(launch).parameters
    assert params["timeout"].default is None and params["collective_timeout"].default is None
    assert DEFAULT_COLLECTIVE_TIMEOUT_S == 300.0
    assert run_deadline(None, 100.0) is None
    assert run_deadline(2, 100.0) == 102.0


def test_launch_rejects_unpicklable_fn_before_spawning():
    with pytest.raises(LaunchError, match="module-level function"):
        launch(lambda: 0, 2)


def test_torchrun_mode_runs_in_process_and_no_group_error():
    script = textwrap.dedent(
        """
        import json, os
        import torch.distributed as dist
        from autopar.runtime.launch import LaunchError, ensure_process_group, launch

        out = {}
        try:
            ensure_process_group(2)
        except LaunchError as exc:
            out["no_group"] = str(exc)

        def fn(x):  # a local function: it could not be pickled, so nothing may be spawned
            return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "pid": os.getpid(), "x": x}

        out["result"] = launch(fn, 1, 7)
        out["pid"] = os.getpid()
        out["initialised_after"] = dist.is_initialized()
        print("RESULT" + json.dumps(out))
        """
    )
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    out = json.loads(line[len("RESULT"):])
    assert out["result"] == [{"rank": 0, "world_size": 1, "pid": out["pid"], "x": 7}]
    assert out["initialised_after"] is False  # launch destroys the group it created
    msg = out["no_group"]
    assert "no torch.distributed process group" in msg and "autopar.launch(fn, nprocs=2)" in msg
    assert "torchrun --standalone --nproc-per-node 2" in msg and "autopar.compile starts the group" in msg
    assert "\n" not in msg


# ---------------------------------------------------------------------------------------------
# WorkerPool


def test_pool_runs_different_functions_on_the_same_processes(pool):
    first = pool.run(report, "one")
    second = pool.run(gather_ranks, 5)
    assert [r["rank"] for r in first] == [0, 1] and all(r["sum"] == 3.0 for r in first)
    assert [r[:2] for r in second] == [[0, 5], [0, 5]]
    assert [r["pid"] for r in first] == [r[2] for r in second] == pool.pids
    assert os.getpid() not in pool.pids


def test_pool_propagates_an_exception_and_stays_usable(pool):
    with pytest.raises(LaunchError) as info:
        pool.run(raise_quickly_on_rank1)
    text = str(info.value)
    assert info.value.rank == 1 and "rank 1 of 2 raised KeyError" in text and "no such thing on rank 1" in text
    assert "Traceback (most recent call last)" in text and "in raise_quickly_on_rank1" in text
    assert not pool.broken
    assert [r["sum"] for r in pool.run(report, "again")] == [3.0, 3.0]


def test_pool_worker_death_breaks_the_pool(tmp_path):
    with WorkerPool(2, timeout=60) as p:
        with pytest.raises(LaunchError) as info:
            p.run(exit_before_all_reduce, str(tmp_path))
        assert info.value.rank == 1 and info.value.exitcode == 3 and "exited with code 3" in str(info.value)
        assert p.broken
        with pytest.raises(LaunchError, match="broken pool"):
            p.run(report, "after")
        assert not any(_alive(pid) for pid in p.pids)


# ---------------------------------------------------------------------------------------------
# Faults mid-training, each in a fresh launch of 4 gloo ranks (never the shared pool): rank 1, in step 3
# between its forward and its backward, is killed, hangs or raises. The other ranks must stop with an
# error naming rank 1 and step 3: within the collective timeout plus the roll call, well inside the
# run's timeout (which, if it fired instead, would say "timed out" and fail the match).

#: collective timeout of the fault tests (s): compile's own collectives must fit in it on a busy machine
FAULT_TIMEOUT = 20
#: the whole run's bound: start-up (4 processes importing torch and autopar) plus FAULT_TIMEOUT + 30 s
RUN_TIMEOUT = 150


@functools.cache
def _fault_plan() -> str:
    import autopar

    model, args, mesh = fault_case()
    return autopar.recipes.megatron_tp(model, mesh, args).to_json()


@pytest.mark.parametrize("kind, says", [
    ("kill", ("rank 1 of 4 was killed by SIGKILL (exit code -9) in step 3 before returning a result (os._exit, a "
              "crash, a kill, or a failed start-up import: its stderr may say which)")),
    ("hang", ("rank 1 of 4 hung in step 3: it never joined the collective that rank(s) 0, 2, 3 failed in after the "
              f"collective timeout, nor returned (collective_timeout={FAULT_TIMEOUT} s)")),
    ("raise", "rank 1 of 4 raised ValueError in step 3: injected fault on rank 1"),
], ids=["kill", "hang", "raise"])
def test_fault_in_a_step_stops_every_rank_naming_the_rank_and_the_step(tmp_path, kind, says):
    with pytest.raises(LaunchError) as info:
        launch(train_with_fault, 4, kind, str(tmp_path), _fault_plan(), timeout=RUN_TIMEOUT,
               collective_timeout=FAULT_TIMEOUT)
    err = info.value
    first = str(err).splitlines()[0]
    assert first == f"launch(train_with_fault, nprocs=4) failed: {says}", str(err)
    assert err.rank == 1 and err.exitcode == (-9 if kind == "kill" else None)
    if kind == "hang":  # the survivors' own errors name the rank their roll call did not hear from
        assert re.search(r"also: rank [023] of 4 raised autopar\.errors\.CollectiveError in step 3: rank [023] of 4: "
                         r"a collective of step 3 in the (forward|backward) failed \(RuntimeError: .*\); rank\(s\) 1 "
                         rf"did not report it within {min(FAULT_TIMEOUT, 10)} s", str(err)), str(err)
    pids = _pids(tmp_path)
    assert sorted(pids) == [0, 1, 2, 3] and not any(_alive(p) for p in pids.values())


TORCHRUN_SCRIPT = """
import sys

from _launch_helpers import train_with_fault

from autopar.runtime.launch import launch

launch(train_with_fault, 4, "kill", sys.argv[1], open(sys.argv[2]).read(), collective_timeout={timeout})
"""


def test_killed_rank_under_torchrun_stops_the_job(tmp_path):
    # torchrun's agent sees the death and stops the survivors (blocked in the backward's collectives);
    # its summary names the rank and the signal. subprocess's timeout is the bound a hang would hit.
    (tmp_path / "plan.json").write_text(_fault_plan())
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT.format(timeout=FAULT_TIMEOUT))
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(script), str(pid_dir), str(tmp_path / "plan.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    root = out[out.index("Root Cause"):] if "Root Cause" in out else out
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root) and "Signal 9 (SIGKILL)" in root, out
    pids = _pids(pid_dir)
    assert sorted(pids) == [0, 1, 2, 3] and not any(_alive(p) for p in pids.values())


def test_launch_rejects_a_bad_collective_timeout():
    with pytest.raises(ValueError, match=r"^autopar.launch: collective_timeout \(seconds\) must be a positive number "
                                          r"or None, got 0$"):
        launch(report, 2, "x", collective_timeout=0)


UNGUARDED_SCRIPT = """
import autopar


def work():
    return 1


print(autopar.launch(work, 2, timeout=300))
"""


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    """A script that calls launch at import time (no ``if __name__ == "__main__":``) is imported again by every
    rank: each rank says so and exits, and the run's error names the guard as a cause."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode != 0
    assert "the script calls launch when it is imported; call it under `if __name__ == \"__main__\":`" in run.stderr
    assert re.search(r"LaunchError: launch\(work, nprocs=2\) failed: rank \d of 2 exited with code 1 before returning "
                     r"a result \(.*a script that calls autopar.launch outside `if __name__ == \"__main__\":`",
                     run.stderr), run.stderr[-3000:]
