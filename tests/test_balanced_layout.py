"""The load-balanced split ``Z(d)`` (``ir.placement.Balanced``): its geometry, the ops that take it
(proven by execution on real graphs) and those that refuse it, its conversions to and from every
other placement as lowered and run on simulated devices (against their priced steps), the causal
search choosing it, and plan files that name it."""

from __future__ import annotations

import json
import types
import warnings

import pytest
import torch
import torch.fx as fx

import autopar
from autopar.cost_model.balanced import balanced_steps, lowering_steps
from autopar.cost_model.comm import LOCAL_KINDS, reshard_time
from autopar.errors import PlacementError, PlanError
from autopar.ir.placement import (B, Balanced, P, S, balanced_fits, format_placements, local_block, parse, parse_one,
                                  to_dtensor, zigzag)
from autopar.ir.rules import strategies
from autopar.ir.rules.base import OpCall
from autopar.ir.graph import Ref, TensorSpec
from autopar.passes.lower.reshard import reshard_balanced
from autopar.runtime.threads import run_threads

Z = Balanced


def test_each_device_holds_a_front_chunk_and_its_mirror():
    t = torch.arange(16).reshape(1, 16)
    blocks = [local_block(t, (Z(1),), (4,), (r,)).tolist()[0] for r in range(4)]
    assert blocks == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    # causal work (keys at or before each query) is equal on every device
    assert len({sum(q + 1 for q in b) for b in blocks}) == 1
    assert torch.equal(zigzag(zigzag(t, 1, 4), 1, 4, inverse=True), t)
    # on (2, 2): nested under the other axis's split of another dim
    u = torch.arange(32).reshape(2, 16)
    assert local_block(u, (S(0), Z(1)), (2, 2), (1, 1)).tolist() == [[20, 21, 22, 23, 24, 25, 26, 27]]


def test_z_is_a_placement_of_its_own():
    assert str(Z(2)) == "Z(2)" and parse_one("Z(2)") == Z(2) and parse("cp=Z(1)", axis_names=["dp", "cp"]) == (B, Z(1))
    assert Z(1) != S(1) and isinstance(Z(1), S)  # a split as shapes and volumes see it, not the same split
    assert parse(format_placements((S(0), Z(1)))) == (S(0), Z(1))
    assert balanced_fits((2, 16), (Z(1),), (4,)) and not balanced_fits((2, 12), (Z(1),), (4,))
    assert not balanced_fits((2, 16), (S(1), Z(1)), (2, 2))  # one axis only
    with pytest.raises(PlacementError, match="no DTensor placement"):
        to_dtensor((Z(1),))
    with pytest.raises(PlacementError, match="2n equal chunks"):
        local_block(torch.zeros(2, 12), (Z(1),), (4,), (0,))


# ---------------------------------------------------------------------------------------------
# Which ops take it: proven on real graphs


def _graph_cases(name: str):
    from autopar.ir.capture import capture
    from autopar.ir.rules.proof.check import cases, dedupe, record_values

    torch.manual_seed(0)
    if name == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=24, intermediate_size=20, num_hidden_layers=1, num_attention_heads=3,
                          num_key_value_heads=1, vocab_size=29, attention_dropout=0.0)
        model, args = LlamaForCausalLM(cfg).double(), ()
        ids = torch.randint(0, 29, (6, 12))
        kwargs = {"input_ids": ids, "labels": ids}
    else:
        from autopar.models import make

        model, args = make(name, "tiny", batch=6, seq=12, dtype=torch.float64)
        kwargs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(model, args, kwargs)
        values = record_values(graph, model, args, kwargs)
    return dedupe(cases(graph, values))


