"""Ops that couple a whole batch (``passes/search/batch_coupled.py``) found in the captured forward:
batch norm in training mode and capacity-limited MoE routing are; LLaMA, GPT and a batch norm in
eval mode are not. A pipeline that micro-batches them says its reference is the micro-batched run."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar import models
from autopar.ir.capture import capture
from autopar.passes.search.batch_coupled import batch_coupled


def _found(family: str, training: bool = True, batch: int = 4, **kw) -> list[str]:
    model, inputs = models.make(family, "tiny", batch=batch, **kw)
    if not training:
        model.eval()
    graph = capture(model, inputs, None, training=training)
    return batch_coupled(graph, batch)


def test_batch_norm_in_training_and_capacity_routing_couple_the_batch():
    bn = _found("cnn")
    assert bn and all("batch_norm" in x for x in bn)
    moe = _found("moe")
    assert any("cumsum" in x for x in moe)  # slot positions numbered over every token of the batch
    assert not any("topk" in x for x in moe)  # the top-k over each token's experts is per token


def test_token_wise_models_and_batch_norm_in_eval_do_not():
    assert _found("llama") == []
    assert _found("gpt") == []
    assert _found("cnn", training=False) == []


@pytest.mark.parametrize("name", ["hf_llama", "hf_mixtral", "torch_encoder"])
def test_corpus_models_are_not_coupled(name):
    """Models this project did not write: Hugging Face LLaMA (position ids scanned along the sequence),
    Mixtral (token-choice top-k over each token's experts, no capacity) and nn.TransformerEncoder."""
    from tests._corpus import build

    model, args, kwargs = build(name)
    graph = capture(model, args, kwargs, training=True)
    rows = next(int(v.shape[0]) for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor))
    assert batch_coupled(graph, rows) == []


def test_a_micro_batched_pipeline_states_its_reference():
    model, inputs = models.make("moe", "tiny", batch=8)
    mesh = autopar.Mesh({"dp": 2}, device="cpu")
    with pytest.warns(UserWarning, match="couple the whole batch"):
        plan = autopar.plan(model, mesh, inputs, pipeline={"microbatches": 2}, progress=False)
    pl = plan.pipeline
    assert pl.reference == "micro-batched" and any("cumsum" in x for x in pl.batch_coupled)
    assert "batch-coupled ops" in plan.summary()
    # one micro-batch keeps the whole batch: nothing to state
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        whole = autopar.plan(model, mesh, inputs, pipeline={"microbatches": 1}, progress=False)
    assert whole.pipeline.reference == "whole-batch" and whole.pipeline.batch_coupled
