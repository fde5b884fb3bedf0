"""``cost_model.fusion``: a compiled program's pointwise chains are priced as fused kernels."""

from __future__ import annotations

import torch

import autopar
from autopar.cost_model.fusion import fused_ops
from autopar.ir.capture import capture
from autopar.models import make


class _Chain(torch.nn.Module):
    """A matmul, a chain of three pointwise ops (through a view), and a matmul reading the chain."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64, bias=False)
        self.b = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        h = self.a(x)
        h = (torch.tanh(h) * 2.0 + 1.0).view(-1, 64)
        return self.b(h).sum()


def test_pointwise_chain_fuses_and_saved_values_do_not():
    graph = capture(_Chain(), (torch.randn(8, 64),))
    fused = fused_ops(graph)
    fwd = [n for n in graph.ops() if n.phase.value == "forward"]
    ops = {n.name: n.op for n in fwd}
    tanh = next(n for n, op in ops.items() if op == "aten.tanh.default")
    mul = next(n for n, op in ops.items() if op == "aten.mul.Tensor")
    add = next(n for n, op in ops.items() if op == "aten.add.Tensor")
    # tanh is saved for its backward: written to memory, not kept in registers
    assert tanh not in fused or not fused[tanh].output
    # mul's result feeds only add: it stays in registers, and add reads it from there
    assert fused[mul].output and fused[add].inputs[0]
    # add feeds the second matmul (through a view): written out
    assert not fused[add].output
    assert all(graph.node(n).op not in ("aten.mm.default", "aten.t.default") for n in fused)


def test_compiled_prices_are_never_slower_and_faster_on_pointwise_work():
    model, inputs = make("gpt", "tiny", batch=8)
    graph = capture(model, inputs)
    mesh = autopar.Mesh({"dp": 2}, device="h100")
    eager = autopar.plan(model, mesh, inputs, graph=graph, recipe="ddp")
    compiled = autopar.plan(model, mesh, inputs, graph=graph, recipe="ddp", compiled=True)
    assert compiled.compute_time < eager.compute_time
    assert compiled.placements == eager.placements  # the recipe's layout; only the prices move
