"""``autopar.simulate`` of pipelined plans (``runtime/pipeline/simulate.py``): every stage-mesh device a thread
running the pipelined runtime's cut of the plan's lowered program (static part, per-micro-batch stage
slices, per-step reductions). Loss, every gradient and the parameters after 2 AdamW steps (the second
simulated from updated parameters) equal the single-device model's (rel. 1e-4, fp32; after one step for
the model code this project did not write, to keep the suite's time) on pp=2 x dp=2, pp=2 x tp=2 (two
stages per rank) and pp=4, on autopar's GPT (tied) and LLaMA and on model code this project did not
write (torchtitan-style Llama, Hugging Face GPT-2 with its tied head). The simulator runs every
schedule in GPipe's order (the sums are the same); the stage layouts differ: one stage per rank, or
two (Interleaved1F1B's loop placement, ZBVZeroBubble's V placement (GPT at 8 layers), its backward run
in its split input- and weight-gradient parts). Every step, the collectives and transfers each simulated
device ran equal the plan's prediction (count and bytes). The whole matrix (every schedule x mesh x
GPT/LLaMA at 8 layers, 3 AdamW steps) is ``benchmarks/pipeline_parity.py``, which runs the same
``_pipeline_parity.parity``."""

from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.errors import ArgumentError
from autopar.ir.capture import capture
from autopar.runtime.pipeline.schedule import micro_slices
from autopar.runtime.pipeline.loss import loss_weights
from autopar.runtime.pipeline.state import refuse_buffer_updates
from _corpus import CORPUS
from _pipeline_mesh_helpers import build, rel
from _pipeline_parity import parity

CASES = [
    ("gpt", "1F1B", (("pp", 2), ("dp", 2))),
    ("llama", "Interleaved1F1B", (("pp", 2), ("tp", 2))),
    ("llama", "GPipe", (("pp", 4),)),
    ("titan_llama", "1F1B", (("pp", 2), ("dp", 2))),
    ("hf_gpt2", "GPipe", (("pp", 2), ("dp", 2))),
    ("gpt8", "ZBVZeroBubble", (("pp", 2), ("dp", 2))),
    ("llama", "ZBVZeroBubble", (("pp", 2), ("tp", 2))),  # 8 layers: benchmarks/pipeline_parity.py
    # one sample per micro-batch: the tied weight's gradient needs no reduction on tp, and its two
    # contributions are summed per step (they used to be sent back across the boundary: refused)
    ("gpt_mb1", "GPipe", (("pp", 2), ("tp", 2))),
]


def _model(name: str):
    torch.manual_seed(0)
    if name in CORPUS:
        return CORPUS[name]()  # two layers: one per stage
    if name == "gpt_mb1":
        model, inputs = build("gpt", 4, 4)
    else:
        model, inputs = build(name.rstrip("8"), 8 if name.endswith("8") else 4, 8)
    return model, inputs, {}


@functools.cache
def _plan(name: str, schedule: str, axes: tuple, microbatches: int, wrapped: bool = False):
    """The pinned plan of ``name`` (or of it under ``_Doubled``), made once per module: the GPT case
    and the unequal-target tests share it (planning depends on shapes, not on the targets' values)."""
    model, inputs, kw = _model(name)
    if wrapped:
        model = _Doubled(model)
    return autopar.plan(model, autopar.Mesh(dict(axes), device="cpu"), inputs, kw,
                        pipeline={"schedule": schedule, "microbatches": microbatches}, progress=False)


@pytest.mark.parametrize("name,schedule,axes", CASES, ids=[f"{n}-{s}-{'x'.join(f'{a}{k}' for a, k in ax)}"
                                                          for n, s, ax in CASES])
def test_simulated_pipeline_matches_single_device(name, schedule, axes):
    model, inputs, kw = _model(name)
    ref, _, _ = _model(name)
    plan = _plan(name, schedule, axes, 4 if name[:3] in ("gpt", "lla") else 2)
    assert plan.pipeline.schedule == schedule
    # two steps: the second simulates from the updated parameters; model code not ours: one step (loss,
    # gradients, the update)
    out = parity(model, ref, inputs, kw, plan, steps=1 if name in CORPUS else 2)
    assert out["loss"] <= 1e-4 and out["grad"] <= 1e-4 and out["param"] <= 1e-4, out
    assert out["differences"] == []  # executed collectives and transfers equal the predicted ones
    assert out["collectives"] > 0 or len(axes) == 1
    assert out["transfers"] > 0


