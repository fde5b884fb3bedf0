"""Stacked capture (``ir.stack``): a deep stack of alike layers captured at a few layers and
replicated is the full capture's Graph node for node (names, ops, arguments, shapes, roles, module
paths: ``graph_fingerprint`` and more) on the built-in models, torchtitan's and Hugging Face's
(``tests/_corpus.py``) at two depths, with two traces instead of one per layer; plans from it are
byte-identical; layers that differ by index fall back to the full trace, saying why."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar import _torch_compat as tc
from autopar.ir import stack as stack_mod
from autopar.ir.capture import capture
from autopar.ir.fingerprint import graph_fingerprint
from autopar.models import gpt, llama, llama_loop, moe
from autopar.planner import captures

transformers = pytest.importorskip("transformers")

from _corpus import build  # noqa: E402

DEPTHS = (6, 7)


def _model(name: str, layers: int):
    """``(model, args, kwargs)`` of a built-in (``autopar.models``) or corpus model with ``layers`` blocks."""
    torch.manual_seed(0)
    if name == "llama":
        return (*llama.make("tiny", n_layers=layers), {})
    if name == "llama_loop":
        return (*llama_loop.make("tiny", n_layers=layers), {})
    if name == "gpt":
        return (*gpt.make("tiny", n_layer=layers), {})
    if name == "moe":
        return (*moe.make("small", n_layers=layers, dim=32, ffn_dim=64, vocab_size=64, seq_len=16), {})
    return build(name, layers=layers)


def _exports() -> int:
    return sum(tc.JOINT_PATHS.values())


def _captured(model, args, kwargs, **kw):
    """The capture, how many traces it took and its warnings about the stack."""
    before = _exports()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = capture(model, args, kwargs, **kw)
    return graph, _exports() - before, [str(w.message) for w in caught if str(w.message).startswith("capture: the")]


def _same(stacked, full) -> None:
    """Node for node: what ``graph_fingerprint`` hashes, and module paths and the graph's tables too."""
    assert graph_fingerprint(stacked) == graph_fingerprint(full)
    assert [(n.name, n.op, n.module_path, n.phase, n.outputs, n.roles) for n in stacked.nodes] == \
        [(n.name, n.op, n.module_path, n.phase, n.outputs, n.roles) for n in full.nodes]
    for table in ("params", "buffers", "inputs", "grads", "loss", "outputs", "extras", "mutations", "aliases"):
        assert getattr(stacked, table) == getattr(full, table), table
    assert stack_mod._difference(stacked, full) == ""


#: at both depths: the built-ins, torchtitan's Llama 3, Hugging Face's LLaMA and GPT-2; at one: the rest of the corpus
CASES = [(name, depth) for name in ("llama", "llama_loop", "gpt", "moe", "titan_llama", "hf_llama", "hf_gpt2")
         for depth in DEPTHS] + [(name, DEPTHS[0]) for name in ("hf_mixtral", "hf_bert", "torch_encoder", "hf_t5")]


@pytest.mark.parametrize("name, depth", CASES)
def test_stacked_capture_is_the_full_capture(name, depth):
    model, args, kwargs = _model(name, depth)
    stacked, traces, why = _captured(model, args, kwargs, outputs=True)
    # the 3- and 4-layer probes, not one trace per layer (T5: 4 and 5, its third block differs from the second)
    assert not why and traces == (3 if name == "hf_t5" else 2), (why, traces)
    full, traces, _ = _captured(model, args, kwargs, outputs=True, stack=False)
    assert traces == 1
    _same(stacked, full)


def test_stacked_inference():
    model, args, _ = _model("llama", 6)
    stacked, traces, why = _captured(model, args, {}, training=False)
    assert not why and traces == 2
    _same(stacked, capture(model, args, training=False, stack=False))


def test_the_plan_of_a_stacked_capture_runs_as_the_model_does():
    """Planned from the replicated graph and lowered from it, the step on a simulated (2, 2) mesh
    computes the eager model's loss and gradients (float64)."""
    model, args, kwargs = build("llama_loop", dtype=torch.float64, layers=6)
    captures.clear()  # (a capture of the same model by an earlier test would be reused)
    before = _exports()
    plan = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, device="h100"), args, kwargs, search="propagate",
                        progress=False)
    got, grads = autopar.simulate(model, plan, args, kwargs)
    assert _exports() - before == 2  # two traces to plan; the lowering reuses the capture
    loss = model(*args, **kwargs)
    loss.backward()
    torch.testing.assert_close(got, loss.detach(), rtol=1e-12, atol=1e-12)
    for fqn, p in model.named_parameters():
        torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-10, atol=1e-12)


