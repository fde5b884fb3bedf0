"""The depth-linear analyses that take an agreeing layer instance's answer from its representative
(``dimflow.linked_dims``) or one answer per local signature (``dimflow.spread``, ``kept_reads``'s
view strategies) give what working out every op gives, on the built-ins, torchtitan's and Hugging
Face's models of the corpus at a depth where the stacked capture replicates the layers."""

from __future__ import annotations

import pytest
import torch

from autopar.ir import dimflow
from autopar.ir.blocks import _seeds
from autopar.ir.capture import capture
from autopar.ir.layers import known_layers, layers
from autopar.models import gpt, llama, llama_loop, moe

pytest.importorskip("transformers")

from _corpus import build  # noqa: E402

DEPTH = 6


def _graph(name: str):
    torch.manual_seed(0)
    if name == "llama":
        model, args = llama.make("tiny", n_layers=DEPTH)
        return capture(model, args)
    if name == "llama_loop":
        model, args = llama_loop.make("tiny", n_layers=DEPTH)
        return capture(model, args)
    if name == "gpt":
        model, args = gpt.make("tiny", n_layer=DEPTH)
        return capture(model, args)
    if name == "moe":
        model, args = moe.make("small", n_layers=DEPTH, dim=32, ffn_dim=64, vocab_size=64, seq_len=16)
        return capture(model, args)
    model, args, kwargs = build(name, layers=DEPTH)
    return capture(model, args, kwargs)


NAMES = ("llama", "llama_loop", "gpt", "moe", "titan_llama", "hf_llama", "hf_gpt2", "hf_t5")


@pytest.mark.parametrize("name", NAMES)
def test_linked_dims_from_representatives_are_every_ops_own(name):
    g = _graph(name)
    assert known_layers(g) is None  # nothing folded yet: every op is worked out
    own = dimflow.linked_dims(g)
    assert not dimflow._alike_ops(g)
    layers(g)
    alike = dimflow._alike_ops(g)
    # most ops of every instance but the first take their representative's links
    assert len(alike) > len(g.nodes) // 2, (len(alike), len(g.nodes))
    taken = dimflow.linked_dims(g)
    assert list(taken.items()) == list(own.items())
    assert len(taken) == len(own)


@pytest.mark.parametrize("name", ("llama", "gpt", "hf_gpt2"))
def test_spread_with_one_dimmap_per_signature_is_every_ops_own(name, monkeypatch):
    g = _graph(name)
    seeds = _seeds(g)
    assert seeds
    shared = dimflow.spread(g, seeds, whole=True)
    calls = []
    real = dimflow.local_signature

    def unique(graph, node):  # a signature per node: every op works out its own DimMap
        calls.append(node.name)
        return (node.name, real(graph, node))

    monkeypatch.setattr(dimflow, "local_signature", unique)
    own = dimflow.spread(g, seeds, whole=True)
    assert calls
    assert shared == own
