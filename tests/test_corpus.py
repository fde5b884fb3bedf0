"""Model code autopar did not write (``tests/_corpus.py``: a torchtitan-style Llama 3 with complex
RoPE, Hugging Face GPT-2, LLaMA, BERT, T5, ViT and Mixtral, ``nn.TransformerEncoder``, the
functional-loop decoder) plans and runs like the built-in models: every op has a sharding rule (no
warning at capture or planning), every named recipe prices on every model, and the simulated
program on (2, 2) and (2, 3) meshes computes the eager model's loss, its other outputs and the gradients
(float64, dropout off). With dropout on: tests/test_corpus_dropout.py."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar.ir.capture import capture
from autopar.ir.outputs import flatten_outputs
from autopar.ir.rules import has_rule

transformers = pytest.importorskip("transformers")

from _corpus import CORPUS, FP32_INSIDE, build

NAMES = list(CORPUS)


def _no_rule_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "no sharding rule" in str(w.message)]


@pytest.fixture(scope="module")
def planned():
    """Per model: its captured graph, its plan on (2, 2) H100 and the warnings planning raised."""
    from autopar.ir.rules import base

    out = {}

    def get(name):
        if name not in out:
            model, args, kwargs = build(name)
            base._warned.clear()  # the warning is issued once per (op, module) and process
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                graph = capture(model, args, kwargs)
                plan = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, device="h100"), args, kwargs,
                                    graph=graph, search="propagate", progress=False)
            out[name] = (graph, plan, _no_rule_warnings(caught))
        return out[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_every_op_has_a_rule_and_nothing_warns(planned, name):
    graph, _, warned = planned(name)
    missing = sorted({n.op for n in graph.ops()} - {"get_attr"} - {n.op for n in graph.ops() if has_rule(n.op)})
    assert not missing, f"{name}: ops without a sharding rule: {missing}"
    assert not warned, warned


@pytest.mark.parametrize("name", NAMES)
def test_every_recipe_prices(planned, name):
    _, plan, _ = planned(name)
    assert set(plan.baselines) == set(autopar.recipes.NAMES)
    for recipe, row in plan.baselines.items():
        assert "error" not in row, f"{name}: {recipe}: {row['error']}"
        assert row["step_time"] > 0 and row["peak_memory"] > 0, (name, recipe, row)


def test_a_model_without_a_rule_warns_in_the_users_terms():
    """An op left without a rule (here: Bessel's i0) is named with its module, its cost and what
    to do, and the model still plans (the op replicated)."""
    from autopar.ir.rules import base

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.special.i0(self.proj(x)).sum()

    base._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autopar.plan(Odd(), autopar.Mesh({"dp": 2}, device="h100"), (torch.randn(4, 8),), search="propagate",
                     progress=False)
    msgs = _no_rule_warnings(caught)
    assert any(m.startswith("autopar: aten.i0.default in module '<root>' (inputs (4, 8))") for m in msgs), msgs
    for m in msgs:  # i0 and its backward's i1: each named once, in the user's terms
        assert "every device runs it whole" in m and "To avoid it" in m, m
    assert len(msgs) == len(set(msgs)) <= 2, msgs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-300)


def _check_parity(name: str, plan, graph=None) -> None:
    model, args, kwargs = build(name, dtype=torch.float64)
    got, grads = autopar.simulate(model, plan, args, kwargs, graph=graph)
    out = model(*args, **kwargs)
    ref = out if isinstance(out, torch.Tensor) else out.loss
    loss = got if isinstance(got, torch.Tensor) else got.loss
    ref.backward()
    # every output the model returns comes back in its structure, equal to the eager model's
    assert type(got) is type(out), (name, type(got), type(out))
    ours, theirs = flatten_outputs(got)[1], flatten_outputs(out)[1]
    assert len(ours) == len(theirs), (name, len(ours), len(theirs))
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    assert set(names) <= set(grads)
    tol = 1e-6 if name in FP32_INSIDE else 1e-9
    assert _rel(loss, ref) < tol, (name, _rel(loss, ref))
    for k, (x, y) in enumerate(zip(ours, theirs)):
        assert _rel(x, y) < tol, (name, k, tuple(y.shape), _rel(x, y))
    # one vector: a gradient that is zero in exact arithmetic (attention's key bias: softmax ignores
    # a shift of every score) is roundoff alone, and no two correct programs share their roundoff
    got, want = torch.cat([grads[n].double().flatten() for n in names]), torch.cat(
        [dict(model.named_parameters())[n].grad.double().flatten() for n in names])
    assert _rel(got, want) < tol, (name, _rel(got, want))


@pytest.fixture(scope="module")
def graphs64():
    """Per model: its float64 build's captured graph, shared by its (2, 2) and (2, 3) plans and their
    simulations (a capture of these models costs as much as a plan or a simulated step)."""
    out = {}

    def get(name):
        if name not in out:
            model, args, kwargs = build(name, dtype=torch.float64)
            out[name] = capture(model, args, kwargs, outputs=True)
        return out[name]

    return get


#: Every model on (2, 2) and on (2, 3): a tensor axis of 3 divides neither heads nor widths
CASES = [(n, tp) for n in NAMES for tp in (2, 3)]


@pytest.mark.parametrize("name,tp", CASES)
def test_fsdp_tp_simulates_the_eager_model(graphs64, name, tp):
    """torchtitan's layout (FSDP on dp, Megatron on tp) splits every model's weights on both axes."""
    model, args, kwargs = build(name, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.recipes.fsdp_tp(model, autopar.Mesh({"dp": 2, "tp": tp}, device="cpu"), args, kwargs,
                                       precision="fp64", progress=False, graph=graphs64(name))
    params = {n for n, _ in model.named_parameters()}
    split_both = [n for n, pl in plan.placements.items() if n in params and pl.count("S(") == 2]
    assert split_both, (name, {n: pl for n, pl in plan.placements.items() if n in params})
    _check_parity(name, plan, graphs64(name))


@pytest.mark.slow
def test_searched_plan_of_complex_rope_simulates_the_eager_model(graphs64):
    """The searched plan of the torchtitan-style Llama (complex RoPE split by heads or batch)."""
    model, args, kwargs = build("titan_llama", dtype=torch.float64)
    graph = graphs64("titan_llama")
    plan = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, device="cpu"), args, kwargs, precision="fp64",
                        deterministic_time=0.5, progress=False, graph=graph)
    _check_parity("titan_llama", plan, graph)


def test_complex_stays_complex64_under_bf16_mixed_at_8_bytes(planned):
    """No complex bf16: the cast policy leaves complex values alone and prices them at 8 bytes."""
    from autopar.cost_model.casting import cast_policy
    from autopar.cost_model.precision import element_bytes, get_precision
    from autopar.ir.graph import Ref

    model, args, kwargs = build("titan_llama")
    graph = planned("titan_llama")[0]  # the capture of this build (fp32)
    prec = get_precision("bf16-mixed", autopar.Mesh({"dp": 2}, device="h100").hardware, "adamw")
    policy = cast_policy(graph, prec)
    complex_refs = [Ref(n.name, j) for n in graph.nodes for j, o in enumerate(n.outputs)
                    if o is not None and o.dtype.is_complex]
    assert len(complex_refs) >= 4 * 2  # q and k rotated, forward and backward, in each of 2 layers
    for ref in complex_refs:
        assert policy.dtype(graph, ref) == torch.complex64, ref
        for role in ("activation", "grad", "gather"):
            assert element_bytes(torch.complex64, role, prec) == 8
    plan = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, device="h100"), args, kwargs, graph=graph,
                        precision="bf16-mixed", search="propagate", progress=False)
    assert all("error" not in row for row in plan.baselines.values()), plan.baselines


def test_report_alternatives_are_priced_as_evaluate_prices_them(planned):
    """The report re-prices one changed strategy from the plan's sums; that equals a full evaluate."""
    import random

    from autopar.planner.intra import run_passes
    from autopar.planner.options import PlanOptions
    from autopar.passes.search.problem import Repricer, evaluate

    model, args, kwargs = build("hf_gpt2")
    p = run_passes(model, autopar.Mesh({"dp": 2, "tp": 2}, device="h100"), args, kwargs,
                   PlanOptions(progress=False, search="propagate", graph=planned("hf_gpt2")[0]))
    reprice = Repricer(p.problem, p.choice)
    rng = random.Random(0)
    changed = 0
    for _ in range(100):
        i = rng.randrange(len(p.problem.nodes))
        s = rng.randrange(len(p.problem.nodes[i].strategies))
        choice = list(p.choice)
        choice[i] = s
        want = evaluate(p.problem, choice)
        step, compute, comm = reprice.with_strategy(i, s)
        assert step == pytest.approx(want.step_time, rel=1e-12)
        assert compute == pytest.approx(want.compute_time, rel=1e-12)
        assert comm == pytest.approx(want.comm_time, rel=1e-12, abs=1e-18)
        changed += abs(want.step_time - p.cost.step_time) > 1e-9 * p.cost.step_time
    assert changed > 10  # the sample does change the step time
