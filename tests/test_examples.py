"""The examples run as users run them: ``examples/train_gpt.py`` under torchrun (4 gloo ranks) and
``examples/reuse_plan.py --small`` (plans in-process, then ``autopar.launch``es 4 ranks).

Each is a subprocess with its own process group, so a hang or crash cannot take pytest down; a
generous timeout bounds each one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(args: list[str], timeout: float = 180) -> str:  # the longest took 55 s under load
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # never a rank ourselves
        env.pop(k, None)
    # its own session, so that a timeout stops the ranks too, not just torchrun or the launcher
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(args)} did not finish in {timeout} s:\n{(stdout + stderr)[-6000:]}")
    out = stdout + stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def test_train_gpt_under_torchrun_matches_single_device():
    out = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                str(EXAMPLES / "train_gpt.py"), "--small", "--steps", "3", "--check"])
    steps = re.findall(r"^step (\d+) loss ([-\d.e+]+) ref ([-\d.e+]+)$", out, re.M)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3], out[-4000:]  # printed once (rank 0), every step
    losses = [float(x) for _, x, _ in steps]
    refs = [float(r) for _, _, r in steps]
    assert all(b < a for a, b in zip(losses, losses[1:])), f"the loss does not fall: {losses}"
    assert losses == pytest.approx(refs, rel=1e-5, abs=1e-6), f"parallel {losses} vs single device {refs}"
    assert "compiled for mesh {'dp': 4}" in out


def test_reuse_plan_small():
    # two ranks (the example's --small default is four): the plan file's round trip is the same
    out = _run([str(EXAMPLES / "reuse_plan.py"), "--small", "--mesh", "dp=2"])
    assert "loaded back:" in out and "step time" in out and "baselines" in out  # the plan's summary
    m = re.search(r"^losses \(rank 0\): (.+)$", out, re.M)
    assert m, out[-4000:]
    losses = [float(x) for x in m.group(1).split()]
    assert len(losses) == 2 and losses[1] < losses[0], losses


def test_plan_llama70b_small_and_annotate_by_hand(tmp_path):
    """The planning examples, in this process: LLaMA-3-70B's layer shapes on 64 H100s (2 layers, a
    short solve) saved with its HTML page, and the hand-annotated model keeping its pins."""
    import importlib.util

    def load(name):
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    plan = load("plan_llama70b").main(["--small", "--search-time", "0.5", "--save", str(tmp_path / "p.json"),
                                       "--html", str(tmp_path / "p.html")])
    assert plan.mesh_shape == (8, 8) and (tmp_path / "p.html").stat().st_size > 0
    import autopar

    assert autopar.load_plan(tmp_path / "p.json").to_json() == plan.to_json()
    annotated = load("annotate_by_hand").main()
    assert annotated.placements["input:0"] == "S(0), B"
    assert annotated.placements["blocks.1.down.weight"].endswith("S(1)")
