"""What gloo ranks run in tests/test_dropless.py (a module of its own, so spawned ranks import it
without pytest)."""

from __future__ import annotations

import json

import torch


def build():
    """The zoo's dropless MoE (grouped experts, bf16, a shared expert) with expert 0 taking every
    token of the first layer and the last expert none; the same on every process."""
    from autopar.models import make

    torch.manual_seed(0)
    model, args = make("moe_dropless", "tiny", batch=4, experts="grouped_mm", n_shared=1, n_layers=2,
                       dtype=torch.bfloat16)
    layer = model.layers[0]
    with torch.no_grad():
        c = torch.full_like(layer.norm.bias, 0.5)
        layer.norm.bias.copy_(c)
        layer.moe.router.weight[0].copy_(20 * c)
        layer.moe.router.weight[-1].copy_(-20 * c)
    return model, args


def step_on_rank(axes: tuple, text: str) -> dict:
    """On every gloo rank: compile under the plan, run one step; the loss, every whole gradient and
    the kinds of collectives that ran."""
    import autopar

    plan = autopar.Plan.from_dict(json.loads(text))
    model, args = build()
    pm = autopar.compile(model, autopar.Mesh(dict(axes), device="cpu"), args, plan=plan)
    with pm.record_collectives() as ran:
        loss = pm(*args)
        loss.backward()
    grads = {name: p.grad.full_tensor().float() for name, p in pm.module.named_parameters()}
    return {"loss": float(loss), "grads": grads, "kinds": sorted({r.kind for r in ran})}
