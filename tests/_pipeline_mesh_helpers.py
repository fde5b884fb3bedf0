"""What ranks run in tests/test_pipeline_run_mesh.py (a module of its own, so spawned ranks import it
without pytest): a pipelined plan with other mesh axes compiled, stepped with AdamW next to the
single-device model."""

from __future__ import annotations

import json

import torch

EPS, STEPS = 1e-6, 3


def build(family: str, n_layers: int, batch: int, seq=None):
    """A tiny model of ``family`` with fixed weights, and its inputs (``seq``: a longer sequence, LLaMA)."""
    from autopar import models

    torch.manual_seed(0)
    key = "n_layer" if family == "gpt" else "n_layers"
    longer = {} if seq is None else {"seq": seq, "max_seq_len": seq}
    return models.make(family, "tiny", batch=batch, **{key: n_layers}, **longer)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    n = b.norm().item()
    return (a - b).norm().item() / (n if n > 0 else 1.0)


def train_on_rank(family: str, n_layers: int, batch: int, axes: tuple, text: str, seq=None) -> dict:
    """On every gloo rank: ``autopar.compile`` the pipelined plan, take ``STEPS`` AdamW steps next to the
    single-device model; the worst relative errors of the loss, of every gradient this rank holds
    and of every parameter its stages read, the gradients' names, and the collectives of step 1."""
    import autopar

    plan = autopar.Plan.from_dict(json.loads(text))
    model, args = build(family, n_layers, batch, seq)
    ref, _ = build(family, n_layers, batch, seq)
    pm = autopar.compile(model, autopar.Mesh(dict(axes), device="cpu"), args, plan=plan)
    # the parameters its stages read (runtime.pipeline.state), in the model's order and names
    assert [n for n, _ in pm.named_parameters()] == [n for n, _ in ref.named_parameters()
                                                     if n in dict(pm.named_parameters())]
    assert all(hasattr(t, "placements") for t in pm.state_dict().values())  # DTensors, the model's names
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=EPS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=EPS)
    refp = dict(ref.named_parameters())
    out = {"loss": 0.0, "grad": 0.0, "param": 0.0, "held": []}
    for step in range(STEPS):
        with pm.record_collectives() as ran:
            loss = pm(*args)
            loss.backward()
        if step == 0:
            out["differences"] = pm.differences(ran)
            out["p2p"] = sorted({(e.kind, int(e.bytes)) for e in ran if e.kind in ("send", "recv")})
            out["n_p2p"] = sum(e.kind in ("send", "recv") for e in ran)
        r = ref(*args)
        r.backward()
        out["loss"] = max(out["loss"], rel(loss, r))
        held = []
        for name, p in model.named_parameters():
            if p.grad is not None:
                held.append(name)
                out["grad"] = max(out["grad"], rel(p.grad.full_tensor(), refp[name].grad))
        out["held"] = held
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    with torch.no_grad():  # a forward-only step (torch's eval of the schedule; ZBV: its forwards) at the trained weights
        out["eval"] = rel(pm(*args), ref(*args))
    for name, p in model.named_parameters():
        if name in out["held"]:
            out["param"] = max(out["param"], rel(p.full_tensor(), refp[name]))
    return out


def train_cases(cases: list) -> list:
    """``train_on_rank(*case)`` for each of ``cases`` in turn, on the same ranks (one launch: its
    processes' start-up and imports are paid once)."""
    return [train_on_rank(*case) for case in cases]
