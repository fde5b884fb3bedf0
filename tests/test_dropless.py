"""Dropless token-choice mixture of experts: the zoo's ``moe_dropless``, Hugging Face Mixtral and
Qwen2-MoE (shared experts) with their load-balancing losses, and dropless expert parallelism, the
``experts`` strategy of ``aten._grouped_mm`` (``autopar/ir/rules/expert.py``): rows travel to the
device holding their expert over ``all_to_all_v`` and back.

The strategy is proven by execution: every device's local code runs on its own thread with the
simulator's collectives, on routings where an expert gets no row and one gets every row, against
the whole product. Whole models are checked in the simulator against the single device (loss and
every gradient), with the experts' split forced by hints, on routings forced uneven.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar.ir.capture import capture
from autopar.ir.graph import Ref, TensorSpec
from autopar.ir.placement import B, P, Split
from autopar.ir.rules.base import LocalCtx, OpCall, run_local, strategies
from autopar.ir.rules.dimmap import Signature
from autopar.ir.rules.proof.check import Case, Report, cases, dedupe, mutation_test, record_values, verify
from autopar.ir.rules.proof.interp import collect, distribute, reference
from autopar.models import make
from autopar.program import collectives as C
from autopar.runtime.threads import run_threads

GROUPED = "aten._grouped_mm.default"


def _call(form: str, t: int, k: int, n: int, e: int) -> OpCall:
    """An ``_grouped_mm`` call of ``form`` (rows: ``[T, K] x [E, K, N]``; sum: ``[K, T] x [T, N]``)."""
    offs = TensorSpec((e,), torch.int32)
    if form == "rows":
        ins = [TensorSpec((t, k), torch.float32), TensorSpec((e, k, n), torch.float32), offs]
        out = TensorSpec((t, n), torch.float32)
    else:
        ins = [TensorSpec((k, t), torch.float32), TensorSpec((t, n), torch.float32), offs]
        out = TensorSpec((e, k, n), torch.float32)
    return OpCall(GROUPED, torch.ops.aten._grouped_mm.default, (Ref("a"), Ref("b"), Ref("offs")), {}, ins, [out])


def _reference(form: str, a, b, offs) -> torch.Tensor:
    out = torch.nn.functional.grouped_mm(a, b, offs=offs)
    if form == "sum":  # an expert with no row: zeros (the kernel leaves its block unwritten)
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        out = torch.where((counts > 0).reshape(-1, 1, 1), out, out.new_zeros(()))
    return out


#: rows per expert: even, one expert empty, one expert with every row (the others empty), skewed
ROUTINGS = [[6, 6, 6, 6], [0, 9, 3, 12], [24, 0, 0, 0], [0, 0, 24, 0], [1, 0, 0, 23]]


def _run(form: str, counts: list[int], mesh: tuple, strategy) -> tuple[torch.Tensor, torch.Tensor]:
    t, k, n, e = sum(counts), 8, 4, len(counts)
    g = torch.Generator().manual_seed(sum(i * c for i, c in enumerate(counts)))
    call = _call(form, t, k, n, e)
    a, b = (torch.randn(s.shape, generator=g) for s in call.in_specs[:2])
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    blocks = [distribute(x, [s.inputs[i] for s in strategy], mesh, g) for i, x in enumerate((a, b, offs))]

    def device(coords):
        ctx = LocalCtx(call, strategy, mesh, coords, exchange=C.all_to_all_v)
        return run_local(ctx, [blk[coords] for blk in blocks])[0]

    outs, executed = run_threads(device, mesh, [f"x{i}" for i in range(len(mesh))])
    assert any(x.kind == "all_to_all_v" for ran in executed.values() for x in ran)
    got = collect(outs, [s.outputs[0] for s in strategy], mesh, shape=call.out_specs[0].shape)
    return got, _reference(form, a, b, offs)


def _experts(form: str) -> Signature:
    if form == "rows":
        return Signature((Split(0), Split(0), B), (Split(0),), "experts")
    return Signature((Split(1), Split(0), B), (Split(0),), "experts")


@pytest.mark.parametrize("form", ["rows", "sum"])
@pytest.mark.parametrize("counts", ROUTINGS)
def test_experts_strategy_proven_by_execution(form, counts):
    """On (2,), (3,), (4,), (2, 2) and (2, 3) (the experts on either axis, the other axis replicating,
    splitting the columns, or splitting the rows too: then each axis group exchanges its own rows, and
    the weight gradient is a partial sum over the other axis), uneven routings give the whole
    product's values on every device."""
    other = Signature((B, Split(2 if form == "rows" else 1), B), (Split(1 if form == "rows" else 2),), "S:n")
    rows = (Signature((Split(0), B, B), (Split(0),), "S:t") if form == "rows"
            else Signature((Split(1), Split(0), B), (P,), "S:t"))
    cases = [((2,), (_experts(form),)), ((3,), (_experts(form),)), ((4,), (_experts(form),)),
             ((2, 2), (_experts(form), other)), ((2, 2), (other, _experts(form))),
             ((2, 2), (Signature((B, B, B), (B,)), _experts(form))),
             ((2, 2), (rows, _experts(form))), ((2, 3), (_experts(form), rows))]
    for mesh, strategy in cases:
        got, want = _run(form, counts, mesh, strategy)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{form} {counts} {mesh} {strategy}")


