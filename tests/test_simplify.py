"""``passes.lower.simplify.drop_identities``: ``detach``, ``alias`` and ``t(t(x))`` are replaced by their
input, and nothing else is touched; the program computes the same values."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn as nn

import autopar
from autopar.ir.capture import capture
from autopar.passes.lower import lower, resolve
from autopar.passes.lower.simplify import drop_identities

aten = torch.ops.aten


def _targets(g: fx.Graph) -> list:
    return [n.target for n in g.nodes if n.op == "call_function"]


def _run(g: fx.Graph, *args):
    return fx.GraphModule(torch.nn.Module(), g)(*args)


def test_identities_are_dropped_and_values_kept():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    d = g.call_function(aten.detach.default, (x,))
    a = g.call_function(aten.alias.default, (d,))  # a chain of identities
    tt = g.call_function(aten.t.default, (g.call_function(aten.t.default, (w,)),))
    y = g.call_function(aten.mm.default, (a, tt))
    g.output(y)
    before = copy.deepcopy(g)
    assert drop_identities(g) == 4  # detach, alias, and both transposes
    g.lint()
    assert _targets(g) == [aten.mm.default]
    (mm,) = [n for n in g.nodes if n.op == "call_function"]
    assert [a.name for a in mm.args] == ["x", "w"]
    torch.manual_seed(0)
    xs = (torch.randn(3, 4), torch.randn(4, 5))
    assert torch.equal(_run(g, *xs), _run(before, *xs))


def test_inner_transpose_with_other_users_is_kept():
    g = fx.Graph()
    w = g.placeholder("w")
    t1 = g.call_function(aten.t.default, (w,))
    t2 = g.call_function(aten.t.default, (t1,))
    g.output((g.call_function(aten.add.Tensor, (t2, w)), t1))
    before = copy.deepcopy(g)
    assert drop_identities(g) == 1  # only the outer transpose: ``t1`` is also an output
    g.lint()
    assert _targets(g) == [aten.t.default, aten.add.Tensor]
    add = next(n for n in g.nodes if n.target is aten.add.Tensor)
    assert add.args == (g.find_nodes(op="placeholder")[0],) * 2
    w_ = torch.randn(3, 4)
    for a, b in zip(_run(g, w_), _run(before, w_)):
        assert torch.equal(a, b)


def test_ops_that_are_not_identities_are_kept():
    g = fx.Graph()
    x = g.placeholder("x")
    t = g.call_function(aten.t.default, (x,))  # one transpose: not an identity
    tr = g.call_function(aten.transpose.int, (t, 0, 1))  # a transpose, but not ``t``: left alone
    c = g.call_function(aten.clone.default, (tr,))  # a copy: may be written to
    v = g.call_function(aten.view.default, (c, [-1]))
    neg = g.call_function(aten.neg.default, (x,))
    tn = g.call_function(aten.t.default, (g.call_function(aten.t.default, (neg,)),))
    g.output((v, tn))
    assert drop_identities(g) == 2  # only t(t(neg))
    assert _targets(g) == [aten.t.default, aten.transpose.int, aten.clone.default, aten.view.default,
                           aten.neg.default]
    assert drop_identities(g) == 0  # nothing left to drop


def test_lowered_programs_hold_no_identities():
    """The lowering runs the pass: the programs it returns keep no ``detach``/``alias`` (the
    captured joint graph of this model has some: values saved for the backward) and no t(t(x))."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    args = (torch.randn(16, 8),)

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x).square().mean()

    m = Wrapped()
    graph = capture(m, args)
    assert "aten.detach.default" in [n.op for n in graph.nodes]
    plan = autopar.recipes.ddp(m, autopar.Mesh({"dp": 2}, device="cpu"), args)
    prog = lower(resolve(graph, plan), (0,))
    for gm in (prog.forward, prog.backward):
        for n in gm.graph.nodes:
            assert n.target not in (aten.detach.default, aten.alias.default), n.name
            if n.target is aten.t.default and isinstance(n.args[0], fx.Node):
                assert n.args[0].target is not aten.t.default, n.name