@pytest.mark.parametrize("name", ["llama", "gpt", "hf-llama"])
def test_ops_that_take_the_balanced_layout_are_proven_by_execution(name):
    """Every strategy with a ``Z`` of every op of the graph (12 tokens: balanced on 2 and 3
    devices, and beside a batch or head split on another axis) reassembles to the op on whole tensors."""
    from autopar.ir.rules.proof.interp import check_strategy
    from autopar.ir.rules.ring import balanced_lengths

    cs = _graph_cases(name)
    lengths = balanced_lengths(c.call for c in cs)
    assert lengths == (12,)
    ops = set()
    for mesh in [(2,), (3,), (2, 2)]:
        for case in cs:
            for st in strategies(case.call, mesh, balanced=lengths):
                if any(isinstance(p, Z) for sig in st for p in sig.inputs + sig.outputs) and _fits(case.call, st, mesh):
                    res = check_strategy(case.call, st, mesh, case.inputs, case.expected)
                    assert res.ok, f"{case.call.op} {[str(s) for s in st]}: {res.error}"
                    ops.add(case.call.op)
    # the layout runs through the embedding, norms, views, elementwise ops and the attention (the
    # matmuls here see batch and sequence merged into one dim: neither S nor Z of the sequence alone)
    assert {"aten.embedding.default", "aten.embedding_dense_backward.default", "aten.add.Tensor",
            "aten.view.default"} <= ops, ops
    assert any("attention" in op for op in ops)


def _fits(call: OpCall, st, mesh) -> bool:
    """No device's block is empty (as the search keeps strategies: ``passes.search.strategies.fits``)."""
    from autopar.passes.search.strategies import fits

    return (all(fits(s.shape, [sig.inputs[i] for sig in st], mesh) for i, s in enumerate(call.in_specs))
            and all(s is None or fits(s.shape, [sig.outputs[j] for sig in st], mesh) for j, s in enumerate(call.out_specs)))


def _call(op, target, args, in_shapes, out_shapes, kwargs=None):
    return OpCall(op, target, args, kwargs or {}, [TensorSpec(s, torch.float32) for s in in_shapes],
                  [TensorSpec(s, torch.float32) for s in out_shapes])


def test_ops_that_read_positions_refuse_it():
    """Slicing, concatenation, shifts, scans and index ops along the sequence never take ``Z``."""
    aten = torch.ops.aten
    x = Ref("x")
    calls = [
        _call("aten.slice.Tensor", aten.slice.Tensor, (x, 1, 0, 8), [(2, 16, 4)], [(2, 8, 4)]),
        _call("aten.slice.Tensor", aten.slice.Tensor, (x, 1, 4, 16), [(2, 16, 4)], [(2, 12, 4)]),
        _call("aten.index_select.default", aten.index_select.default, (x, 1, Ref("i")), [(2, 16, 4), (16,)],
              [(2, 16, 4)]),
        _call("aten.cat.default", aten.cat.default, ([x, Ref("y")], 1), [(2, 16, 4), (2, 16, 4)], [(2, 32, 4)]),
        _call("aten.cumsum.default", aten.cumsum.default, (x, 1), [(2, 16, 4)], [(2, 16, 4)]),
        _call("aten.roll.default", aten.roll.default, (x, [1], [1]), [(2, 16, 4)], [(2, 16, 4)]),
        _call("aten.arange.start", aten.arange.start, (0, 16), [], [(16,)]),
    ]
    for call in calls:
        for st in strategies(call, (4,), balanced=(16,)):
            assert not any(isinstance(p, Z) for sig in st for p in sig.inputs + sig.outputs), (call.op, st)
    add = _call("aten.add.Tensor", aten.add.Tensor, (x, Ref("y")), [(2, 16, 4), (2, 16, 4)], [(2, 16, 4)])
    whole = _call("aten.slice.Tensor", aten.slice.Tensor, (x, 1, 0, 16), [(2, 16, 4)], [(2, 16, 4)])  # the identity
    for call in (add, whole):
        assert any(isinstance(st[0].inputs[0], Z) and st[0].tag.startswith("Z:")
                   for st in strategies(call, (4,), balanced=(16,)))
    assert not any(isinstance(st[0].inputs[0], Z) for st in strategies(add, (4,)))  # only where offered


