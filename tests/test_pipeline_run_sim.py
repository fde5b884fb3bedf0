"""``autopar.simulate`` of pipelined plans (``runtime/pipeline_sim.py``): every stage-mesh device a thread
running the pipelined runtime's cut of the plan's lowered program (static part, per-micro-batch stage
slices, per-step reductions). Loss, every gradient and the parameters after 3 AdamW steps equal the
single-device model's (rel. 1e-4, fp32) on pp=2 x dp=2, pp=2 x tp=2 (two stages per rank) and pp=4, on
autopar's GPT (tied) and LLaMA and on model code this project did not write (torchtitan-style Llama,
Hugging Face GPT-2 with its tied head). The simulator runs every schedule in GPipe's order (the sums are
the same); the stage layouts differ: one stage per rank, or two (Interleaved1F1B's loop placement)."""

from __future__ import annotations

import pytest
import torch

import autopar
from _corpus import CORPUS
from _pipeline_mesh_helpers import build, rel

CASES = [
    ("gpt", "1F1B", (("pp", 2), ("dp", 2))),
    ("llama", "Interleaved1F1B", (("pp", 2), ("tp", 2))),
    ("llama", "GPipe", (("pp", 4),)),
    ("titan_llama", "1F1B", (("pp", 2), ("dp", 2))),
    ("hf_gpt2", "GPipe", (("pp", 2), ("dp", 2))),
]


def _model(name: str):
    torch.manual_seed(0)
    if name in CORPUS:
        return CORPUS[name]()  # two layers: one per stage
    model, inputs = build(name, 4, 8)
    return model, inputs, {}


def _loss(out):
    return getattr(out, "loss", out)


@pytest.mark.parametrize("name,schedule,axes", CASES, ids=[f"{n}-{s}-{'x'.join(f'{a}{k}' for a, k in ax)}"
                                                          for n, s, ax in CASES])
def test_simulated_pipeline_matches_single_device(name, schedule, axes):
    model, inputs, kw = _model(name)
    ref, _, _ = _model(name)
    plan = autopar.plan(model, autopar.Mesh(dict(axes), device="cpu"), inputs, kw,
                        pipeline={"schedule": schedule, "microbatches": 4 if name in ("gpt", "llama") else 2},
                        progress=False)
    assert plan.pipeline["schedule"] == schedule
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    names = [n for n, _ in ref.named_parameters()]
    for _ in range(3):
        loss, grads = autopar.simulate(model, plan, inputs, kw)
        r = _loss(ref(*inputs, **kw))
        r.backward()
        assert rel(loss, r) <= 1e-4
        for n, p in zip(names, model.parameters()):
            assert rel(grads[n], dict(ref.named_parameters())[n].grad) <= 1e-4, n
            p.grad = grads[n].clone()
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    mine = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        assert rel(mine[n], p) <= 1e-4, n
