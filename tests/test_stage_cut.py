"""The stage cut (``passes/lower/stages.py``) on a hand-built lowered program, and the IR-level cut
(``ir.stages.cut_graph``) on a captured model, without processes.

The program is written here as the tagged lowering writes one (``passes.lower.tagged``): a forward
and a backward fx graph of aten ops, each node marked with the IR op it was written for
(``program.staged.IR_TAG``), the loss's placement and the gradients' finishing ops left unmarked.
Three stages, one matmul each (``op0``, ``op1``, ``op2``); the last stage's matmul reads the first
stage's weight again (a tied embedding and head), so that weight's two gradient contributions are
summed once per step; every gradient is scaled by an unmarked op (as a gradient reduction is).

The tests check where every op goes (each stage's forward and backward hold their own op and nothing
of the others'), what crosses each boundary and what each backward reads of its forward, the static
part, the per-step part and which of its gradients a rank's stages make, and that running the cut
stage by stage (GPipe's order, two micro-batches summed) computes the uncut program's loss and
gradients.

A broken cut fails them. Checked by hand on this file, one mutation of ``passes/lower/stages.py`` at a
time: a boundary dropped (``_crossings`` sending only values made strictly before the stage,
``stage.get(n, n_stages) < s`` for ``<= s``) and a node mis-assigned (``_assign_stages`` putting every
unmarked node in stage 0, ``stage[n] = 0`` for ``max(ins, default=0)``: the loss) fail all six tests
(the cut loses ``h0``, resp. ``h3``); the tied weight's sum left out of the per-step part
(``step_part = reductions | below``) fails the three structural tests (its head contribution is then
sent back through two boundaries). The last test cuts a captured two-layer LLaMA's forward with
``ir.stages.cut_graph``, the IR-level cut the pipeline axis alone runs; with its boundaries left empty
(and its refusal of unsent gradient-carrying reads switched off) it fails.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.ir.graph import TensorSpec
from autopar.ir.placement import B
from autopar.passes.lower.stages import cut, dry_run
from autopar.program.program import Program, Slot
from autopar.program.staged import IR_TAG, SHAPE, boundary_pairs

aten = torch.ops.aten
ROWS, WIDTH = 2, 4


def _op(graph: fx.Graph, target, args: tuple, tag: str | None, name: str) -> fx.Node:
    """A node of ``graph`` named ``name``, marked as written for IR op ``tag`` (None: unmarked)."""
    node = graph.create_node("call_function", target, args, name=name)
    if tag is not None:
        node.meta[IR_TAG] = tag
    return node


def _program() -> Program:
    """The three-stage program of the module docstring: ``x @ w0 @ w1 @ w2 @ w0``, summed."""
    fwd = fx.Graph()
    x, w0, w1, w2 = (fwd.placeholder(n) for n in ("x", "w0", "w1", "w2"))
    h0 = _op(fwd, aten.mm.default, (x, w0), "op0", "h0")
    h1 = _op(fwd, aten.mm.default, (h0, w1), "op1", "h1")
    h2 = _op(fwd, aten.mm.default, (h1, w2), "op2", "h2")
    h3 = _op(fwd, aten.mm.default, (h2, w0), "op2", "h3")  # the tied head, in the last stage
    loss = _op(fwd, aten.sum.default, (h3,), None, "loss")  # the loss's placement: unmarked
    fwd.output((loss, x, h0, h1, h2, w0, w1, w2))
    bwd = fx.Graph()
    sx, s0, s1, s2, sw0, sw1, sw2 = (bwd.placeholder(f"saved_{n}") for n in ("x", "h0", "h1", "h2", "w0", "w1", "w2"))
    tangent = bwd.placeholder("tangent")

    def mm(a, b, op, name):
        return _op(bwd, aten.mm.default, (a, b), op, name)

    def t(a, op):
        return _op(bwd, aten.t.default, (a,), op, f"t_{a.name}")

    g3 = _op(bwd, aten.expand.default, (tangent, [ROWS, WIDTH]), "op2", "g_h3")
    g_head = mm(t(s2, "op2"), g3, "op2", "g_w0_head")  # w0's contribution from the head
    g2 = mm(g3, t(sw0, "op2"), "op2", "g_h2")
    g_w2 = mm(t(s1, "op2"), g2, "op2", "g_w2")
    g1 = mm(g2, t(sw2, "op2"), "op2", "g_h1")
    g_w1 = mm(t(s0, "op1"), g1, "op1", "g_w1")
    g0 = mm(g1, t(sw1, "op1"), "op1", "g_h0")
    g_emb = mm(t(sx, "op0"), g0, "op0", "g_w0_embedding")  # w0's contribution from the first stage
    g_w0 = _op(bwd, aten.add.Tensor, (g_emb, g_head), "op0", "g_w0")
    # finishing the gradients (a reduction would be a collective here): unmarked
    grads = [_op(bwd, aten.mul.Tensor, (g, 0.5), None, f"finish_{g.name}") for g in (g_w0, g_w1, g_w2)]
    bwd.output(tuple(grads))
    spec = TensorSpec((WIDTH, WIDTH), torch.float32)

    def slot(kind, key, shape=(WIDTH, WIDTH)):
        return Slot(kind, key, (B,), TensorSpec(shape, torch.float32))

    return Program(coords=(0,), mesh_shape=(1,), axis_names=("dp",),
                   forward=fx.GraphModule(torch.nn.Module(), fwd),
                   inputs=[slot("input", "input:0", (ROWS, WIDTH)), slot("param", "w0"), slot("param", "w1"),
                           slot("param", "w2")],
                   outputs=[Slot("loss", "0", (B,), TensorSpec((), torch.float32))], n_saved=7,
                   backward=fx.GraphModule(torch.nn.Module(), bwd),
                   grads=[Slot("grad", k, (B,), spec) for k in ("w0", "w1", "w2")])


def _values(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(ROWS, WIDTH, generator=g)] + [torch.randn(WIDTH, WIDTH, generator=g) for _ in range(3)]


def _stage_of(op: str) -> int:
    return {"op0": 0, "op1": 1, "op2": 2}[op]


def _cut(local=(0, 1, 2), split: bool = False):
    program = _program()
    dry_run(program, _values())
    return program, cut(program, _stage_of, 3, list(local), split=split)


def _tags(gm: fx.GraphModule) -> set:
    return {n.meta.get(IR_TAG) for n in gm.graph.nodes if n.op == "call_function"}


def _names(nodes) -> list[str]:
    return [n.name for n in nodes]


def test_each_stage_holds_its_own_ops():
    _, c = _cut()
    assert [st.index for st in c.stages] == [0, 1, 2]
    # each forward runs its own op; the unmarked loss goes with what it reads (the last stage)
    assert [_tags(st.forward) for st in c.stages] == [{"op0"}, {"op1"}, {"op2", None}]
    assert [_names(n for n in st.forward.graph.nodes if n.op == "call_function") for st in c.stages] == [
        ["h0"], ["h1"], ["h2", "h3", "loss"]]
    # each backward runs its own op's gradients; the transposes of the weights are static (once per step)
    assert [_tags(st.backward) for st in c.stages] == [{"op0"}, {"op1"}, {"op2"}]
    made = [set(_names(n for n in st.backward.graph.nodes if n.op == "call_function")) for st in c.stages]
    assert made == [{"t_saved_x", "g_w0_embedding"}, {"t_saved_h0", "g_w1", "g_h0"},
                    {"g_h3", "t_saved_h2", "g_w0_head", "g_h2", "t_saved_h1", "g_w2", "g_h1"}]
    assert [st.tangent for st in c.stages] == [False, False, True]  # only the last stage reads the loss's gradient


def test_boundaries_and_stashes():
    _, c = _cut()
    s0, s1, s2 = c.stages
    assert _names(s0.f_in) == [] and _names(s0.f_out) == ["h0"]
    assert _names(s1.f_in) == ["h0"] and _names(s1.f_out) == ["h1"]
    assert _names(s2.f_in) == ["h1"] and _names(s2.f_out) == ["loss"]  # the loss leaves the last stage
    # the gradients go back the same way, each in the slot of the activation of its local shape
    assert _names(s2.g_in) == [] and _names(s2.g_out) == ["g_h1"]
    assert _names(s1.g_in) == ["g_h1"] and _names(s1.g_out) == ["g_h0"]
    assert _names(s0.g_in) == ["g_h0"] and _names(s0.g_out) == []
    assert boundary_pairs(s0.f_out, s0.g_in, "0 -> 1") == [0] and boundary_pairs(s1.f_out, s1.g_in, "1 -> 2") == [0]
    assert [n.meta[SHAPE] for n in s0.f_out + s1.f_out] == [((ROWS, WIDTH), torch.float32)] * 2
    # what each backward reads of its own forward (the input x is stage 0's to keep)
    assert [_names(st.stash) for st in c.stages] == [["x"], ["h0"], ["h2", "h1"]]  # in the backward's reading order
    # the inputs: only the first stage reads the batch
    assert [st.f_given for st in c.stages] == [[0], [], []]


def test_static_and_per_step_parts():
    _, c = _cut()
    # w0..w2 feed the static program (their transposes for the backwards); the batch does not
    assert c.state_slots == [1, 2, 3]
    # the frontier: per stage the unreduced gradients it makes; w0's two contributions come from stages 0 and 2
    assert sorted(c.frontier_stage) == [0, 1, 2, 2]
    assert all(shape == ((WIDTH, WIDTH), torch.float32) for shape in c.frontier_shapes)
    assert sorted(f for st in c.stages for f in st.frontier) == [0, 1, 2, 3]
    # the per-step part: the tied weight's sum and the finishing ops, once per step
    ops = [n.target for n in c.reduce.gm.graph.nodes if n.op == "call_function"]
    assert ops.count(aten.add.Tensor) == 1 and ops.count(aten.mul.Tensor) == 3
    assert c.reduce.kept == [0, 1, 2]


def test_a_rank_reduces_only_its_stages_gradients():
    _, middle = _cut(local=[1])
    assert middle.reduce.kept == [1]  # w1's; w0's (stages 0 and 2) and w2's are other ranks'
    _, ends = _cut(local=[0, 2])
    assert ends.reduce.kept == [0, 2]
    # the static program computes only what the local stages read
    assert middle.n_static < ends.n_static


def _run_uncut(program: Program, values: list) -> tuple[torch.Tensor, list]:
    outs = program.forward(*values)
    grads = program.backward(*outs[1:], torch.ones(()))
    return outs[0], list(grads)


def _run_cut(c, values_per_micro: list[list]) -> tuple[torch.Tensor, list]:
    """Every micro-batch through the stages in GPipe's order, the unreduced gradients summed, the
    per-step part once (as ``runtime.pipeline.simulate`` runs a device's cut)."""
    statics = list(c.static(*[values_per_micro[0][k] for k in c.state_slots]))
    acc = [torch.zeros(s, dtype=d) for s, d in c.frontier_shapes]
    losses, stash = [], {}
    for i, values in enumerate(values_per_micro):
        carry: list = []
        for st in c.stages:
            outs = list(st.forward(*[statics[k] for k in st.f_statics], *[values[k] for k in st.f_given], *carry))
            carry, stash[(st.index, i)] = outs[:len(st.f_out)], outs[len(st.f_out):]
        losses.append(carry[0])
    for i in range(len(values_per_micro)):
        back: list = []
        for st in reversed(c.stages):
            tangent = [torch.ones(())] if st.tangent else []
            ins = stash[(st.index, i)] + [statics[k] for k in st.b_statics] + back + tangent
            if st.backward_input is not None:
                outs = list(st.backward_input(*ins))
                made = list(st.backward_weight(*ins, *outs[len(st.g_out):]))
            else:
                outs = list(st.backward(*ins))
                made = outs[len(st.g_out):]
            back = outs[:len(st.g_out)]
            for fid, v in zip(st.frontier, made):
                acc[fid] += v
    return sum(losses), list(c.reduce(*acc))


def test_the_cut_computes_what_the_program_computes():
    for split in (False, True):  # the backward whole, and in its input- and weight-gradient parts (zero bubble)
        program, c = _cut(split=split)
        a, b = _values(1), _values(2)
        b[1:] = a[1:]  # two micro-batches of one model
        loss, grads = _run_cut(c, [a, b])
        want = [_run_uncut(program, v) for v in (a, b)]
        assert torch.allclose(loss, want[0][0] + want[1][0])
        for k in range(3):
            assert torch.allclose(grads[k], want[0][1][k] + want[1][1][k], rtol=1e-5, atol=1e-5), k


def test_the_cut_matches_autograd():
    program, c = _cut()
    x, w0, w1, w2 = (v.clone().requires_grad_(k > 0) for k, v in enumerate(_values(3)))
    ((x @ w0 @ w1 @ w2 @ w0).sum()).backward()
    loss, grads = _run_cut(c, [[x.detach(), w0.detach(), w1.detach(), w2.detach()]])
    assert torch.allclose(loss, (x @ w0 @ w1 @ w2 @ w0).sum())
    for got, w in zip(grads, (w0, w1, w2)):
        assert torch.allclose(got, 0.5 * w.grad, rtol=1e-5, atol=1e-5)


def test_the_graph_cut_of_a_captured_model():
    """``ir.stages.cut_graph`` (the pipeline axis alone runs it eagerly) on a captured two-layer LLaMA:
    each op in its stage, the hidden state the one value sent across, the gradient-free values (the
    RoPE tables) made again in the stage that reads them instead of sent."""
    from autopar import models
    from autopar.ir.capture import capture
    from autopar.ir.stages import chain, cut_graph, stage_rule

    torch.manual_seed(0)
    model, inputs = models.make("llama", "tiny", batch=2, n_layers=2)
    graph = capture(model, inputs, {}, training=False)
    first, second = chain(graph).paths
    stage_of = stage_rule(graph, [[first], [second]])
    trainable = {name for fqn, name in graph.params.items() if model.get_parameter(fqn).requires_grad}
    got = cut_graph(graph, stage_of, 2, trainable)
    ops = [n for n in graph.nodes if not n.is_placeholder]
    assert got.home == {n.name: stage_of(n.name) for n in ops} and set(got.home.values()) == {0, 1}
    for s in (0, 1):
        assert {name for name, at in got.home.items() if at == s} <= got.runs[s]
    assert len(got.boundaries) == 1
    (sent,) = got.boundaries[0]  # the residual stream, made in stage 0
    assert got.home[sent.node] == 0 and graph.spec(sent).dtype.is_floating_point
    # stage 1 makes some of stage 0's values again: none has a trainable parameter upstream
    again = {name for name in got.runs[1] if got.home.get(name) == 0}
    assert again and sent.node not in again
    by_name = {n.name: n for n in graph.nodes}
    todo, seen = list(again), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [r.node for r in by_name[name].inputs]
    assert not seen & trainable
