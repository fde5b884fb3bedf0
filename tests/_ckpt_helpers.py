"""Functions that ranks run in tests/test_dcp.py (spawned pool workers import this module).

It imports only torch at module level (autopar inside the functions), so a worker pays for it
only when a test runs. Every function runs on all ranks of the pool's 4-rank gloo group and
returns plain Python values (floats, strings), which the parent asserts on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

SEQ, BATCH = 16, 8


def _gpt(seed: int, device=None):
    from autopar.models import make

    torch.manual_seed(seed)
    return make("gpt", "tiny", batch=BATCH, seq=SEQ, device=device)


def _compile(model, axes: dict, args, recipe: str):
    import autopar

    return autopar.compile(model, autopar.Mesh(axes, device="cpu"), args, recipe=recipe)


def _step(pm, opt, args) -> float:
    loss = pm(*args)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _full(pm) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective: all ranks call it in the same order)."""
    return {n: p.full_tensor().detach().clone() for n, p in pm.module.named_parameters()}


def reshard_through_dcp(ckpt_dir: str) -> dict:
    """Plan A (FSDP on (4,)) trains one AdamW step and saves model and optimizer state with DCP;
    plan B (Megatron TP on (2, 2)), built from another seed, loads both. The parameters, the next
    loss and one more AdamW step must agree with plan A's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, set_optimizer_state_dict)
    from torch.distributed.tensor import DTensor

    out: dict = {}
    model, args = _gpt(0)
    pm = _compile(model, {"dp": 4}, args, "fsdp")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-6)
    out["a_loss0"] = _step(pm, opt, args)
    state = pm.state_dict()
    out["a_all_dtensors"] = all(isinstance(v, DTensor) for v in state.values())
    out["a_placements"] = {k: str(v.placements) for k, v in state.items()}
    dcp.save({"model": state, "optim": get_optimizer_state_dict(pm, opt)}, checkpoint_id=ckpt_dir)
    full_a = _full(pm)
    out["a_loss1"] = _step(pm, opt, args)  # the step B must reproduce
    full_a2 = _full(pm)

    model_b, _ = _gpt(1)  # other weights: only the checkpoint can make them equal
    pm_b = _compile(model_b, {"dp": 2, "tp": 2}, args, "megatron_tp")
    opt_b = torch.optim.AdamW(pm_b.parameters(), lr=1e-2, eps=1e-6)
    _step(pm_b, opt_b, args)  # the optimizer has state of its own, to be overwritten
    out["b_placements"] = {k: str(v.placements) for k, v in pm_b.state_dict().items()}
    before = _full(pm_b)
    out["b_differs_before"] = max((before[n] - full_a[n]).abs().max().item() for n in full_a)
    sd = {"model": pm_b.state_dict(), "optim": get_optimizer_state_dict(pm_b, opt_b)}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    set_optimizer_state_dict(pm_b, opt_b, sd["optim"])
    full_b = _full(pm_b)
    out["param_err"] = {n: (full_b[n] - full_a[n]).abs().max().item() for n in full_a}
    out["b_loss1"] = _step(pm_b, opt_b, args)
    full_b2 = _full(pm_b)
    out["param_err_after_step"] = max((full_b2[n] - full_a2[n]).abs().max().item() for n in full_a2)
    out["tied"] = pm_b.module.lm_head.weight is pm_b.module.wte.weight
    return out


class _MetaBuffer(nn.Module):
    """A meta buffer and no ``reset_parameters`` on its module: nothing can rebuild ``scale``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x, y):
        return ((self.lin(x) * self.scale - y) ** 2).mean()


class _RebuildableBuffer(_MetaBuffer):
    """The same, with a ``reset_parameters`` on the root: by the time ``scale`` is rebuilt, ``lin``'s
    parameters are already this rank's DTensors, which the rebuild must not touch."""

    def reset_parameters(self):
        nn.init.constant_(self.scale, 2.0)
        self.lin.reset_parameters()