# ---------------------------------------------------------------------------------------------
# Conversions, lowered and run


def _run_reshard(shape, src, dst, axes):
    """Every device's block of a random tensor placed ``src``, resharded to ``dst`` by the lowering
    on simulated devices; returns (per-device results, executed collectives, whole tensor)."""
    mesh = autopar.Mesh(dict(axes), device="cpu")
    whole = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    spec = TensorSpec(tuple(shape), torch.float64)

    def fn(coords):
        em = types.SimpleNamespace(mesh_shape=mesh.shape, coords=coords, res=types.SimpleNamespace(mesh=mesh))
        g = fx.Graph()
        x = g.placeholder("x")
        g.output(reshard_balanced(em, x, spec, src, dst, 8, g))
        return fx.GraphModule(torch.nn.Module(), g)(local_block(whole, src, mesh.shape, coords))

    results, executed = run_threads(fn, mesh.shape, mesh.names)
    return results, executed, whole, mesh


PAIRS = [((S(1),), (Z(1),)), ((Z(1),), (S(1),)), ((B,), (Z(1),)), ((Z(1),), (B,)), ((P,), (Z(1),)),
         ((Z(1),), (S(0),)), ((S(0),), (Z(1),)), ((Z(1),), (P,))]
PAIRS_2D = [((S(0), S(1)), (S(0), Z(1))), ((S(0), Z(1)), (B, B)), ((B, Z(1)), (S(1), B)), ((P, Z(1)), (B, Z(1))),
            ((S(1), B), (B, Z(1))), ((B, P), (S(0), Z(1)))]


@pytest.mark.parametrize("src, dst, axes", [(s, d, (("cp", 4),)) for s, d in PAIRS]
                         + [(s, d, (("dp", 2), ("cp", 2))) for s, d in PAIRS_2D])
def test_conversions_run_as_priced(src, dst, axes):
    """Each device ends with its block of ``dst``; the collectives that ran are the priced steps
    (local steps run none), and a conversion to ``Z`` from a split costs no more than a gather."""
    shape = (4, 16, 3)
    results, executed, whole, mesh = _run_reshard(shape, src, dst, axes)
    if dst == (P,):  # partial: the addends sum to the whole
        assert torch.allclose(sum(results.values()), whole)
    else:
        for coords, got in results.items():
            assert torch.allclose(got, local_block(whole, dst, mesh.shape, coords)), (coords, src, dst)
    steps = [st for st, _ in lowering_steps(shape, src, dst, mesh, 8)]
    want = sorted((st.kind, mesh.names[st.axis], st.bytes) for st in steps if st.kind not in LOCAL_KINDS)
    for coords, records in executed.items():
        assert sorted((r.kind, r.axis, int(r.bytes)) for r in records) == want, (coords, records)
    assert balanced_steps(shape, src, dst, mesh, 8)[1] == pytest.approx(sum(st.time for st in steps))
    assert reshard_time(shape, src, dst, mesh, 8) == pytest.approx(sum(st.time for st in steps))


# ---------------------------------------------------------------------------------------------
# Chosen by the search; plan files


