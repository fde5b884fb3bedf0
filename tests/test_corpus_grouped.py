"""Hugging Face Mixtral as it runs by default (``tests/_corpus.py``'s ``hf_mixtral_grouped``):
``grouped_mm`` experts, whose ``aten._grouped_mm``, ``histc`` and ``floor_divide`` have sharding
rules (``autopar/ir/rules/grouped.py``, ``generic.py``).

That kernel's fake implementation takes bf16 only on torch 2.13, so the model is captured in bf16;
the rules are proven in float32 on the captured ops' real values (the CPU kernel runs float32), and
the sharded programs are checked in the simulator against the same model's 1-device program in
bf16, with a bf16 tolerance. The parity of the corpus's float64 Mixtral (``batched_mm`` experts)
is in tests/test_corpus.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
import autopar._torch_compat as tc
from autopar.ir.capture import capture
from autopar.ir.rules import has_rule
from autopar.ir.rules.proof.check import Case, Report, cases, dedupe, mutation_test, record_values, verify
from autopar.ir.rules.proof.interp import reference

pytest.importorskip("transformers")

from _corpus import hf_mixtral_grouped

NEW_OPS = {"aten._grouped_mm.default", "aten.histc.default", "aten.floor_divide.default"}


def _build():
    torch.manual_seed(0)
    return hf_mixtral_grouped()


@pytest.fixture(scope="module")
def captured():
    model, args, kwargs = _build()
    from autopar.ir.rules import base

    base._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = dict(tc.JOINT_PATHS)
        graph = capture(model, args, kwargs)
        fast = tc.JOINT_PATHS["fast"] > before["fast"]
        plan = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, device="h100"), args, kwargs, graph=graph,
                            search="propagate", progress=False)
    warned = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    return model, args, kwargs, graph, plan, warned, fast


def test_default_experts_run_grouped_mm_and_nothing_warns(captured):
    model, _, _, graph, plan, warned, fast = captured
    assert model.config._experts_implementation == "grouped_mm"
    # its in-place writes (the inverse permutation's index_put_) are rewritten on the one-pass
    # trace; a node holding no tensor once broke that rewrite, and capture fell back to AOTAutograd
    assert fast
    ops = {n.op for n in graph.ops()}
    assert NEW_OPS <= ops, sorted(NEW_OPS - ops)
    # both forms: tokens by expert weights (forward, input gradient) and the weight gradient
    forms = {(len(graph.spec(n.inputs[0]).shape), len(graph.spec(n.inputs[1]).shape))
             for n in graph.ops() if n.op == "aten._grouped_mm.default"}
    assert forms == {(2, 3), (2, 2)}, forms
    assert not sorted(op for op in ops if op != "get_attr" and not has_rule(op))
    assert not warned, warned
    assert all("error" not in row for row in plan.baselines.values()), plan.baselines


@pytest.fixture(scope="module")
def proof_cases(captured):
    """The new ops' cases on real values, in float32 (the CPU kernel's; the graph was captured in bf16)."""
    model, args, kwargs, graph, _, _, _ = captured
    values = record_values(graph, model, args, kwargs)
    out = []
    for c in dedupe(cases(graph, values)):
        if c.call.op in NEW_OPS:
            ins = [t.float() if t.dtype == torch.bfloat16 else t for t in c.inputs]
            out.append(Case(c.call, ins, reference(c.call, ins), c.node))
    return out


def test_grouped_rules_proven_by_execution(proof_cases):
    """Every signature on (2,), (3,) and (2, 3): uneven row splits of real expert offsets, uneven
    column and contraction splits (blocks the kernel refuses unpadded), partial sums."""
    report = Report()
    for mesh in [(2,), (3,), (2, 3)]:
        verify(proof_cases, mesh, report)
    assert not report.failures, "\n".join(report.failures[:20])
    assert report.ops == NEW_OPS
    sigs = {(op, sig) for op, sig in report.pairs if "|" not in sig}
    grouped = {sig for op, sig in sigs if op == "aten._grouped_mm.default"}
    for want in ["(S(0), B, B) -> (S(0))",  # rows with shifted offsets
                 "(B, S(2), B) -> (S(1))",  # columns
                 "(S(1), S(1), B) -> (P)",  # contraction
                 "(S(1), S(0), B) -> (P)",  # the weight gradient's rows: a partial sum
                 "(P, B, B) -> (P)", "(B, P, B) -> (P)"]:
        assert want in grouped, (want, sorted(grouped))
    assert ("aten.histc.default", "(S(0)) -> (P)") in sigs
    assert ("aten.floor_divide.default", "(S(0)) -> (S(0))") in sigs


def test_grouped_rule_proof_catches_mutations(proof_cases):
    """Wrong signatures, and the row split with its offsets left unshifted, are caught."""
    rep = mutation_test(proof_cases, (3,))
    assert rep.total > 50
    assert rep.caught == rep.total, "\n".join(rep.survivors[:20])


def _close(got, want, tol: float, label) -> None:
    (loss, grads), (ref, ref_grads) = got, want
    assert abs(float(loss) - float(ref)) <= tol * abs(float(ref)), (label, float(loss), float(ref))
    names = sorted(ref_grads)
    assert sorted(grads) == names, label
    a = torch.cat([grads[n].double().flatten() for n in names])
    b = torch.cat([ref_grads[n].double().flatten() for n in names])
    assert (a - b).norm().item() <= tol * b.norm().item(), (label, (a - b).norm().item() / b.norm().item())


def _grouped_placements(plan, graph, form=None) -> list[tuple]:
    """``(input placements, output placements)`` of the plan's grouped products (of one form:
    ``(2, 3)`` tokens by expert weights, ``(2, 2)`` the weight gradient)."""
    forms = {n.name: (len(graph.spec(n.inputs[0]).shape), len(graph.spec(n.inputs[1]).shape))
             for n in graph.ops() if n.op == "aten._grouped_mm.default"}
    return [(tuple(n["inputs"]), tuple(n["outputs"])) for n in plan.nodes
            if n["name"] in forms and form in (None, forms[n["name"]])]


def test_sharded_experts_simulate_the_one_device_program_in_bf16(captured):
    """A searched plan on (2, 2) and the fsdp_tp recipe on (2, 3) split the grouped products (rows,
    columns, contraction) and compute the 1-device program's loss and gradients to bf16 roundoff."""
    model, args, kwargs, graph, _, _, _ = captured
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = autopar.plan(model, autopar.Mesh({"a": 1}, device="cpu"), args, kwargs, graph=graph,
                           search="propagate", progress=False)
        want = autopar.simulate(_build()[0], one, args, kwargs, graph=graph)  # one capture for all
        searched = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, device="cpu"), args, kwargs, graph=graph,
                                deterministic_time=0.5, progress=False)
        recipe = autopar.recipes.fsdp_tp(model, autopar.Mesh({"dp": 2, "tp": 3}, device="cpu"), args, kwargs,
                                         graph=graph, progress=False)
    for label, plan in (("searched (2, 2)", searched), ("fsdp_tp (2, 3)", recipe)):
        placed = _grouped_placements(plan, graph)
        assert any("S(" in p for ins, _ in placed for p in ins), (label, placed)  # not vacuous
        got = autopar.simulate(_build()[0], plan, args, kwargs, graph=graph)
        _close(got, want, 2e-2, label)
    # between them: the rows split (shifted offsets), and a partial sum (contraction or weight gradient)
    rows = _grouped_placements(searched, graph, (2, 3)) + _grouped_placements(recipe, graph, (2, 3))
    assert any("S(0)" in ins[0] for ins, _ in rows), rows
    assert any("P" in outs[0] for _, outs in rows), rows
    weight_grads = _grouped_placements(searched, graph, (2, 2)) + _grouped_placements(recipe, graph, (2, 2))
    assert any("S(1)" in ins[0] and "P" in outs[0] for ins, outs in weight_grads), weight_grads
