"""The one-pass joint trace (``_torch_compat.aot._export_joint_fast``) gives the graph AOTAutograd's
export gives: same nodes, arguments, descriptors and the metadata autopar reads. A torch upgrade
that breaks the equivalence fails here, not silently in a plan."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from autopar import _torch_compat as tc
from autopar.ir.capture import capture
from autopar.models import make
from test_capture import TinyGPT, tokens


def _value(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), tuple(v.stride()), str(v.dtype), v.requires_grad)
    if isinstance(v, (tuple, list)):
        return tuple(_value(x) for x in v)
    return repr(v)


@contextlib.contextmanager
def _fx_graphs(out: list):
    """Record every joint fx graph capture exports, as (path, node signatures)."""
    orig = tc.export_joint

    def wrapped(*a, **k):
        before = dict(tc.JOINT_PATHS)
        gm = orig(*a, **k)
        path = "fast" if tc.JOINT_PATHS["fast"] > before["fast"] else "aot"
        rows = [(n.name, n.op, str(n.target), repr(n.args), repr(n.kwargs), str(n.meta.get("desc")),
                 _value(n.meta.get("val")), n.meta.get("partitioner_tag"), repr(n.meta.get("custom")))
                for n in gm.graph.nodes]
        out.append((path, rows))
        return gm

    tc.export_joint = wrapped
    try:
        yield
    finally:
        tc.export_joint = orig


def _both(model, args):
    """(path the fast setting took, fx rows fast, fx rows AOT, IR node tuples fast, AOT)."""
    res = {}
    saved = tc.FAST_JOINT
    try:
        for fast in (True, False):
            tc.FAST_JOINT = fast
            graphs: list = []
            with _fx_graphs(graphs):
                g = capture(model, args)
            ir = [(n.name, n.op, repr(n.args), repr(n.kwargs), tuple(map(str, n.inputs)), n.phase, n.module_path)
                  for n in g.nodes]
            res[fast] = (graphs[-1][0], graphs[-1][1], ir, {k: str(v) for k, v in g.grads.items()})
    finally:
        tc.FAST_JOINT = saved
    return res[True], res[False]


class _Ckpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        import torch.utils.checkpoint as cp

        return cp.checkpoint(lambda t: self.b(torch.nn.functional.gelu(self.a(t))), x, use_reentrant=False).sum()


class _Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.a.weight.requires_grad_(False)

    def forward(self, x):
        y = self.b(self.a(x)).view(2, 2, 8).transpose(0, 1).reshape(4, 8)
        u, v = y.chunk(2, dim=-1)
        return (u * v).sum()


CASES = {
    "gpt": lambda: make("gpt", size="tiny", batch=2),
    "llama": lambda: make("llama", size="tiny", batch=2),
    "mlp": lambda: make("mlp", size="tiny", batch=2),
    "moe": lambda: make("moe", size="tiny", batch=2),
    "gpt-bf16": lambda: make("gpt", size="tiny", batch=2, dtype=torch.bfloat16),
    "tied-gpt": lambda: (TinyGPT(), tokens()),
    "checkpoint": lambda: (_Ckpt(), (torch.randn(4, 8),)),
    "frozen-views": lambda: (_Frozen(), (torch.randn(4, 8),)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_pass_trace_equals_aot_export(case):
    model, args = CASES[case]()
    fast, aot = _both(model, tuple(args) if isinstance(args, (tuple, list)) else (args,))
    assert fast[0] == "fast", f"{case}: the one-pass trace did not apply"
    assert aot[0] == "aot"
    assert fast[1] == aot[1], f"{case}: the fx graphs differ"
    assert fast[2:] == aot[2:], f"{case}: the IR graphs differ"


def test_batch_norm_falls_back_to_aot_export():
    """Running-stat updates are mutations: only AOTAutograd's functionalized export handles them."""
    model, args = make("cnn", size="tiny", batch=2)
    fast, aot = _both(model, tuple(args))
    assert fast[0] == "aot"
    assert fast[1:] == aot[1:]