def test_rule_proof_covers_the_experts_strategy_on_a_captured_model():
    """The rule proof (``ir.rules.proof``) runs the experts strategy like any other, each device on
    its own thread exchanging rows, on the grouped products captured from the zoo's model with its
    routing forced uneven (an expert with every token, one with none): every signature and
    composition holds on (2,), (3,), (2, 2) (the experts over both axes too) and (2, 3), and every
    mutant of them is caught."""
    from _dropless_helpers import build

    model, args = build()
    graph = capture(model, args)
    values = record_values(graph, model, args, {})
    found = []
    for c in dedupe(cases(graph, values)):
        if c.call.op == GROUPED:  # the CPU kernel's float32 on the captured bf16 values
            ins = [t.float() if t.dtype == torch.bfloat16 else t for t in c.inputs]
            found.append(Case(c.call, ins, reference(c.call, ins), c.node))
    report = Report()
    for mesh in [(2,), (3,), (2, 2), (2, 3)]:
        verify(found, mesh, report)
    assert not report.failures, report.failures[:5]
    proven = {sig for _, sig in report.pairs}
    for want in ["(S(0), S(0), B) -> (S(0))", "(S(1), S(0), B) -> (S(0))",
                 "(B, S(2), B) -> (S(1)) | (S(0), S(0), B) -> (S(0))", "(S(1), S(0), B) -> (S(0)) | (S(0), B, B) -> (S(1))",
                 "(S(0), S(0), B) -> (S(0)) | (S(0), S(0), B) -> (S(0))",
                 "(S(1), S(0), B) -> (S(0)) | (S(1), S(0), B) -> (S(0))"]:
        assert want in proven, want
    rep = mutation_test(found, (3,))
    assert rep.total > 20 and rep.caught == rep.total, rep.survivors[:5]


def test_experts_strategy_is_offered_on_either_axis_and_on_both():
    """The rule offers the experts strategy on either mesh axis and on both together (the expert
    layers' own factorization), never with the expert dim split on an untagged axis; the rows may
    split on the other axis too. Both axes together need an expert per device."""
    for form in ("rows", "sum"):
        strats = strategies(_call(form, 24, 8, 4, 4), (2, 2))
        tagged = [[s.tag for s in st] for st in strats if any(s.tag == "experts" for s in st)]
        assert any(t[0] == "experts" for t in tagged) and any(t[1] == "experts" for t in tagged)
        assert ["experts", "experts"] in tagged
        for st in strats:
            for s in st:  # the expert dim is split by the experts axes alone
                if any(x.tag == "experts" for x in st) and s.tag != "experts":
                    assert (s.inputs[1] if form == "rows" else s.outputs[0]) != Split(0), st
        rows_dim = 0 if form == "rows" else 1  # rows split on both axes: each group exchanges its own
        assert any(all(s.inputs[0] == Split(rows_dim) for s in st) for st in strats if st[1].tag == "experts")
        # 4 experts over (2, 4): not on both axes (two devices would hold none); each alone, yes
        wide = [[s.tag for s in st] for st in strategies(_call(form, 24, 8, 4, 4), (2, 4))]
        assert ["experts", "experts"] not in wide and any(t[1] == "experts" for t in wide)