class CausalLM(torch.nn.Module):
    """A one-layer causal LM with 4 heads (too few to cover an 8-device axis): embedding, norm,
    causal attention, MLP, token loss."""

    def __init__(self, vocab: int = 1024, dim: int = 1024, heads: int = 4):
        super().__init__()
        self.emb, self.heads = torch.nn.Embedding(vocab, dim), heads
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.norm(x)).split(c, -1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        x = x + self.mlp(x)
        return torch.nn.functional.cross_entropy(self.head(x).reshape(-1, self.head.out_features), targets.reshape(-1))


def test_search_lays_a_long_causal_sequence_out_balanced():
    """64k causal tokens on 8 H100s, the sequence split: the search runs ring attention balanced,
    and the ops around it (norm, MLP, loss) hold the balanced layout too, where converting at
    every attention would cost more."""
    from autopar.ir.attention import ATTN_BWD, ATTN_FWD
    from autopar.ir.rules.ring import RING_BALANCED

    torch.manual_seed(0)
    with torch.device("meta"):
        model = CausalLM()
    idx = torch.zeros(1, 65536, dtype=torch.long, device="meta")
    plan = autopar.plan(model, autopar.Mesh({"cp": 8}, device="h100"), (idx, idx),
                        hints={"input:0": "cp=S(1)", "input:1": "cp=S(1)"}, deterministic_time=0.5, progress=False)
    tags = [n["tags"][0] for n in plan.nodes if n["op"] in (ATTN_FWD, ATTN_BWD)]
    assert tags == [RING_BALANCED, RING_BALANCED], tags
    balanced = [n["name"] for n in plan.nodes if any("Z(" in s for s in n["strategy"])]
    assert len(balanced) > 10, balanced


MESHES = {"cp4": (("cp", 4),), "dp2xcp2": (("dp", 2), ("cp", 2))}


def _family(name: str):
    """``(model, args, kwargs, tolerance)`` in float64 (Hugging Face's LLaMA keeps parts in fp32)."""
    if name.startswith("hf_"):
        from _corpus import FP32_INSIDE, build

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, args, kwargs = build(name, dtype=torch.float64)
        return model, tuple(args), kwargs, 1e-5 if name in FP32_INSIDE else 1e-10
    from autopar.models import make

    torch.manual_seed(0)
    model, args = make(name, "tiny", batch=2, seq=16, dtype=torch.float64)
    return model, args, {}, 1e-10


@pytest.mark.parametrize("name", ["llama", "gpt", "hf_llama"])
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_balanced_ring_matches_one_device_in_float64(name, mesh):
    """Balanced ring attention forced by ``attention=``, the inputs placed ``Z`` (``hints``): the
    loss and every gradient equal the one-device model's in float64; the layout reaches the ops
    around the attention, and the collectives that ran are the plan's (the ring's own shifts besides)."""
    from autopar.ir.attention import ATTN_BWD, ATTN_FWD
    from autopar.ir.rules.ring import RING_BALANCED
    from autopar.runtime.accounting import differences

    model, args, kwargs, tol = _family(name)
    hints = {k: "cp=Z(1)" for k in kwargs} if kwargs else {"input:0": "cp=Z(1)", "input:1": "cp=Z(1)"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, autopar.Mesh(dict(MESHES[mesh]), device="cpu"), args, kwargs or None,
                            hints=hints, attention={"cp": RING_BALANCED}, deterministic_time=0.5, progress=False)
    assert all(RING_BALANCED in n["tags"] for n in plan.nodes if n["op"] in (ATTN_FWD, ATTN_BWD))
    assert sum(any("Z(" in s for s in n["strategy"]) for n in plan.nodes) > 8
    trace: dict = {}
    loss, grads = autopar.simulate(model, plan, args, kwargs or None, trace=trace)
    out = model(*args, **kwargs)
    ref = out if isinstance(out, torch.Tensor) else out.loss
    ref.backward()
    loss = loss if isinstance(loss, torch.Tensor) else loss.loss
    assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert (grads[n] - p.grad).norm() <= tol * max(p.grad.norm(), 1e-30), n
    for records in trace.values():
        assert [d for d in differences(plan, records) if not d.startswith("permute on cp")] == []


def _balanced_plan():
    from autopar.ir.rules.ring import RING_BALANCED, forced_form
    from autopar.models import make

    model, args = make("llama", "tiny", batch=2, seq=16, dtype=torch.float64)
    with forced_form(RING_BALANCED), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, autopar.Mesh({"cp": 4}, device="cpu"), args, deterministic_time=0.5,
                            hints={"input:0": "cp=Z(1)", "input:1": "cp=Z(1)"}, progress=False)
    return model, args, plan


