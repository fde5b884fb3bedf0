"""Under torchrun ``autopar.compile`` starts the process group itself, on one node or many.

Two torchrun agents on the loopback address (c10d rendezvous) each start 2 processes: a 2-node job
of 4 ranks, as ``torchrun --nnodes 2`` runs it on a cluster. The script never calls
``init_process_group``; the dp=2 x tp=2 mesh keeps tp inside a node (``devices_per_node=2``), which
``runtime.nodes`` checks against the nodes the ranks really run on.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.models import make
from autopar.runtime.nodes import node_mismatch

JOB = Path(__file__).parent / "data" / "torchrun_job.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_device_losses(steps: int = 2) -> list[float]:
    torch.manual_seed(0)
    model, inputs = make("gpt", "tiny", batch=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.gloo
@pytest.mark.slow
def test_two_torchrun_agents_compile_without_init(tmp_path):
    port, result = _free_port(), tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"autopar-{port}",
           "--max-restarts", "0", str(JOB), str(result)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outs = []
    try:
        for a in agents:
            outs.append(a.communicate(timeout=300)[0])
    finally:
        for a in agents:
            a.kill()
    assert all(a.returncode == 0 for a in agents), "\n\n".join(o[-3000:] for o in outs)
    got = json.loads(result.read_text())
    assert got["world"] == 4 and got["backend"] == "gloo"
    assert got["warnings"] == [], got["warnings"]
    expected = _single_device_losses()
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got["losses"], expected)), (got["losses"], expected)


def test_node_layout_mismatch_is_named():
    two_nodes = ["h/0", "h/0", "h/1", "h/1"]
    assert node_mismatch(two_nodes, 2, {"dp": 2, "tp": 2}) is None
    assert node_mismatch(["h/0"] * 4, 2, {"dp": 2, "tp": 2}) is None  # one node holds every group
    why = node_mismatch(two_nodes, 4, {"dp": 2, "tp": 2})
    assert why is not None and "2 ranks per node on 2 nodes" in why and "--nproc-per-node 4" in why
    assert "not numbered together" in node_mismatch(["h/0", "h/1", "h/0", "h/1"], 2, {"dp": 2, "tp": 2})
