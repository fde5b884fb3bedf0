"""``benchmarks/gpu_check.py --device cpu``: the one-GPU check runs its checks at toy sizes on CPU, so
the script works on the day a GPU is lent (its parity and compiled rows fail the run when wrong)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.gloo
@pytest.mark.slow
def test_gpu_check_runs_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--budget", "600", "--json", str(out)],
                         capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    got = json.loads(out.read_text())
    sections = {r["section"] for r in got["rows"]}
    assert sections == {"parity", "compiled", "kernels", "memory"}, sections
    assert not any(r["verdict"] == "skip" for r in got["rows"]), got["rows"]
    parity = [r for r in got["rows"] if r["section"] == "parity"]
    assert len(parity) >= 4 and all(r["verdict"] == "ok" for r in parity), parity
    assert "| section | case |" in res.stdout