def test_plan_files_name_z_and_older_versions_load(tmp_path):
    """A plan with ``Z`` is schema version 10 and loads back to the same program (the inputs hinted
    ``Z`` arrive balanced, converted on the way in); a version 9 file without the balanced ring
    loads as before, and one with it (run then on plain splits) is refused naming its version."""
    from autopar.plans.schema import SCHEMA_VERSION, Plan, load_plan

    model, args, plan = _balanced_plan()
    text = plan.to_json()
    d = json.loads(text)
    assert d["schema_version"] == SCHEMA_VERSION == 10 and '"Z(1)"' in text
    assert d["placements"]["input:0"] == "Z(1)"
    again = Plan.from_dict(json.loads(text))
    assert again.to_json() == text
    loss, grads = autopar.simulate(model, again, args)
    ref = model(*args)
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-10)
    assert all(torch.allclose(grads[n], p.grad, rtol=1e-8, atol=1e-12) for n, p in model.named_parameters())
    old = dict(d, schema_version=9)
    with pytest.raises(PlanError, match="plan schema version 9 runs .* as ring:balanced attention on plain"):
        Plan.from_dict(old)
    plain = json.loads(text.replace("ring:balanced", "ring"))
    assert Plan.from_dict(dict(plain, schema_version=9)).schema_version in (9, 10)
    import pathlib

    for name in ("plan_v2_mlp_h100_dp4_tp4.json", "plan_v7_gpt_dropout_dp2_tp2.json"):
        assert load_plan(pathlib.Path(__file__).parent / "data" / name).nodes


def test_the_search_weighs_z_only_where_it_may_pay():
    """Outside ``offer_balanced`` no strategy the search weighs holds ``Z``, the balanced ring
    attention's included (it runs on contiguous blocks, permuting at its edges); inside it, the
    attention and the ops around it take ``Z`` and the edge form is gone; the lowering
    (``node_strategies``) finds every form either way. Non-causal graphs never have it."""
    from autopar.ir.capture import capture
    from autopar.ir.rules.ring import asks_balanced, edge_balanced, offer_balanced
    from autopar.models import make
    from autopar.passes.search.strategies import node_strategies, search_strategies

    def holding_z(strats):
        return sum(any(isinstance(p, Z) for sig in st for p in sig.inputs + sig.outputs) for st in strats)

    model, args = make("llama", "tiny", batch=2, seq=16)
    graph = capture(model, args)
    mesh = autopar.Mesh({"cp": 4}, device="cpu")
    ops = [n for n in graph.nodes if not n.is_placeholder and "attention" not in n.op]
    attn = [n for n in graph.nodes if "attention" in n.op]
    assert sum(holding_z(search_strategies(graph, n, mesh)) for n in ops) == 0
    assert sum(holding_z(search_strategies(graph, n, mesh)) for n in attn) == 0
    assert all(any(edge_balanced(st) for st in search_strategies(graph, n, mesh)) for n in attn)
    with offer_balanced(True):
        assert sum(holding_z(search_strategies(graph, n, mesh)) for n in ops) > 20
        assert all(holding_z(search_strategies(graph, n, mesh)) for n in attn)
        assert not any(edge_balanced(st) for n in attn for st in search_strategies(graph, n, mesh))
    assert all(any(edge_balanced(st) for st in node_strategies(graph, n, mesh)) for n in attn)
    assert sum(holding_z(node_strategies(graph, n, mesh)) for n in ops) > 20
    assert asks_balanced({"input:0": "cp=Z(1)"}, None) and asks_balanced(None, {"cp": "ring:balanced"})
    assert not asks_balanced({"input:0": "cp=S(1)"}, {"cp": "ring"})
    from test_ring_attention import Bidirectional

    enc = capture(Bidirectional(), (torch.zeros(2, 16, dtype=torch.long),) * 2)
    with offer_balanced(True):
        assert sum(holding_z(search_strategies(enc, n, mesh)) for n in enc.nodes if "attention" not in n.op) == 0


