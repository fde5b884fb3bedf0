"""``passes.lower.schedule``: every collective is issued as early as its inputs allow (a gather of a
parameter a layer ahead of its use, and no further) and waited for just before its first use;
the scheduled program computes what it computed before. Checked on a hand-built program, node by
node, and on the programs the lowering makes for an FSDP plan."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn as nn

import autopar
from autopar.ir.capture import capture
from autopar.ir.layers import layer_of
from autopar.passes.lower import lower, resolve
from autopar.passes.lower.schedule import schedule
from autopar.program import bucket
from autopar.program import collectives as C
from autopar.runtime.collectives import ThreadComm, ThreadMesh

aten = torch.ops.aten


# -- a hand-built program ------------------------------------------------------------------------

def _op(g: fx.Graph, target, args, module: str | None = None, **kwargs) -> fx.Node:
    n = g.call_function(target, args, kwargs)
    n.meta["autopar_module"] = module
    return n


def _hand_built() -> tuple[fx.Graph, dict[str, fx.Node]]:
    """Three numbered layers and a head, laid out as the lowering emits them: each collective
    right before its consumer and waited at once, with unrelated work between the wait and the
    use. Layer 2's weight is cast before its gather (mixed precision), and the head reshards in
    two chained steps."""
    g = fx.Graph()
    n: dict[str, fx.Node] = {}
    for name in ("w0", "w1", "w2", "x"):
        n[name] = g.placeholder(name)
    h = n["x"]
    for i in range(3):
        src = n[f"w{i}"]
        if i == 2:
            src = n["cast2"] = _op(g, aten._to_copy.default, (src,), dtype=torch.float64)
            src.meta["autopar_cast"] = True
        n[f"gather{i}"] = _op(g, C.all_gather, (src, 0, 0, 4))
        n[f"wait{i}"] = _op(g, C.wait, (n[f"gather{i}"],))
        n[f"sin{i}"] = _op(g, aten.sin.default, (h,), f"layers.{i}")  # does not need the weight
        w = n[f"wait{i}"]
        if i == 2:
            w = _op(g, aten._to_copy.default, (w,), f"layers.{i}", dtype=torch.float32)
        n[f"mm{i}"] = _op(g, aten.mm.default, (n[f"sin{i}"], w), f"layers.{i}.fc")
        h = n[f"relu{i}"] = _op(g, aten.relu.default, (n[f"mm{i}"],), f"layers.{i}")
    n["cos"] = _op(g, aten.cos.default, (n["x"],), "head")
    n["reduce"] = _op(g, C.all_reduce, (h, 0, "sum"))  # reads a computed value, emitted late
    n["wait_reduce"] = _op(g, C.wait, (n["reduce"],))
    n["gather_out"] = _op(g, C.all_gather, (n["wait_reduce"], 0, 0, 4))  # the next step of one reshard
    n["wait_out"] = _op(g, C.wait, (n["gather_out"],))
    n["neg"] = _op(g, aten.neg.default, (n["cos"],), "head")
    n["add"] = _op(g, aten.add.Tensor, (n["wait_out"], n["neg"]), "head")
    g.output(n["add"])
    return g, n


def _run(g: fx.Graph, *args):
    """Run ``g`` on a one-device mesh (every collective is the identity there)."""
    gm = fx.GraphModule(torch.nn.Module(), g)
    with C.use_backend(ThreadComm(ThreadMesh((1,), ["a"]), (0,))):
        return gm(*args)


def test_hand_built_program_is_scheduled_as_documented():
    g, n = _hand_built()
    before = copy.deepcopy(g)
    schedule(g)
    g.lint()  # still in topological order
    order = list(g.nodes)
    pos = {node: i for i, node in enumerate(order)}
    # a wait sits right before its first user
    for i in range(3):
        first_use = n["mm2"].args[1] if i == 2 else n[f"mm{i}"]
        assert n[f"wait{i}"].next is first_use, i
    assert n["wait_out"].next is n["add"]
    # a parameter's gather: issued before the layer ahead of its use starts, and no earlier
    # (layer 0's weight before layer 0, layer 1's before layer 0, layer 2's inside layer 0's span:
    # after layer 0's first op, before layer 1's first op)
    start = {i: pos[n[f"sin{i}"]] for i in range(3)}
    assert pos[n["gather0"]] < start[0] and pos[n["gather1"]] < start[0]
    assert start[0] < pos[n["gather2"]] < start[1]
    # the cast made for that gather alone moves with it, right before it
    assert n["cast2"].next is n["gather2"]
    # a collective of a computed value: right after its producer, before the head's unrelated work
    assert n["relu2"].next is n["reduce"]
    # a chain of one resharding stays together: the first step's wait right after it, the next
    # step right after that wait, its own wait deferred to the use
    assert n["reduce"].next is n["wait_reduce"] and n["wait_reduce"].next is n["gather_out"]
    assert pos[n["gather_out"]] < pos[n["cos"]] < pos[n["neg"]] < pos[n["wait_out"]]
    # the same nodes, and the same result
    assert sorted(x.name for x in before.nodes) == sorted(x.name for x in g.nodes)
    torch.manual_seed(0)
    ws = [torch.randn(4, 4) for _ in range(3)]
    x = torch.randn(4, 4)
    torch.testing.assert_close(_run(g, *ws, x), _run(before, *ws, x), rtol=0, atol=0)


def test_schedule_is_idempotent():
    g, _ = _hand_built()
    schedule(g)
    once = [x.name for x in g.nodes]
    schedule(g)
    assert [x.name for x in g.nodes] == once


# -- the lowering's programs -----------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Stack(nn.Module):
    """Identical blocks in a ``ModuleList``: module paths ``layers.<i>.fc``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x ** 2).mean()


