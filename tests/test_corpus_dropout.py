"""The corpus (``tests/_corpus.py``) with its dropout on: every model's own dropout options (its
configs' defaults, 0.1 where a Hugging Face default is 0), and a sharded program equals the same
model's 1-device program, in the simulator on (2, 2) for every model and on 4 gloo ranks for two.
Dropout draws are placement independent (``ir.rules.random_ops``), not torch's eager stream, so
the reference is autopar's own program on one device, not the eager model."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar.ir.capture import capture
from autopar.ir.rules.random_attention import ATTN_FWD, is_random_call

pytest.importorskip("transformers")

from _corpus import CORPUS, build
from test_corpus import FP32_INSIDE

#: Architectures with no dropout at all (torchtitan's Llama 3, the zoo's LLaMA): dropout on is
#: dropout off for them, whose parity tests/test_corpus.py checks against the eager model.
NO_DROPOUT = ("titan_llama", "llama_loop")
DROPPING = [n for n in CORPUS if n not in NO_DROPOUT]
#: Two models on gloo: PyTorch's own attention (``nn.MultiheadAttention``) and a Hugging Face encoder.
GLOO = ("torch_encoder", "hf_bert")
SEED = 5


def _random_nodes(graph) -> list:
    return [n for n in graph.ops() if is_random_call(n.op, n.args, n.kwargs)]


def _loss(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


@pytest.fixture(scope="module")
def programs():
    """Per model: its graph with dropout on (float64), its 1-device plan, its (2, 2) ``fsdp_tp``
    plan and the 1-device program's loss and gradients (the run's seed ``SEED``)."""
    out = {}

    def get(name):
        if name not in out:
            model, args, kwargs = build(name, dropout=True, dtype=torch.float64)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # T5's learned-bias attention runs unfused: warned
                graph = capture(model, args, kwargs)
                one = autopar.plan(model, autopar.Mesh({"a": 1}, device="cpu"), args, kwargs, graph=graph,
                                   precision="fp64", search="propagate", progress=False)
                many = autopar.recipes.fsdp_tp(model, autopar.Mesh({"dp": 2, "tp": 2}, device="cpu"), args, kwargs,
                                               graph=graph, precision="fp64", progress=False)
                torch.manual_seed(SEED)  # simulate draws the run's seed from torch's default generator
                out[name] = (graph, one, many, autopar.simulate(model, one, args, kwargs))
        return out[name]

    return get


def _close(got, want, tol: float, label) -> None:
    """Loss and all gradients (as one vector) within ``tol``, relative."""
    (loss, grads), (ref, ref_grads) = got, want
    assert abs(float(loss) - float(ref)) <= tol * abs(float(ref)), (label, float(loss), float(ref))
    assert grads.keys() == ref_grads.keys(), label
    names = sorted(ref_grads)
    a = torch.cat([grads[n].double().flatten() for n in names])
    b = torch.cat([ref_grads[n].double().flatten() for n in names])
    # one vector: gradients zero in exact arithmetic (attention's key bias) are roundoff alone
    assert (a - b).norm().item() <= tol * b.norm().item(), (label, (a - b).norm().item() / b.norm().item())


@pytest.mark.parametrize("name", NO_DROPOUT)
def test_models_without_dropout_draw_nothing(name):
    model, args, kwargs = build(name, dropout=True)
    assert not _random_nodes(capture(model, args, kwargs)), name


@pytest.mark.parametrize("name", DROPPING)
def test_with_dropout_the_sharded_program_equals_the_one_device_program(programs, name):
    graph, _, many, one = programs(name)
    drawn = _random_nodes(graph)
    assert drawn, f"{name}: no dropout drawn"
    # not vacuous: the plan runs some draw on a piece of its tensor, and the draw changes the loss
    split = [n for n in many.nodes if n["name"] in {d.name for d in drawn} and "S(" in n["outputs"][0]]
    assert split, (name, [(n["op"], n["outputs"]) for n in many.nodes if n["name"] in {d.name for d in drawn}])
    model, args, kwargs = build(name, dropout=True, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        plain = _loss(model(*args, **kwargs)).item()
    assert abs(plain - one[0].item()) > 1e-6 * abs(plain), name
    model.train()
    torch.manual_seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = autopar.simulate(model, many, args, kwargs)
    _close(got, one, 1e-6 if name in FP32_INSIDE else 1e-9, name)


def test_with_dropout_gloo_ranks_equal_the_one_device_program(programs):
    """On 4 gloo ranks under the (2, 2) plans, each of two models takes one step with the seed
    the 1-device program ran with: the same loss and gradients on every rank."""
    from _dropout_helpers import corpus_step_on_rank

    from autopar.runtime.pool import WorkerPool

    cases = [(name, programs(name)[2].to_json()) for name in GLOO]
    with WorkerPool(4, timeout=300.0) as pool:
        results = pool.run(corpus_step_on_rank, cases, SEED)
    for rank, r in enumerate(results):
        for name in GLOO:
            _close(r[name], programs(name)[3], 1e-9, (rank, name))