def materialize_meta() -> dict:
    """A GPT built on meta compiles and trains; every rank holds the same, finite, real values.
    Then a model whose meta buffer cannot be rebuilt fails with an error that names it."""
    from autopar.runtime.materialize import MaterializeError

    out: dict = {}
    model, args = _gpt(0, device="meta")
    assert all(p.is_meta for p in model.parameters())
    pm = _compile(model, {"dp": 4}, args, "fsdp")
    params = dict(pm.module.named_parameters())
    out["meta_left"] = [n for n, p in params.items() if p.is_meta or p.to_local().is_meta]
    full = _full(pm)
    out["finite"] = all(bool(torch.isfinite(t).all()) for t in full.values())
    out["nonzero"] = all(t.abs().sum().item() > 0 for n, t in full.items() if n.endswith("weight"))
    out["digest"] = {n: _digest(t) for n, t in full.items()}
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-6)
    out["losses"] = [_step(pm, opt, args) for _ in range(2)]

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    with torch.device("meta"):
        good = _RebuildableBuffer()
    pm = _compile(good, {"dp": 4}, (x, y), "fsdp")
    out["rebuilt_scale"] = pm.module.scale.full_tensor().tolist()
    out["rebuilt_loss"] = pm(x, y).item()

    with torch.device("meta"):
        bad = _MetaBuffer()
    try:
        _compile(bad, {"dp": 4}, (x, y), "ddp")
        out["error"] = None
    except MaterializeError as e:
        out["error"] = str(e)
    return out


def hf_meta_models() -> dict:
    """Hugging Face GPT-2 and LLaMA (tiny, every dropout rate 0.1) built on meta compile (FSDP on
    (4,)) and train three AdamW steps: no tensor is left on meta, every rank holds the same finite
    values and draws the same masks (the same losses), the loss goes down."""
    import autopar
    from test_materialize import hf_model  # the parent's tests/ is on sys.path

    out: dict = {}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (BATCH, SEQ), generator=g)
    for name in ("gpt2", "llama"):
        model = hf_model(name, "meta", dropout=0.1)
        model.config._attn_implementation = "sdpa"
        pm = autopar.compile(model, autopar.Mesh({"dp": 4}, device="cpu"), (), dict(input_ids=ids, labels=ids),
                             recipe="fsdp")
        full = _full(pm)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-6)
        losses = []
        for _ in range(3):
            loss = pm(input_ids=ids, labels=ids).loss  # the model's own ModelOutput
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        out[name] = {
            "meta_left": [n for n, t in pm.module.state_dict().items() if t.is_meta or t.to_local().is_meta],
            "finite": all(bool(torch.isfinite(t).all()) for t in full.values()),
            "digest": {n: _digest(t) for n, t in full.items()},
            "losses": losses,
            "random": pm.program.random is not None,  # dropout is drawn, not dropped
        }
    return out


def meta_digests() -> dict:
    """What ``materialize`` rebuilds for the meta GPT, computed in one process (no group)."""
    from autopar.runtime.materialize import full_value

    model, _ = _gpt(0, device="meta")
    return {n: _digest(full_value(model, n, p)) for n, p in model.named_parameters()}


def _digest(t: torch.Tensor) -> float:
    return float(t.double().sum()) + float((t.double() ** 2).sum())


def optimizer_state() -> dict:
    """torch.optim.AdamW on a ParallelModule: its state is DTensors placed like the parameters, its
    state_dict round-trips into a fresh optimizer, and stepping that one goes on where it left off."""
    from torch.distributed.tensor import DTensor

    model, args = _gpt(0)
    pm = _compile(model, {"dp": 2, "tp": 2}, args, "megatron_tp")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-6)
    losses = [_step(pm, opt, args) for _ in range(2)]
    sd = opt.state_dict()
    state_ok = []
    for p in pm.parameters():
        st = opt.state[p]
        state_ok.append(isinstance(st["exp_avg"], DTensor) and st["exp_avg"].placements == p.placements
                        and st["exp_avg_sq"].placements == p.placements and int(st["step"]) == 2)
    again = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-6)
    again.load_state_dict(sd)
    losses.append(_step(pm, again, args))
    steps = sorted({int(s["step"]) for s in again.state_dict()["state"].values()})
    return {"losses": losses, "state_ok": state_ok, "n_state": len(sd["state"]), "steps_after": steps,
            "n_params": len(list(pm.parameters())), "rank": dist.get_rank()}
