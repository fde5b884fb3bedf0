"""Every sharding rule, proven by execution on the real graphs of the five model families.

For every op in the joint graphs and every strategy its rule enumerates on meshes (2,), (3,) and
(2, 3), the rule's local implementation runs on each device's blocks (float64; P inputs as random
addends; shapes chosen so that axes do not divide dims and some dims are smaller than an axis),
and the reassembled result must equal the op on whole tensors. The proof is itself tested by
mutation: single wrong changes to real signatures must be caught.
"""

import warnings

import pytest
import torch

import autopar.models as M
from conftest import REPORT
from autopar.ir.capture import capture
from autopar.ir.rules.proof.check import Report, cases, dedupe, mutation_test, record_values, verify

# Odd sizes on purpose: 3 heads, 1 KV head, vocabularies and widths that 2 and 3 do not divide.
FAMILIES = {
    "mlp": dict(batch=5, in_dim=7, hidden_dim=10, n_layers=2, num_classes=5),
    "gpt": dict(batch=3, seq=7, vocab_size=37, n_embd=30, n_head=3, n_layer=1, block_size=16),
    "llama": dict(batch=3, seq=7, vocab_size=29, dim=24, n_heads=3, n_kv_heads=1, ffn_dim=20, n_layers=1, max_seq_len=16),
    "cnn": dict(batch=3, widths=(4, 5), blocks=(1, 1), num_classes=5, image_size=8),
    "moe": dict(batch=3, seq=5, vocab_size=11, dim=10, ffn_dim=14, n_experts=3, top_k=2, n_layers=1),
}


def _hf_model(name):
    """Hugging Face GPT-2 and Llama from small configs (nothing downloaded); keyword inputs."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if name == "hf-gpt2":
        cfg = GPT2Config(n_layer=1, n_embd=30, n_head=3, vocab_size=37, n_positions=16,
                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(hidden_size=24, intermediate_size=20, num_hidden_layers=1, num_attention_heads=3,
                          num_key_value_heads=1, vocab_size=29, attention_dropout=0.0)
        model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 29, (3, 7))
    return model.double(), (), {"input_ids": ids, "labels": ids}


def _family_cases(name):
    torch.manual_seed(0)
    if name.startswith("hf-"):
        model, inputs, kwargs = _hf_model(name)
    else:
        model, inputs = M.make(name, dtype=torch.float64, **FAMILIES[name])
        kwargs = {}
    graph = capture(model, inputs, kwargs)
    values = record_values(graph, model, inputs, kwargs)
    return graph, dedupe(cases(graph, values))


@pytest.fixture(scope="module")
def family_cases():
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in list(FAMILIES) + ["hf-gpt2", "hf-llama"]:
            out[name] = _family_cases(name)
    return out


def test_every_op_has_a_rule(family_cases):
    for name, (graph, cs) in family_cases.items():
        missing = sorted({n.op for n in graph.ops()} - {c.call.op for c in cs} - {"get_attr"})
        assert not missing, f"{name}: ops without a sharding rule: {missing}"


def test_rules_proven_by_execution(family_cases):
    report = Report()
    for name, (graph, cs) in family_cases.items():
        for mesh in [(2,), (3,), (2, 3)]:
            verify(cs, mesh, report)
    line = (
        f"rule proof: verified {len(report.pairs)} distinct (op, signature) pairs over {len(report.ops)} aten ops "
        f"({report.checked} executions, meshes (2,), (3,), (2, 3)), {len(report.failures)} mismatches"
    )
    print("\n" + line)
    REPORT.append(line)
    assert not report.failures, "\n".join(report.failures[:20])
    assert len(report.ops) >= 50
    assert len(report.pairs) >= 1000
    # the loss-parallel class split of both halves of the loss (the only nll signatures splitting classes)
    for op in ("aten.nll_loss_forward.default", "aten.nll_loss_backward.default"):
        assert any(o == op and "S(1)" in text for o, text in report.pairs), f"{op}: class split not proven"


def test_proof_catches_mutated_rules(family_cases):
    total = caught = 0
    survivors = []
    for name, (graph, cs) in family_cases.items():
        rep = mutation_test(cs, (3,) if name in ("gpt", "moe", "hf-llama") else (2,))
        total += rep.total
        caught += rep.caught
        survivors += rep.survivors
    line = f"rule proof mutation test: {caught} of {total} wrong mutants caught ({caught / total:.1%})"
    print("\n" + line)
    REPORT.append(line)
    assert total > 1000
    assert caught / total >= 0.95, "\n".join(survivors[:20])


#: The ops the third-party corpus (tests/_corpus.py) needed rules for, and the models that use them.
CORPUS_OPS = {
    "aten.view_as_complex.default", "aten.view_as_real.default", "aten._conj.default", "aten.select_backward.default",
    "aten._safe_softmax.default", "aten.fill.Tensor", "aten.select_scatter.default", "aten.slice_scatter.default",
    "aten.index.Tensor", "aten.index_put.default",
}
CORPUS_MODELS = ["titan_llama", "torch_encoder", "hf_t5", "hf_vit", "hf_mixtral"]


def _huge(case) -> bool:
    """Inputs holding a masking constant (``finfo.min``): random partial addends of that size
    overflow to inf in float64 itself, so the proof cannot use them (the rule is not at fault)."""
    return any(t.is_floating_point() and t.numel() and t.abs().max() > 1e300 for t in case.inputs)


@pytest.fixture(scope="module")
def corpus_cases():
    pytest.importorskip("transformers")
    from _corpus import build

    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in CORPUS_MODELS:
            model, args, kwargs = build(name, dtype=torch.float64)
            graph = capture(model, args, kwargs)
            values = record_values(graph, model, args, kwargs)
            out += cases(graph, values)
    # the corpus's new ops, and mul on complex values (complex RoPE's rotation)
    return [c for c in dedupe(out) if not _huge(c) and (
        c.call.op in CORPUS_OPS or c.call.op == "aten.mul.Tensor" and any(s.dtype.is_complex for s in c.call.in_specs))]


def test_corpus_rules_proven_by_execution(corpus_cases):
    """Complex RoPE checked in complex128, positional writes and advanced indexing, on real values."""
    report = Report()
    for mesh in [(2,), (3,), (2, 3)]:
        verify(corpus_cases, mesh, report)
    line = (f"corpus rule proof: {len(report.pairs)} distinct (op, signature) pairs over {len(report.ops)} aten ops "
            f"({report.checked} executions), {len(report.failures)} mismatches")
    print("\n" + line)
    REPORT.append(line)
    assert not report.failures, "\n".join(report.failures[:20])
    assert CORPUS_OPS | {"aten.mul.Tensor"} <= report.ops, sorted(CORPUS_OPS - report.ops)
    dtypes = {s.dtype for c in corpus_cases for s in c.call.in_specs + c.call.out_specs if s is not None}
    assert torch.complex128 in dtypes
    # every new op has a split signature proven, not only the replicated one
    split = {op for op, sig in report.pairs if "S(" in sig}
    assert CORPUS_OPS <= split, sorted(CORPUS_OPS - split)


def test_corpus_rule_proof_catches_mutations(corpus_cases):
    rep = mutation_test(corpus_cases, (2,))
    line = f"corpus rule proof mutation test: {rep.caught} of {rep.total} wrong mutants caught"
    print("\n" + line)
    REPORT.append(line)
    assert rep.total > 200
    assert rep.caught / rep.total >= 0.95, "\n".join(rep.survivors[:20])
