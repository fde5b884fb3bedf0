"""What ranks run in tests/test_dcp.py's DCP test across pipelined and unpipelined layouts (a
module of its own: spawned pool workers import it without pytest).

One model trains with AdamW under one layout, saves its parameters and optimizer state with
``torch.distributed.checkpoint`` (``get_optimizer_state_dict``, the user-facing way of the
unpipelined module), and a model built from another seed loads them under another layout. Each
rank returns plain values: the worst difference between what was saved and what was loaded
(whole tensors, exact), and the relative error of the step taken after loading against the
single-device model trained alongside.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

LR, EPS = 1e-2, 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    n = b.norm().item()
    return (a - b).norm().item() / (n if n > 0 else 1.0)


def _step(model, opt, args) -> None:
    model(*args).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective on its mesh); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _whole(pm, opt) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds and its AdamW state, whole, by name (``name``, ``name:exp_avg``,
    ``name:exp_avg_sq``, ``name:step``): collectives on each parameter's mesh, in the same order on
    every rank holding it."""
    out = {}
    for name, p in pm.named_parameters():
        out[name] = _full(p).detach().clone()
        st = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                out[f"{name}:{k}"] = _full(st[k]).clone()
        if "step" in st:
            out[f"{name}:step"] = st["step"].detach().clone()
    return out


def _exact(got: dict, want: dict) -> float:
    """The largest difference between ``got`` and ``want`` over ``want``'s names (inf if one is missing)."""
    worst = 0.0
    for k, v in want.items():
        if k not in got or got[k].shape != v.shape:
            return float("inf")
        worst = max(worst, (got[k].double() - v.double()).abs().max().item() if v.numel() else 0.0)
    return worst


def _vs_reference(pm, ref) -> float:
    """The worst relative error of this rank's parameters against the single-device model's."""
    refp = dict(ref.named_parameters())
    return max(_rel(_full(p), refp[n]) for n, p in pm.named_parameters())


def _options(flat: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=flat)


def _save(pm, opt, where: str, flat: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"model": pm.state_dict(), "optim": get_optimizer_state_dict(pm, opt, options=_options(flat))},
             checkpoint_id=where)


def _load(pm, opt, where: str, flat: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    sd = {"model": pm.state_dict(), "optim": get_optimizer_state_dict(pm, opt, options=_options(flat))}
    dcp.load(sd, checkpoint_id=where)
    set_optimizer_state_dict(pm, opt, sd["optim"], options=_options(flat))


def across_layouts(build, pp_axes: dict, plan_text: str, others: list, alone_text, root: str,
                   flat: bool = False) -> dict:
    """On 4 gloo ranks, next to the single-device model (AdamW, the same batch every step):

    1. saved at ``pp_axes`` (the pipelined plan ``plan_text``) after 2 steps;
    2. loaded under each of ``others`` (``(name, axes, recipe)``, unpipelined plans) into a model of
       other weights, stepped once; the first of them then saved;
    3. and back: that checkpoint loaded at ``pp_axes`` (the module of 1, after a single-device state
       dict was loaded into it), stepped once;
    4. the pipeline axis alone (``alone_text``, pp=2, two pipelines of ranks (0, 1) and (2, 3)): the
       same checkpoint loaded, stepped once, saved, and loaded under the first of ``others`` again.

    ``build(seed)`` -> (model, args). Each load is compared with what was saved (exact), each step
    with the single-device model's. Without ``alone_text`` step 4 is left out; ``flat``: the optimizer
    state in torch's flattened form (``flatten_optimizer_state_dict``, its form for pipelines)."""
    import autopar
    from autopar.api import pipelined

    out: dict = {"rank": dist.get_rank()}
    ref, args = build(0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    plan = autopar.Plan.from_dict(json.loads(plan_text))

    model, _ = build(0)
    pm = autopar.compile(model, autopar.Mesh(pp_axes, device="cpu"), args, plan=plan)
    out["pp_names"] = [n for n, _ in pm.named_parameters()]
    out["pp_keys"] = sorted(pm.state_dict())
    out["model_keys"] = sorted(model.state_dict())  # the model object itself holds no stale copy either
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    for _ in range(2):
        _step(pm, opt, args)
        _step(ref, ref_opt, args)
    out["pp_vs_ref"] = _vs_reference(pm, ref)
    saved = _whole(pm, opt)
    out["pp_state_names"] = sorted(saved)
    _save(pm, opt, f"{root}/pp", flat)
    _step(ref, ref_opt, args)  # what one step after loading must give

    first = None
    for name, axes, recipe in others:
        m, _ = build(1)  # other weights: only the checkpoint can make them equal
        um = autopar.compile(m, autopar.Mesh(axes, device="cpu"), args, recipe=recipe)
        uopt = torch.optim.AdamW(um.parameters(), lr=LR, eps=EPS)
        _step(um, uopt, args)  # state of its own, to be overwritten
        _load(um, uopt, f"{root}/pp", flat)
        out[f"{name}_loaded"] = _exact(_whole(um, uopt), saved)
        out[f"{name}_placements"] = sorted({str(v.placements) for v in um.state_dict().values()})
        _step(um, uopt, args)
        out[f"{name}_step_vs_ref"] = _vs_reference(um, ref)
        if first is None:  # and back: saved unpipelined, loaded pipelined
            first = (name, um, uopt)
            back = _whole(um, uopt)
            _save(um, uopt, f"{root}/{name}", flat)
    ref_back = {k: v.clone() for k, v in ref.state_dict().items()}
    _step(ref, ref_opt, args)

    # a single-device state dict (every name) loads on every pipeline rank
    pm.load_state_dict(ref_back)
    out["single_device_load"] = max(_rel(p.full_tensor(), ref_back[n]) for n, p in pm.named_parameters())
    _load(pm, opt, f"{root}/{first[0]}", flat)
    held = dict(pm.named_parameters())
    out["back_loaded"] = _exact(_whole(pm, opt), {k: v for k, v in back.items() if k.split(":")[0] in held})
    _step(pm, opt, args)
    out["back_step_vs_ref"] = _vs_reference(pm, ref)

    if alone_text is None:
        return out
    # the pipeline axis alone: whole tensors, each rank the parameters of its stage
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    m, _ = build(2)
    alone = pipelined(m, autopar.Plan.from_dict(json.loads(alone_text)), args, group=pairs[dist.get_rank() // 2])
    out["alone_keys"] = sorted(alone.state_dict())
    aopt = torch.optim.AdamW(alone.parameters(), lr=LR, eps=EPS)
    _step(alone, aopt, args)
    _load(alone, aopt, f"{root}/{first[0]}")
    held = dict(alone.named_parameters())
    out["alone_loaded"] = _exact(_whole(alone, aopt), {k: v for k, v in back.items() if k.split(":")[0] in held})
    _step(alone, aopt, args)
    out["alone_step_vs_ref"] = _vs_reference(alone, ref)
    saved = _whole(alone, aopt)
    _save(alone, aopt, f"{root}/alone")
    _, um, uopt = first
    _load(um, uopt, f"{root}/alone")
    out["alone_to_unpipelined"] = _exact(_whole(um, uopt), saved)
    return out


def titan(seed: int):
    """The torchtitan-style Llama of tests/_corpus.py (untied) with weights from ``seed``, and its inputs."""
    from _corpus import titan_llama

    torch.manual_seed(seed)
    model, args, _ = titan_llama()
    return model, args


def gpt(seed: int):
    """The tiny GPT (tied embedding and head) with weights from ``seed``, and its inputs."""
    from autopar.models import make

    torch.manual_seed(seed)
    return make("gpt", "tiny", batch=8, seq=16)