def _uneven(inputs):
    """The inputs with most of the first sample's targets ignored (-100, cross-entropy's default
    ignore_index): the first micro-batch counts far fewer targets than the others."""
    tokens, targets = inputs
    targets = targets.clone()
    targets[0, : targets.shape[1] - 2] = -100
    return tokens, targets


def test_simulated_pipeline_loss_is_the_whole_batch_mean_with_unequal_target_counts():
    """The step's loss is the cross-entropy mean over the whole batch's counted targets (not the mean
    of the micro-batch means), and its gradients the single-device model's: each micro-batch's loss
    weighs by its counted targets (``runtime/pipeline/loss.py``)."""
    model, inputs = build("gpt", 4, 8)
    ref, _ = build("gpt", 4, 8)
    other, _ = build("gpt", 4, 8)
    inputs = _uneven(inputs)
    plan = _plan(*CASES[0], 4)  # the GPT case's plan: the same model, shapes and pins
    loss, grads = autopar.simulate(model, plan, inputs)
    r = ref(*inputs)
    r.backward()
    # the mean of micro-batch means differs (loss and gradients): the case is real
    means = torch.stack([other(*[t[k:k + 2] for t in inputs]) for k in range(0, 8, 2)]).mean()
    means.backward()
    assert rel(means, r) > 1e-4
    assert max(rel(p.grad, q.grad) for p, q in zip(other.parameters(), ref.parameters())) > 1e-2
    assert rel(loss, r) <= 1e-6
    for n, p in ref.named_parameters():
        assert rel(grads[n], p.grad) <= 1e-4, n


class _Doubled(torch.nn.Module):
    """A loss computed from a cross-entropy mean (twice it): not weighed, refused when uneven."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, tokens, targets):
        return 2.0 * self.inner(tokens, targets)


def test_simulated_pipeline_refuses_a_loss_it_cannot_weigh_with_unequal_target_counts():
    inner, inputs = build("gpt", 4, 8)
    model = _Doubled(inner)
    parts = micro_slices(inputs, {}, 8, 4)
    graph = capture(model, tuple(parts[0][f"input:{k}"] for k in range(2)), {}, training=True)
    assert loss_weights(graph, parts, {}) == [0.25] * 4  # equal counts: the mean of the means
    plan = _plan(*CASES[0], 4, wrapped=True)
    with pytest.raises(ArgumentError, match="count different numbers of targets"):
        autopar.simulate(model, plan, _uneven(inputs))


class _Counted(torch.nn.Module):
    """A model whose forward updates a buffer (a step counter): once per call on one device, once per
    micro-batch under a pipeline."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, tokens, targets):
        self.calls.add_(1)
        return self.inner(tokens, targets)


class _Normed(torch.nn.Module):
    """BatchNorm in training mode: its running statistics are buffer updates."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x)).square().mean()


@pytest.mark.parametrize("axes", [{"pp": 2}, {"pp": 2, "dp": 2}], ids=["pp2", "pp2xdp2"])
def test_simulated_pipeline_refuses_buffer_updates_by_name(axes):
    """Buffer updates are not applied by the pipelined runtimes: refused with the buffer's name and the
    reason (``runtime.pipeline.state.refuse_buffer_updates``, the check the gloo runtimes make at build),
    never run with the buffers left at their old values; the pipeline alone used to fail in lowering
    with an IndexError."""
    inner, inputs = build("gpt", 2, 8)
    model = _Counted(inner)
    plan = autopar.plan(model, autopar.Mesh(axes, device="cpu"), inputs,
                        pipeline={"schedule": "GPipe", "microbatches": 2}, progress=False)
    with pytest.raises(ArgumentError, match="updates buffer\\(s\\) calls in its forward.*does not apply buffer updates"):
        autopar.simulate(model, plan, inputs)
    assert model.calls.item() == 0  # refused before anything ran
    graph = capture(_Normed(), (torch.randn(8, 4),), {}, training=True)
    with pytest.raises(ArgumentError, match="bn.num_batches_tracked, bn.running_mean, bn.running_var"):
        refuse_buffer_updates(graph, "here")
