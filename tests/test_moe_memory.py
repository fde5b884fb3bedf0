"""The search's memory count of a mixture of experts against the walked peak (``cost_model.liveness``):
what each added layer costs by the problem's sum over nodes (saved activations, parameter state and
the gradients awaiting their reduction) is what it costs the walked peak."""

from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.passes.search.problem import evaluate
from autopar.planner.intra import run_passes
from autopar.planner.options import PlanOptions

#: how much more than the walk a layer may cost by the problem's count: the count is an upper bound,
#: which adds the reduced gradients to the unreduced ones the walk holds at the backward's end (the
#: reductions come after), and counts an all-reduced partial gradient twice (its bucket reduces it in
#: place); both a few percent of a layer at scale, where a layer's gradients split over many devices
TOLERANCE = 0.2


@functools.cache
def _planned(layers: int, recipe: str):
    """Hugging Face Mixtral, shrunk (``grouped_mm`` experts, bf16), planned with ``recipe`` on (2, 2)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                     max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, 128, (4, 32))
    return run_passes(model, autopar.Mesh({"dp": 2, "tp": 2}, device="h100"), (), {"input_ids": ids, "labels": ids},
                      PlanOptions(recipe=recipe, progress=False))


@pytest.mark.parametrize("recipe", ["fsdp", "fsdp_tp"])
def test_a_layer_costs_the_problem_what_it_costs_the_walk(recipe):
    """Two layers more: the walked peak (at the backward's end, where every saved activation and every
    unreduced partial gradient is alive) grows by no more than the problem's count grows, and by at
    least ``1 / (1 + TOLERANCE)`` of it. The experts' weight gradients are partial sums of the data
    axis, reduce-scattered after the backward's ops: a count without them misses a quarter of a layer."""
    small, large = _planned(2, recipe), _planned(4, recipe)
    walked = large.peak.peak - small.peak.peak
    counted = evaluate(large.problem, large.choice).peak_memory - evaluate(small.problem, small.choice).peak_memory
    assert walked > 0
    assert walked <= counted <= (1 + TOLERANCE) * walked, (recipe, counted, walked)
