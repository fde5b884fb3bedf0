"""The memory rows of the fitting search (``solve._transients``): an op's temporaries before the layers'
backward (``PNode.head``: the forward, the loss) are counted beside the persistent memory less the layers'
gradients (``PNode.deferred``), which do not exist yet then; the others beside all of it. The solvers'
rows and ``problem.largest_transient`` say the same of every choice."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.errors import InfeasibleError
from autopar.ir.graph import Phase
from autopar.passes.search.problem import evaluate, largest_transient, least_transient
from autopar.passes.search.solve import solve
from autopar.passes.search.solve_axis import solve_by_axis, within_budget
from autopar.planner.intra import run_passes
from autopar.planner.options import PlanOptions


@functools.cache
def _planned():
    """Hugging Face Mixtral, shrunk (``grouped_mm`` experts, bf16, a vocabulary whose logits are the
    largest temporaries), four layers planned with ``fsdp`` on (2, 2)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                                     max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, 4096, (4, 32))
    return run_passes(model, autopar.Mesh({"dp": 2, "tp": 2}, device="h100"), (), {"input_ids": ids, "labels": ids},
                      PlanOptions(recipe="fsdp", progress=False))


def test_the_head_is_the_forward_and_the_loss_and_the_layers_gradients_are_deferred():
    planned = _planned()
    graph, problem = planned.graph, planned.problem
    phase = {n.name: n.phase for n in graph.nodes}
    layer_back = [n for n in problem.nodes if n.name in planned.folding.where and phase[n.name] == Phase.BACKWARD]
    assert layer_back and not any(n.head for n in layer_back)
    assert all(n.head for n in problem.nodes if phase[n.name] == Phase.FORWARD)
    # the loss's backward runs before any layer's: its logits-sized temporaries are the head's largest
    head = max((n for n in problem.nodes if n.head and n.transient), key=lambda n: max(n.transient))
    late = max(max(n.transient) for n in problem.nodes if not n.head and n.transient)
    assert phase[head.name] == Phase.BACKWARD and max(head.transient) > late
    deferred = sum(n.mult * n.deferred[c] for n, c in zip(problem.nodes, planned.choice) if n.deferred)
    assert deferred > 0  # (the layers' parameters' gradients at least)
    heads = max(n.transient[c] for n, c in zip(problem.nodes, planned.choice) if n.transient and n.head)
    lates = max(n.transient[c] for n, c in zip(problem.nodes, planned.choice) if n.transient and not n.head)
    assert largest_transient(problem, planned.choice) == max(lates, heads - deferred)
    assert least_transient(problem) <= largest_transient(problem, planned.choice)


@pytest.mark.parametrize("solver", ["ilp", "axis"])
def test_the_solvers_rows_are_largest_transient(solver):
    """The recipe's choice alone allowed: a budget at what ``evaluate`` and ``largest_transient`` count
    for it is met, one a little under it is not (the rows neither more nor less than the function)."""
    planned = _planned()
    choice = planned.choice
    nodes = [replace(n, allowed=[c]) for n, c in zip(planned.problem.nodes, choice)]
    pinned = replace(planned.problem, nodes=nodes, transients=True)
    need = evaluate(pinned, choice).peak_memory + largest_transient(pinned, choice)
    assert largest_transient(pinned, choice) < max(max(n.transient) for n in pinned.nodes if n.transient)

    def run(budget: float):
        at = replace(pinned, memory_budget=budget)
        if solver == "ilp":
            return solve(at, choice, 2.0).choice
        return solve_by_axis(at, choice, 2, 2).choice

    assert run(need * (1 + 1e-6) + 4096) == choice
    assert within_budget(replace(pinned, memory_budget=need * (1 + 1e-6) + 4096), choice)
    with pytest.raises(InfeasibleError):
        run(need * 0.99)