class Loss(nn.Module):
    def forward(self, x):
        return (x ** 2).mean()


def _fsdp_programs(model: nn.Module) -> list[fx.GraphModule]:
    """The forward and backward programs of rank 0 under FSDP on 2 devices. The batch (512) is
    far larger than the 32-wide weights, so gathering the weights is the cheap plan."""
    torch.manual_seed(0)
    args = (torch.randn(512, 32),)
    plan = autopar.recipes.fsdp(model, autopar.Mesh({"dp": 2}, device="cpu"), args)
    assert all(pl == "S(0)" for fqn, pl in plan.placements.items() if "fc." in fqn), plan.placements
    prog = lower(resolve(capture(model, args), plan), (0,))
    return [prog.forward, prog.backward]


def _is_comm(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target is C.wait or node.target in C.COLLECTIVES
                                           or bool(node.meta.get("autopar_cast")))


def _is_view_of_input(node: fx.Node) -> bool:
    """A transpose of a program input (a weight's shard before its gather): no kernel runs, and
    ``schedule`` hoists it above the layers."""
    return (node.op == "call_function" and node.target is aten.t.default
            and all(a.op == "placeholder" for a in node.all_input_nodes))


def _is_compute(node: fx.Node) -> bool:
    return (node.op in ("call_function", "call_method", "call_module") and not _is_comm(node)
            and not _is_view_of_input(node))


def _check_waits_late(gm: fx.GraphModule) -> int:
    """No compute runs between a wait and its first user; returns how many waits were checked."""
    order = list(gm.graph.nodes)
    pos = {node: i for i, node in enumerate(order)}
    checked = 0
    for w in order:
        if w.op != "call_function" or w.target is not C.wait or not w.users:
            continue
        first = min(w.users, key=pos.get)
        between = order[pos[w] + 1:pos[first]]
        assert not [b.name for b in between if _is_compute(b)], (w.name, first.name)
        checked += 1
    return checked


def _gather_layers(gm: fx.GraphModule, transposed: bool = False) -> list[tuple[fx.Node, int]]:
    """Each gather of a placeholder (through a cast or not; with ``transposed``, also of a
    placeholder's ``t``), with the program-order index of the layer (as ``fold`` finds layers) of
    its wait's first user."""
    order = list(gm.graph.nodes)
    pos = {node: i for i, node in enumerate(order)}
    layers: list = []
    for node in order:
        key = layer_of(node.meta.get("autopar_module") or "") if _is_compute(node) else None
        if key is not None and key not in layers:
            layers.append(key)
    out = []
    for c in order:
        if c.op != "call_function" or c.target is not C.all_gather:
            continue
        grouped = c.args[0].op == "call_function" and c.args[0].target is bucket.pack_shards
        if not all(_param_source(x, transposed or grouped).op == "placeholder"
                   for x in (c.args[0].args[0] if grouped else [c.args[0]])):
            continue
        (w,) = c.users
        first = min(w.users, key=pos.get)
        if grouped:  # a layer's gathers in one: the first use of any member (taken out by getitem)
            (cut,) = w.users
            assert cut.target is bucket.cut_gathered
            first = min((u for item in cut.users for u in item.users), key=pos.get)
        key = layer_of(first.meta.get("autopar_module") or "")
        if key is not None:
            out.append((c, layers.index(key)))
    return out


