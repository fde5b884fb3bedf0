"""What the ranks of tests/test_replan.py run (spawned by ``autopar.launch``, which imports this
module by name): train under one plan and save with torch.distributed.checkpoint, then load under
another plan on fewer ranks and go on training. Only torch at module level (autopar inside)."""

from __future__ import annotations

import json

import torch

SEQ, BATCH, LR = 16, 24, 1e-2


def gpt(seed: int = 0):
    """The tiny GPT the test plans and trains (a batch of 24 splits over 8 and over 6 devices)."""
    from autopar.models import make

    torch.manual_seed(seed)
    return make("gpt", "tiny", batch=BATCH, seq=SEQ)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


def _step(module, opt, args) -> float:
    loss = module(*args)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def save_under(plan_json: str, ckpt: str) -> dict:
    """One AdamW step under ``plan_json`` on every rank, then model and optimizer state saved to ``ckpt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    import autopar

    plan = autopar.Plan.from_dict(json.loads(plan_json))
    model, args = gpt(0)
    pm = autopar.compile(model, autopar.Mesh(plan.run_axes, device="cpu"), args, plan=plan)
    opt = _optimizer(pm.parameters())
    loss = _step(pm, opt, args)
    dcp.save({"model": pm.state_dict(), "optim": get_optimizer_state_dict(pm, opt)}, checkpoint_id=ckpt)
    return {"loss": loss, "params": _whole(pm),
            "placements": sorted({str(v.placements) for v in pm.state_dict().values()})}


def _whole(pm) -> dict:
    """Every parameter whole (a collective: every rank calls it), copied: a replicated one's
    ``full_tensor`` is its own storage, which the next step updates."""
    return {n: p.full_tensor().detach().clone() for n, p in pm.module.named_parameters()}


def load_under(plan_json: str, ckpt: str) -> dict:
    """A model of other weights under ``plan_json`` (fewer ranks) loads ``ckpt`` and trains one more
    step: its loss and its whole parameters after that step come back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    import autopar

    plan = autopar.Plan.from_dict(json.loads(plan_json))
    model, args = gpt(1)  # other weights: only the checkpoint makes them the saved ones
    pm = autopar.compile(model, autopar.Mesh(plan.run_axes, device="cpu"), args, plan=plan)
    opt = _optimizer(pm.parameters())
    _step(pm, opt, args)  # optimizer state of its own, to be overwritten
    state = {"model": pm.state_dict(), "optim": get_optimizer_state_dict(pm, opt)}
    dcp.load(state, checkpoint_id=ckpt)
    set_optimizer_state_dict(pm, opt, state["optim"])
    loaded = _whole(pm)
    loss = _step(pm, opt, args)
    return {"loss": loss, "loaded": loaded, "params": _whole(pm),
            "placements": sorted({str(v.placements) for v in pm.state_dict().values()})}


def single_device(steps: int) -> tuple[list[float], dict]:
    """The same model trained on one device: the losses and the parameters after ``steps`` steps."""
    model, args = gpt(0)
    opt = _optimizer(model.parameters())
    losses = [_step(model, opt, args) for _ in range(steps)]
    return losses, {n: p.detach() for n, p in model.named_parameters()}
