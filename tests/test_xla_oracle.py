"""Independent oracle: the collectives autopar's lowering runs equal the ones XLA's SPMD partitioner
inserts for the same shardings (JAX on 8 virtual CPU devices, tests/xla_oracle.py).

Each program of the oracle's table is written again as a torch module with every tensor pinned by
``autopar.hint`` (and its inputs and weights by ``hints=``), planned, run by ``autopar.simulate``,
and the collectives the first device executed are compared with XLA's, both as sorted
(kind, axis, bytes) lists. Not compared: the two 2-D reshards of the table, where XLA exchanges
through a sub-axis all-to-all and collective-permutes (point-to-point), which autopar's SBP steps
do not have (see docs/design/limitations.md).
"""

from __future__ import annotations

import os

import pytest
import torch

import autopar
from autopar.ir.hint import hint

#: fixtures that start processes (JAX in a subprocess): conftest marks their tests gloo
PROCESS_FIXTURES = {"xla"}

X = pytest.importorskip("xla_oracle")


class MatmulChain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(32, 64))
        self.w2 = torch.nn.Parameter(torch.randn(64, 32))

    def forward(self, x):
        h = hint(x @ self.w1, "S(1)")
        return hint(h @ self.w2, "B")


class MegatronMLP(torch.nn.Module):
    def __init__(self, sequence_parallel: bool = False):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(32, 128))
        self.w2 = torch.nn.Parameter(torch.randn(128, 32))
        self.out = "S(0)" if sequence_parallel else "B"

    def forward(self, x):
        a = hint(x @ self.w1, "S(1)")
        h = hint(torch.nn.functional.gelu(a), "S(1)")
        return hint(h @ self.w2, self.out)


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wo = torch.nn.Parameter(torch.randn(64, 32))

    def forward(self, q, k, v):
        # softmax(q k^T / sqrt(8)) v as one fused op: the scores never exist as tensors here. (Written
        # with 4-D matmuls, torch flattens batch x heads into one dim, and a split of the inner
        # (heads) dim of a flattened pair is not an SBP placement, so the heads would be gathered.)
        o = hint(torch.nn.functional.scaled_dot_product_attention(q, k, v), "S(1)")
        t = hint(o.transpose(1, 2), "S(2)")
        r = hint(t.reshape(2, 16, 64), "S(2)")
        return hint(r @ self.wo, "B")


class ReshapeBetweenLayouts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))  # a model needs a parameter

    def forward(self, x):
        r = hint(x.reshape(16, 8, 8), "S(0)")
        r_s1 = hint(r, "S(1)")
        return hint(r_s1.reshape(16, 64) * hint(self.scale, "B"), "S(1)")


class DPGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 16))

    def forward(self, x):
        y = hint(x @ self.w, "S(0)")
        sq = hint(y ** 2, "S(0)")
        # XLA's loss is dead code (only the gradient is returned); pinning autopar's as the partial
        # sums keeps the planner from gathering sq instead (cheaper than one all-reduce under the
        # latency model) before the loss is handed over on every device
        return hint(sq.sum(), "P")


def _case(name):
    torch.manual_seed(0)
    if name == "matmul_chain":
        return MatmulChain(), (torch.randn(16, 32),), {"w1": "S(1)", "w2": "S(0)", "input:0": "B"}, False
    if name in ("megatron_mlp", "megatron_mlp_sp"):
        sp = name.endswith("_sp")
        x = "S(0)" if sp else "B"
        return MegatronMLP(sp), (torch.randn(16, 32),), {"w1": "S(1)", "w2": "S(0)", "input:0": x}, False
    if name == "attention":
        qkv = tuple(torch.randn(2, 8, 16, 8) for _ in range(3))
        return Attention(), qkv, {"wo": "S(0)", "input:0": "S(1)", "input:1": "S(1)", "input:2": "S(1)"}, False
    if name == "reshape_between_layouts":
        return ReshapeBetweenLayouts(), (torch.randn(16, 64),), {"input:0": "S(0)"}, False
    if name == "dp_mlp_grad":
        return DPGrad(), (torch.randn(16, 32),), {"w": "B", "input:0": "S(0)"}, True
    raise KeyError(name)


PROGRAMS = ("matmul_chain", "megatron_mlp", "megatron_mlp_sp", "attention", "reshape_between_layouts", "dp_mlp_grad")


@pytest.fixture(scope="module")
def xla():
    try:
        return X.all_xla_collectives()
    except Exception as e:  # noqa: BLE001
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the JAX oracle could not run here: {e}")


@pytest.mark.parametrize("name", PROGRAMS)
def test_lowering_inserts_the_collectives_xla_inserts(xla, name):
    model, args, hints, training = _case(name)
    (size,), (axis,) = X.PROGRAMS[name]["mesh"]
    mesh = autopar.Mesh({axis: size}, device="cpu")
    plan = autopar.plan(model, mesh, args, training=training, hints=hints, progress=False, deterministic_time=0.5)
    trace: dict = {}
    outputs, _ = autopar.simulate(model, plan, args, trace=trace)
    ours = [{"kind": e.kind, "axis": e.axis, "bytes": e.bytes} for e in trace[(0,)]]
    if training:  # autopar hands the loss to the user on every device (one scalar all-reduce);
        ours.remove({"kind": "all_reduce", "axis": axis, "bytes": 4})  # XLA's program drops it
    key = lambda r: (r["kind"], r["axis"], r["bytes"])  # noqa: E731
    assert sorted(ours, key=key) == sorted(xla[name], key=key)
    # and the program computes what the model computes
    ref = model(*args)
    torch.testing.assert_close(outputs, ref, rtol=1e-4, atol=1e-4)  # what the model returns, as it returns it
