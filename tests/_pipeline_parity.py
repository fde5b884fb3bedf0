"""One pipelined plan's parity run in the simulator, next to the single-device model: shared by
``tests/test_pipeline_run_sim.py`` and ``benchmarks/pipeline_parity.py`` (the whole matrix of
schedules x meshes x models, which the suite cannot afford)."""

from __future__ import annotations

from collections import Counter

import torch

import autopar
from autopar.runtime.accounting import compare
from _pipeline_mesh_helpers import build, rel

#: the schedules torch 2.13 runs (each accepts 4 micro-batches on 2 and 4 ranks: 1F1B needs m >= pp,
#: Interleaved1F1B m a multiple of max(1, m // pp), ZBVZeroBubble two stages per rank, any m)
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")
MESHES = {"pp2xdp2": {"pp": 2, "dp": 2}, "pp2xtp2": {"pp": 2, "tp": 2}, "pp4": {"pp": 4}}


def loss_of(out) -> torch.Tensor:
    """The loss of a model's output (a Hugging Face output's ``.loss``, or the output itself)."""
    return getattr(out, "loss", out)


def parity(model: torch.nn.Module, ref: torch.nn.Module, inputs: tuple, kwargs: dict, plan, steps: int = 3,
           lr: float = 1e-2) -> dict:
    """``steps`` AdamW steps of ``autopar.simulate(model, plan, ...)`` next to ``ref`` (the same model
    with the same weights) on one device. Returns the worst relative errors over the steps of the loss
    (``loss``) and of every gradient (``grad``, its name ``grad_at``), of every parameter after the last
    step (``param``, ``param_at``), and what the collectives and transfers that ran on each simulated
    device differ from the predicted ones, per step (``differences``: empty when equal in count and
    bytes; a pipelined device holds every stage of its stage-mesh coordinates, ``runtime.pipeline.simulate``),
    with the counts of the first step (``collectives``, ``transfers``: summed over devices; ``kinds``: the
    collectives per kind).
    Collectives on a one-device axis are left out (they move nothing)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6)
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr, eps=1e-6)
    refp = dict(ref.named_parameters())
    mine = dict(model.named_parameters())
    out = {"loss": 0.0, "grad": 0.0, "grad_at": "", "param": 0.0, "param_at": "", "differences": []}
    # a pipeline alone plans its stages on a one-device ``dp`` axis: what its plan lists there moves
    # nothing (the pipeline axis alone runs eager stages, no collective), so it is not compared
    alone = {a for a, k in zip(plan.axis_names, plan.mesh_shape) if k == 1} if plan.pipeline else set()
    for step in range(steps):
        trace: dict = {}
        predicted: dict = {}
        loss, grads = autopar.simulate(model, plan, inputs, kwargs, trace=trace, predicted=predicted)
        r = loss_of(ref(*inputs, **kwargs))
        r.backward()
        out["loss"] = max(out["loss"], rel(loss, r))
        for name, p in refp.items():
            e = rel(grads[name], p.grad)
            if e >= out["grad"]:
                out["grad"], out["grad_at"] = e, name
            mine[name].grad = grads[name].clone()
        for c in sorted(trace):
            ran = [e for e in trace[c] if e.axis not in alone]
            want = Counter({k: v for k, v in predicted[c].items() if k[1] not in alone})
            out["differences"] += [f"step {step} device {c}: {d}" for d in compare(want, ran)]
        if step == 0:
            records = [e for c in trace for e in trace[c] if e.axis not in alone]
            out["transfers"] = sum(e.kind in ("send", "recv") for e in records)
            out["collectives"] = len(records) - out["transfers"]
            out["kinds"] = dict(sorted(Counter(e.kind for e in records if e.kind not in ("send", "recv")).items()))
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    for name, p in refp.items():
        e = rel(mine[name], p)
        if e >= out["param"]:
            out["param"], out["param_at"] = e, name
    return out


def matrix_case(family: str, schedule: str, mesh: str, n_layers: int = 8, batch: int = 8, microbatches: int = 4,
                steps: int = 3) -> dict:
    """Plan ``family`` (autopar's ``gpt``, tied, or ``llama``) at ``n_layers`` on ``MESHES[mesh]`` with
    ``schedule`` pinned, and run ``parity``; also the plan's stage layout."""
    model, inputs = build(family, n_layers, batch)
    ref, _ = build(family, n_layers, batch)
    plan = autopar.plan(model, autopar.Mesh(MESHES[mesh], device="cpu"), inputs,
                        pipeline={"schedule": schedule, "microbatches": microbatches}, progress=False)
    assert plan.pipeline.schedule == schedule, plan.pipeline.schedule
    out = parity(model, ref, inputs, {}, plan, steps)
    out["stage_ranks"] = list(plan.pipeline.stage_ranks)
    return out


__all__ = ["MESHES", "SCHEDULES", "loss_of", "matrix_case", "parity"]
