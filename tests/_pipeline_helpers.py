"""What ranks run in tests/test_pipeline_run.py (a module of its own, so spawned ranks import it
without pytest)."""

from __future__ import annotations

import json

import torch


def build(family: str, n_layers: int = 4, batch: int = 8, seed: int = 0, uneven: bool = False):
    """A tiny model of ``family`` with fixed weights, and its inputs; ``uneven``: most of the first
    sample's targets ignored (-100), so the first micro-batch counts fewer targets than the others."""
    from autopar import models

    torch.manual_seed(seed)
    key = "n_layer" if family == "gpt" else "n_layers"
    model, (tokens, targets) = models.make(family, "tiny", batch=batch, **{key: n_layers})
    if uneven:
        targets = targets.clone()
        targets[0, : targets.shape[1] - 2] = -100
    return model, (tokens, targets)


def reference(family: str, n_layers: int, batch: int, uneven: bool = False):
    """Single-process loss and gradients (FQN -> tensor as lists)."""
    model, inputs = build(family, n_layers, batch, uneven=uneven)
    loss = model(*inputs)
    loss.backward()
    return float(loss.detach()), {k: p.grad.tolist() for k, p in model.named_parameters() if p.grad is not None}


def pipelined_step(family: str, n_layers: int, batch: int, plan_text: str, uneven: bool = False):
    """This rank's loss and the gradients it holds after one pipelined step, the loss of a forward-only
    step, and what the rank holds: how many of the parameters it dropped are still alive (referenced
    from anywhere), and the parameters two of its stages both give to torch's weight backward."""
    import gc
    import weakref

    import autopar
    from autopar.api import pipelined

    model, inputs = build(family, n_layers, batch, uneven=uneven)
    plan = autopar.Plan.from_dict(json.loads(plan_text))
    refs = {name: weakref.ref(p) for name, p in model.named_parameters()}
    pm = pipelined(model, plan, inputs)
    gc.collect()
    held = {name for name, _ in model.named_parameters()}
    alive = sorted(name for name, r in refs.items() if name not in held and r() is not None)
    names = {id(p): name for name, p in model.named_parameters()}
    per_stage = [{names.get(id(p), "(dropped)") for p in mod.held} for mod in pm._mods]
    shared = sorted(set.intersection(*per_stage)) if len(per_stage) > 1 else []
    loss = pm(*inputs)
    loss.backward()
    with torch.no_grad():  # a forward-only step (ZBV: its forward actions only, runtime.pipeline.schedule.run_schedule)
        again = pm(*inputs)
    grads = {k: p.grad.tolist() for k, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), float(again), grads, alive, shared


def pipelined_cases(cases: list) -> list:
    """``pipelined_step`` for each ``(family, n_layers, batch, plan_text[, uneven])``, in one process group."""
    return [pipelined_step(*case) for case in cases]