def test_a_stack_too_shallow_is_traced_in_full():
    model, args, _ = _model("llama", stack_mod.MIN_DEPTH - 1)
    _, traces, why = _captured(model, args, {})
    assert traces == 1 and not why


class _Alternating(nn.Module):
    """Layers of one class and one structure whose parent runs them differently by index: the even
    ones causal, the odd ones not (alternating attention kinds)."""

    class Block(nn.Module):
        def __init__(self, dim: int):
            super().__init__()
            self.qkv = nn.Linear(dim, 3 * dim)
            self.out = nn.Linear(dim, dim)

    def __init__(self, layers: int = 6, dim: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(self.Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            q, k, v = block.qkv(x).unsqueeze(1).chunk(3, dim=-1)
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=i % 2 == 0)
            x = x + block.out(y.squeeze(1))
        return self.head(x).pow(2).mean()


class _DenseFirst(nn.Module):
    """A MoE-style stack whose first two layers are dense: the same class, other parameters (a
    first layer of its own alone is traced, as T5's first block with its position bias is)."""

    class Block(nn.Module):
        def __init__(self, dim: int, experts: int):
            super().__init__()
            if experts == 1:
                self.ffn = nn.Linear(dim, dim)
            else:
                self.ffn = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

        def forward(self, x):
            if isinstance(self.ffn, nn.Linear):
                return x + self.ffn(x)
            return x + sum(e(x) for e in self.ffn) / len(self.ffn)

    def __init__(self, layers: int = 6, dim: int = 16):
        super().__init__()
        self.layers = nn.Sequential(*(self.Block(dim, 1 if i < 2 else 2) for i in range(layers)))

    def forward(self, x):
        return self.layers(x).pow(2).mean()


def test_layers_that_differ_by_index_fall_back_to_the_full_trace():
    model, args = _Alternating(), (torch.randn(2, 8, 16),)
    graph, traces, why = _captured(model, args, {})
    assert traces in (3, 4)  # the probes (3 and 4 layers, or 4 and 5 where the last of 3 differs), then the full trace
    assert len(why) == 1 and why[0].startswith("capture: the 6 layers of 'blocks' are traced one by one"), why
    assert "\n" not in why[0] and "one more layer" in why[0], why
    _same(graph, capture(model, args, stack=False))


def test_layers_with_other_parameters_fall_back_before_any_probe():
    model, args = _DenseFirst(), (torch.randn(4, 16),)
    graph, traces, why = _captured(model, args, {})
    assert traces == 1
    assert len(why) == 1 and "layer 2 of 'layers' has other parameters" in why[0], why
    assert set(graph.params) == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("name, search", [("llama", "ilp"), ("titan_llama", "propagate")])
def test_plans_from_the_stacked_capture_are_byte_identical(name, search, monkeypatch):
    model, args, kwargs = _model(name, 6)
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")
    before = _exports()
    with captures.reuse(False):  # each plan traces afresh: the two graphs are compared, not one reused
        stacked = autopar.plan(model, mesh, args, kwargs, search=search, progress=False)
        assert _exports() - before == 2
        monkeypatch.setenv("AUTOPAR_STACK_CAPTURE", "0")
        full = autopar.plan(model, mesh, args, kwargs, search=search, progress=False)
    assert _exports() - before == 3
    assert stacked.to_json() == full.to_json()


def test_layers_set_otherwise_by_index_fall_back_before_any_probe():
    """Hugging Face's way to alternate attention kinds: a per-layer setting (Gemma's ``sliding_window``
    on every other layer), which a trace of a few layers would miss beyond them."""
    model, args, kwargs = _model("hf_llama", 6)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.sliding_window = 8 if i % 5 == 4 else None
    _, traces, why = _captured(model, args, kwargs)
    assert traces == 1
    assert len(why) == 1 and "layer 4 of 'model.layers' is set otherwise than layer 1 (self_attn.sliding_window)" \
        in why[0], why