#: rows per expert of eight experts over (2, 2): device (0, 1) holds experts 2 and 3, whose rows come
#: from the second and third row blocks, so after the exchange on the first axis its pieces arrive
#: out of expert order (expert 3's from member 0, expert 2's from member 1) and are regrouped
ROUTINGS_8 = [[3, 3, 6, 6, 1, 1, 1, 3], [0, 0, 0, 0, 0, 0, 0, 24], [24, 0, 0, 0, 0, 0, 0, 0],
              [3, 0, 5, 0, 7, 0, 1, 8], [1, 9, 9, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("form", ["rows", "sum"])
def test_experts_over_two_axes_proven_by_execution(form):
    """Experts split over two and three axes together (a hierarchical exchange: one all-to-all per
    axis, outer axis first, the received rows regrouped by expert between them), beside an axis
    that splits the columns within an expert or the rows: uneven routings with empty experts, one
    expert with every row, and pieces that arrive out of expert order give the whole product."""
    from autopar.ir.rules.expert import _regroup

    e = _experts(form)
    other = Signature((B, Split(2 if form == "rows" else 1), B), (Split(1 if form == "rows" else 2),), "S:n")
    rows = (Signature((Split(0), B, B), (Split(0),), "S:t") if form == "rows"
            else Signature((Split(1), Split(0), B), (P,), "S:t"))
    cases = [((2, 2), (e, e)), ((2, 4), (e, e)), ((4, 2), (e, e)), ((2, 2, 2), (e, e, e)),
             ((2, 2, 2), (e, other, e)), ((2, 2, 2), (rows, e, e)), ((2, 3, 2), (e, rows, e))]
    for counts in ROUTINGS_8:
        for mesh, strategy in cases:
            got, want = _run(form, counts, mesh, strategy)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{form} {counts} {mesh} {strategy}")
    # the first routing's pieces do arrive out of order (the regrouping is exercised, and right)
    pieces = torch.tensor([[0, 0, 0, 6, 0, 0, 0, 0], [0, 0, 2, 0, 0, 0, 0, 0]])
    assert _regroup(pieces).tolist() == [6, 7, 0, 1, 2, 3, 4, 5]
    assert _regroup(pieces.flip(0)) is None


# ---------------------------------------------------------------------------------------------
# Whole models in the simulator


def _force_routing(model, norm, router, n_experts: int) -> None:
    """Every token's first choice is expert 0 and nobody picks the last expert: the normalised input
    has zero mean over features, so a constant norm bias ``c`` adds ``|c|^2`` to the logit of a router
    row along ``c`` whatever the token."""
    with torch.no_grad():
        c = torch.full_like(norm.bias, 0.5)
        norm.bias.copy_(c)
        router.weight[0].copy_(20 * c)
        router.weight[n_experts - 1].copy_(-20 * c)


def _close(got, want, tol: float, label) -> None:
    (loss, grads), (ref, ref_grads) = got, want
    assert abs(float(loss) - float(ref)) <= tol * abs(float(ref)), (label, float(loss), float(ref))
    assert sorted(grads) == sorted(ref_grads), label
    for name in ref_grads:
        a, b = grads[name].double(), ref_grads[name].double()
        assert (a - b).norm().item() <= tol * max(b.norm().item(), 1e-6), (label, name)


def _expert_forms(plan, graph) -> set:
    """The forms (``(2, 3)``: rows, ``(2, 2)``: weight gradient) of the plan's expert-parallel products."""
    forms = {n.name: (len(graph.spec(n.inputs[0]).shape), len(graph.spec(n.inputs[1]).shape))
             for n in graph.ops() if n.op == GROUPED}
    return {forms[n["name"]] for n in plan.nodes if n["name"] in forms and "experts" in n.get("tags", [])}


def _plans(model, args, kwargs, hints, graph, search="propagate"):
    """Plans on (4,) and (2, 2) with the ``hints`` parameters split on their expert dim: on (2, 2)
    over one axis, and over both (the experts' own factorization: every expert-parallel product then
    runs its experts over both axes)."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for axes, hint in [({"ep": 4}, "S(0)"), ({"dp": 2, "ep": 2}, "ep=S(0)"), ({"dp": 2, "ep": 2}, "S(0), S(0)")]:
            out[(tuple(axes), hint)] = plan = autopar.plan(
                model, autopar.Mesh(axes, device="cpu"), args, kwargs, graph=graph, search=search, progress=False,
                hints={h: hint for h in hints})
            if hint == "S(0), S(0)":
                assert all(n["tags"] == ["experts", "experts"] for n in plan.nodes if "experts" in n.get("tags", []))
    return out


@pytest.mark.parametrize("routing", ["random", "forced"])
def test_zoo_dropless_simulates_the_one_device_program_with_experts_split(routing):
    """The zoo's dropless MoE (grouped experts in bf16, a shared expert, two layers) with its expert
    weights forced split: the weight gradients run the experts strategy, and loss and every gradient
    match the 1-device program's, on a random routing and on one where expert 0 takes every token
    and the last expert none."""
    torch.manual_seed(0)
    model, args = make("moe_dropless", "tiny", batch=4, experts="grouped_mm", n_shared=1, n_layers=2,
                       dtype=torch.bfloat16)
    if routing == "forced":
        _force_routing(model, model.layers[0].norm, model.layers[0].moe.router, 4)
        from autopar.models.moe_dropless import route

        with torch.no_grad():
            x = model.layers[0].norm(model.embed(args[0])).reshape(-1, 32)
            _, _, counts, _ = route(torch.softmax(model.layers[0].moe.router(x), -1), 2, True)
        assert counts[0] == x.shape[0] and counts[-1] == 0, counts
    graph = capture(model, args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = autopar.plan(model, autopar.Mesh({"a": 1}, device="cpu"), args, graph=graph, search="propagate",
                           progress=False)
        want = autopar.simulate(model, one, args, graph=graph)
    for axes, plan in _plans(model, args, {}, ["layers.*.moe.experts.w*"], graph).items():
        assert _expert_forms(plan, graph) == {(2, 3), (2, 2)}, axes
        _close(autopar.simulate(model, plan, args, graph=graph), want, 2e-2, (routing, axes))


def test_zoo_dropless_layer_drops_no_token():
    """Every (token, choice) pair reaches its expert, however uneven the routing: the layer equals a
    loop over tokens and their choices (float64, batched experts)."""
    torch.manual_seed(0)
    model, args = make("moe_dropless", "tiny", batch=2, experts="batched", dtype=torch.float64)
    layer = model.layers[0]
    _force_routing(model, layer.norm, layer.moe.router, 4)
    moe = layer.moe
    x = layer.norm(model.embed(args[0])).reshape(-1, 32)
    y, aux = moe(x)
    probs = torch.softmax(moe.router(x), -1)
    gates, idx = probs.topk(2, -1)
    gates = gates / gates.sum(-1, keepdim=True)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(2):
            e = int(idx[t, j])
            h = torch.nn.functional.gelu(x[t] @ moe.experts.w1[e])
            want[t] += gates[t, j] * (h @ moe.experts.w2[e])
    torch.testing.assert_close(y, want)
    assert (idx == 0).any(-1).all() and not (idx == 3).any()
    assert aux.item() > 1.0  # the balance loss sees the imbalance


def _hf(name: str, experts: str, **extra):
    import transformers
    from _corpus import _config, _ids

    transformers.logging.set_verbosity_error()
    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                max_position_embeddings=64, output_router_logits=True)
    if name == "mixtral":
        cfg = _config(transformers.MixtralConfig, False, **({"intermediate_size": 128} | extra | dims))
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = _config(transformers.Qwen2MoeConfig, False, intermediate_size=128, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2, **dims)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    model.config._experts_implementation = experts
    model = model.to(torch.bfloat16 if experts == "grouped_mm" else torch.float64)
    ids = _ids()
    return model, (), {"input_ids": ids, "labels": ids}


def _force_hf_routing(model) -> None:
    """Every token of every layer routes to expert 0 first and never to the last expert: a large
    shared direction ``v`` added to every token embedding dominates the residual stream, and the
    routers' rows for those experts point along ``+v`` and ``-v``."""
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        v = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(emb.dtype)
        emb.add_(4 * v)
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate[0].copy_(v)
            gate[-1].copy_(-v)


@pytest.mark.parametrize("name, routing", [("mixtral", "random"), ("mixtral", "forced"), ("qwen2_moe", "forced")])
def test_hf_moe_with_aux_loss_simulates_with_experts_split(name, routing):
    """Hugging Face Mixtral and Qwen2-MoE (a gated shared expert) as they run by default
    (``grouped_mm`` experts, bf16), their router's load-balancing loss in the loss: capture, then
    plans on (4,) and (2, 2) with the experts' weights forced split by hints compute the 1-device
    program's loss and gradients, every grouped product expert-parallel; on the model's routing and
    on one where expert 0 takes every token and the last expert none."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, args, kwargs = _hf(name, "grouped_mm")
    if routing == "forced":
        _force_hf_routing(model)
    out = model(*args, **kwargs)
    assert out.aux_loss is not None
    if routing == "forced":
        for logits in out.router_logits:
            top = logits.float().topk(2, -1).indices
            assert (top == 0).any(-1).all() and not (top == logits.shape[-1] - 1).any()
    graph = capture(model, args, kwargs)
    assert GROUPED in {n.op for n in graph.ops()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = autopar.plan(model, autopar.Mesh({"a": 1}, device="cpu"), args, kwargs, graph=graph,
                           search="propagate", progress=False)
        want = autopar.simulate(model, one, args, kwargs, graph=graph)
    hints = ["model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj"]
    for axes, plan in _plans(model, args, kwargs, hints, graph).items():
        assert _expert_forms(plan, graph) == {(2, 3), (2, 2)}, axes
        _close(autopar.simulate(model, plan, args, kwargs, graph=graph), want, 2e-2, (name, axes))


@pytest.mark.parametrize("name", ["zoo", "mixtral", "mixtral_wide"])
def test_searched_plans_on_two_axes_simulate_the_one_device_program(name):
    """The zoo's dropless MoE and Hugging Face Mixtral, routing forced (expert 0 takes every token,
    the last none), planned on (2, 2) by the search, whose options include the experts over either
    axis and over both: loss and every gradient match the 1-device program's. The plan with the
    experts forced over both axes says so in ``plan.explain``. A Mixtral of wide experts (16 of
    4096, its own routing) priced on H100s: the search runs some weight gradients' experts on one axis and splits
    within each expert on the other (expert x expert-tensor), a layout of their own."""
    torch.manual_seed(0)
    if name == "zoo":
        model, args = make("moe_dropless", "tiny", batch=4, experts="grouped_mm", n_shared=1, n_layers=2,
                           dtype=torch.bfloat16)
        _force_routing(model, model.layers[0].norm, model.layers[0].moe.router, 4)
        kwargs, hints = {}, ["layers.*.moe.experts.w*"]
    else:
        pytest.importorskip("transformers")
        wide = {"intermediate_size": 4096, "num_local_experts": 16} if name == "mixtral_wide" else {}
        model, args, kwargs = _hf("mixtral", "grouped_mm", **wide)
        if not wide:  # (forced, the wide model's attention gradients are bf16 roundoff: near zero)
            _force_hf_routing(model)
        hints = ["model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj"]
    graph = capture(model, args, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = autopar.plan(model, autopar.Mesh({"a": 1}, device="cpu"), args, kwargs, graph=graph,
                           search="propagate", progress=False)
        want = autopar.simulate(model, one, args, kwargs, graph=graph)
        device = "h100" if name == "mixtral_wide" else "cpu"
        searched = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, device=device), args, kwargs, graph=graph,
                                progress=False)
        forced = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, device="cpu"), args, kwargs, graph=graph,
                              search="propagate", progress=False, hints={h: "S(0), S(0)" for h in hints})
    _close(autopar.simulate(model, searched, args, kwargs, graph=graph), want, 2e-2, (name, "searched"))
    if name == "mixtral_wide":
        folded = [n["tags"] for n in searched.nodes if n.get("op") == GROUPED and "experts" in n.get("tags", [])]
        assert any(t == ["experts", "experts"] for t in folded), folded
    product = next(n for n in forced.nodes if n.get("tags") == ["experts", "experts"])
    assert "experts over dp x tp (4 ways)" in forced.explain(product["module"])


def test_mesh_devices_considers_an_expert_axis_for_a_mixture_of_experts():
    """``Mesh.devices`` factorizations: a mixture of experts gets shapes with an ``ep`` axis between
    dp and tp (``e x tp`` within a node, ``tp >= 2``, ``dp >= 2``, ``e`` no more than the experts), a
    dense model none; planned, the ``ep`` shape is priced beside the others."""
    from autopar.planner.factorize import shape_candidates

    plain = shape_candidates(64, 8, batch=64, n_layers=4)
    moe = shape_candidates(64, 8, batch=64, n_layers=4, experts=128)
    assert [s for s in moe if "ep" not in s] == plain
    assert [s for s in moe if "ep" in s] == [{"pp": 1, "dp": 8, "ep": 2, "tp": 4}, {"pp": 1, "dp": 16, "ep": 2, "tp": 2},
                                             {"pp": 1, "dp": 8, "ep": 4, "tp": 2}]
    assert {s["ep"] for s in shape_candidates(64, 8, batch=64, n_layers=4, experts=2) if "ep" in s} == {2}
    torch.manual_seed(0)
    model, args = make("moe_dropless", "tiny", batch=4, experts="grouped_mm", n_shared=1, n_layers=2,
                       dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, autopar.Mesh.devices(8, device="cpu", node_size=4, pp=[1], tp=[2]), args,
                            progress=False)
    shapes = {tuple(sorted(r["shape"].items())): r for r in plan.mesh_search["compared"]}
    ep = shapes[(("dp", 2), ("ep", 2), ("pp", 1), ("tp", 2))]
    assert "error" not in ep and ep["step_time"] > 0
    assert (("dp", 4), ("pp", 1), ("tp", 2)) in shapes


# ---------------------------------------------------------------------------------------------
# Real process groups


@pytest.fixture(scope="module")
def pool(gloo_pool4):
    return gloo_pool4()


@pytest.mark.parametrize("axes, hint", [((("ep", 4),), "S(0)"), ((("dp", 2), ("ep", 2)), "S(0), S(0)")])
def test_expert_parallel_step_on_gloo(pool, axes, hint):
    """Four gloo ranks run the zoo's dropless MoE with its experts split on (4,) and over both axes
    of (2, 2) (the first layer's routing sends every token to expert 0 and none to the last): the
    all-to-alls with run-time split sizes run on real process groups, one axis group after the
    other, and the loss and every gradient match the 1-device program's."""
    from _dropless_helpers import build, step_on_rank

    model, args = build()
    graph = capture(model, args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, autopar.Mesh(dict(axes), device="cpu"), args, graph=graph, search="propagate",
                            hints={"layers.*.moe.experts.w*": hint}, progress=False)
        one = autopar.plan(model, autopar.Mesh({"a": 1}, device="cpu"), args, graph=graph, search="propagate",
                           progress=False)
        want = autopar.simulate(model, one, args, graph=graph)
    assert _expert_forms(plan, graph) == {(2, 3), (2, 2)}
    if len(axes) == 2:
        assert all(n["tags"] == ["experts", "experts"] for n in plan.nodes if "experts" in n.get("tags", []))
    for got in pool.run(step_on_rank, axes, plan.to_json()):
        assert "all_to_all" in got["kinds"], got["kinds"]
        _close((got["loss"], got["grads"]), want, 2e-2, "gloo")