def test_a_search_offered_no_z_weighs_no_z_on_a_2_axis_mesh():
    """Outside ``offer_balanced`` (every plan whose attention does not run balanced ring), no
    strategy on a 2-axis mesh holds ``Z``, so such plans are those of the strategies without it;
    the balanced ring attention is weighed on contiguous blocks on each axis, its edge
    permutations priced with it above the same op laid out balanced."""
    from autopar.cost_model.precision import get_precision
    from autopar.cost_model.ring import ring_time
    from autopar.ir.attention import ATTN_FWD
    from autopar.ir.capture import capture
    from autopar.ir.rules import op_call
    from autopar.ir.rules.ring import RING_BALANCED, edge_balanced, ring_axis
    from autopar.models import make
    from autopar.passes.search.strategies import search_strategies

    model, args = make("llama", "tiny", batch=2, seq=16)
    graph = capture(model, args)
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")
    weighed = {n.name: search_strategies(graph, n, mesh) for n in graph.nodes}
    laid = [name for name, strats in weighed.items()
            if any(isinstance(p, Z) for st in strats for sig in st for p in sig.inputs + sig.outputs)]
    assert laid == []
    fwd = next(n for n in graph.nodes if n.op == ATTN_FWD)
    edges = [st for st in weighed[fwd.name] if edge_balanced(st)]
    assert {ring_axis(st) for st in edges} == {(0, RING_BALANCED), (1, RING_BALANCED)}
    call, hw, link = op_call(graph, fwd), mesh.hardware, mesh.link(1)
    prec = get_precision("fp32", hw)
    edge = next(st for st in edges if ring_axis(st) == (1, RING_BALANCED))
    laid_out = tuple(sig if a != 1 else next(s for s in (st[1] for st in strategies(call, (2, 2)))
                                             if s.tag == RING_BALANCED and isinstance(s.inputs[0], Z))
                     for a, sig in enumerate(edge))
    ins = [tuple(x // 2 if d == 2 else x for d, x in enumerate(s.shape)) for s in call.in_specs]
    outs = [tuple(x // 2 if d == 2 else x for d, x in enumerate(s.shape)) for s in call.out_specs]
    assert ring_time(call, edge, ins, outs, 2, link, hw, prec) > ring_time(call, laid_out, ins, outs, 2, link, hw, prec)


def test_balanced_ring_on_contiguous_blocks_matches_one_device():
    """The balanced ring as the search without ``Z`` weighs it (contiguous blocks, permuted at the
    op's edges): a plan forcing it lays nothing out ``Z`` and trains as the model does."""
    import inspect

    from autopar.ir.rules.ring import RING_BALANCED, forced_form
    from autopar.planner.intra import run_passes
    from autopar.planner.options import PlanOptions
    from autopar.planner.report import build_plan

    from _parity import simulated_errors

    model, args, _, tol = _family("llama")
    mesh = autopar.Mesh({"dp": 2, "cp": 2}, device="cpu")
    opts = PlanOptions(hints={"input:0": "cp=S(1)", "input:1": "cp=S(1)"}, deterministic_time=0.5, progress=False)
    with forced_form(RING_BALANCED), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = build_plan(inspect.unwrap(run_passes)(model, mesh, args, None, opts))  # the search without Z
    attn = [n for n in plan.nodes if "attention" in n["op"]]
    assert attn and all(RING_BALANCED in n["tags"] for n in attn)
    assert not any("Z(" in s for n in plan.nodes for s in n["strategy"])
    loss_err, grad_errs = simulated_errors(model, plan, args)
    assert loss_err <= tol and max(grad_errs.values()) <= 1e-8, (loss_err, grad_errs)
