"""The corpus (``tests/_corpus.py``) with its dropout on: every model's own dropout options (its
configs' defaults, 0.1 where a Hugging Face default is 0), and a sharded program equals the same
model's 1-device program in the simulator on (2, 2) (on 4 gloo ranks for two of them:
tests/test_dropout.py). Dropout draws are placement independent (``ir.rules.random_ops``), not
torch's eager stream, so the reference is autopar's own program on one device, not the eager model."""

from __future__ import annotations

import warnings

import pytest
import torch
from _dropout_helpers import SEED, close, corpus_programs

import autopar
from autopar.ir.capture import capture
from autopar.ir.rules.random_attention import attention_dropout, is_random_call

pytest.importorskip("transformers")

from _corpus import CORPUS, FP32_INSIDE, build

#: Architectures with no dropout at all (torchtitan's Llama 3, the zoo's LLaMA): dropout on is
#: dropout off for them, whose parity tests/test_corpus.py checks against the eager model.
NO_DROPOUT = ("titan_llama", "llama_loop")
#: (hf_t5 takes over 10 s, its layers not folding: marked slow)
DROPPING = [pytest.param(n, marks=pytest.mark.slow) if n == "hf_t5" else n for n in CORPUS if n not in NO_DROPOUT]


def _random_nodes(graph) -> list:
    return [n for n in graph.ops() if is_random_call(n.op, n.args, n.kwargs)]


@pytest.mark.parametrize("name", NO_DROPOUT)
def test_models_without_dropout_draw_nothing(name):
    model, args, kwargs = build(name, dropout=True)
    assert not _random_nodes(capture(model, args, kwargs)), name


@pytest.mark.parametrize("name", DROPPING)
def test_with_dropout_the_sharded_program_equals_the_one_device_program(name):
    graph, _, many, one = corpus_programs(name)
    drawn = {n.name for n in _random_nodes(graph)}
    # every architecture here has dropout in its attention: some attention is one fused op with it
    assert any(attention_dropout(n.op, n.args, n.kwargs) > 0 for n in graph.ops()), f"{name}: attention dropout"
    # not vacuous: the plan runs some draw on a piece of its tensor, and the draw changes the loss
    split = [n for n in many.nodes if n["name"] in drawn and "S(" in n["outputs"][0]]
    assert split, (name, [(n["op"], n["outputs"]) for n in many.nodes if n["name"] in drawn])
    model, args, kwargs = build(name, dropout=True, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        out = model(*args, **kwargs)
        plain = (out if isinstance(out, torch.Tensor) else out.loss).item()
    assert abs(plain - one[0].item()) > 1e-6 * abs(plain), name
    model.train()
    torch.manual_seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = autopar.simulate(model, many, args, kwargs, graph=graph)  # this build's capture
    close(got, one, 1e-6 if name in FP32_INSIDE else 1e-9, name)