def _param_source(src: fx.Node, transposed: bool) -> fx.Node:
    """What a gather reads, past its cast (and with ``transposed``, a transpose)."""
    if src.meta.get("autopar_cast"):
        src = src.args[0]
    if transposed and src.op == "call_function" and src.target is aten.t.default:
        src = src.args[0]
    return src


def _layer_spans(gm: fx.GraphModule) -> list[tuple[int, int]]:
    """(first, last) position of each numbered layer's compute, in program order."""
    spans: dict = {}
    for i, node in enumerate(gm.graph.nodes):
        key = layer_of(node.meta.get("autopar_module") or "") if _is_compute(node) else None
        if key is not None:
            lo, _ = spans.get(key, (i, i))
            spans[key] = (lo, i)
    return list(spans.values())


def _check_gathers_a_layer_ahead(gm: fx.GraphModule, transposed: bool = False) -> set[int]:
    """Each parameter gather whose weight is first used in layer k is issued before layer k-1
    starts and after layer k-2 ends; returns the layers checked."""
    pos = {node: i for i, node in enumerate(gm.graph.nodes)}
    spans = _layer_spans(gm)
    seen = set()
    for c, k in _gather_layers(gm, transposed):
        assert pos[c] < spans[max(k - 1, 0)][0], (c.name, k)
        if k >= 2:
            assert pos[c] > spans[k - 2][1], (c.name, k)
        seen.add(k)
    return seen


def test_fsdp_program_waits_at_first_use_and_gathers_a_layer_ahead():
    forward, backward = _fsdp_programs(Stack())
    # the forward gathers each layer's weight and bias together (one wait per layer), then the loss
    assert _check_waits_late(forward) >= 4 and _check_waits_late(backward) >= 2
    groups = [c for c in forward.graph.nodes if c.target is C.all_gather and c.args[0].target is bucket.pack_shards]
    assert [len(c.args[0].args[0]) for c in groups] == [2, 2, 2]
    # every layer's parameter gathers are checked in the forward (layers 0, 1, 2), and the
    # backward re-gathers the weights it saved sharded for layers 2 and 1 (program order 0, 1)
    assert _check_gathers_a_layer_ahead(forward) == {0, 1, 2}
    assert _check_gathers_a_layer_ahead(backward) >= {0, 1}


def test_fsdp_program_of_a_root_sequential_gathers_a_layer_ahead():
    """A root-level ``nn.Sequential`` (module paths ``0.fc``): ``schedule`` finds its layers by
    ``ir.layers``, the rule ``fold`` uses (its own pattern had needed a dot before the index, found
    no layer, and issued every parameter gather at the top of the program)."""
    forward, backward = _fsdp_programs(nn.Sequential(Block(), Block(), Block(), Loss()))
    assert _check_waits_late(forward) >= 4
    assert _check_gathers_a_layer_ahead(forward) == {0, 1, 2}
    # the loss is layer "3" here, first in the backward's program order: the weights re-gathered
    # for blocks 2 and 1 are the backward's layers 1 and 2
    assert _check_gathers_a_layer_ahead(backward) >= {1, 2}


def test_fsdp_forward_gathers_transposed_weights_a_layer_ahead():
    """The lowering gathers ``t(weight shard)`` (the transpose is local, then the gather): the
    transpose moves up with its gather (``schedule`` had issued the gather right after the ``t``,
    inside the layer that uses it, and waited at once: no overlap with the previous layer)."""
    forward, _ = _fsdp_programs(Stack())
    assert _check_gathers_a_layer_ahead(forward, transposed=True) == {0, 1, 2}


def test_fsdp_gradient_reduce_scatters_start_under_the_next_layers_backward():
    """Each layer's bucketed gradient reduce-scatter is issued before the next layer's backward
    starts (its buffer packed once the layer's last gradient is made: ``grads.pack_when_ready``),
    not after the backward's last op, and waited for only at the end: the overlap the cost model
    prices."""
    _, backward = _fsdp_programs(Stack())
    pos = {node: i for i, node in enumerate(backward.graph.nodes)}
    spans = _layer_spans(backward)
    scatters = [n for n in backward.graph.nodes if n.target is C.reduce_scatter]
    assert len(scatters) == len(spans) == 3
    for k, rs in enumerate(scatters[:-1]):
        assert pos[rs] < spans[k + 1][0], (rs.name, k)
    waits = [u for rs in scatters for u in rs.users if u.target is C.wait]
    assert waits and all(pos[w] > spans[-1][1] for w in waits)
