"""Valid plan files for the plan-file tests: a tiny MLP planned on a (dp=2, tp=2) cpu mesh, made once
per test session; ``tiny_mlp`` builds that model (or one of another width or batch)."""

from __future__ import annotations

import functools

AXES = {"dp": 2, "tp": 2}


def tiny_mlp(hidden: int = 32, batch: int = 4):
    """``(model, example_inputs)``: the MLP zoo's tiny preset, ``hidden`` wide, ``batch`` rows."""
    import torch

    from autopar.models import make

    torch.manual_seed(0)
    return make("mlp", "tiny", batch=batch, hidden_dim=hidden)


@functools.cache
def tiny_plan_json(hidden: int = 32) -> str:
    """The canonical JSON of the tiny MLP's searched plan on ``AXES``."""
    import autopar

    model, inputs = tiny_mlp(hidden)
    plan = autopar.plan(model, autopar.Mesh(AXES, device="cpu"), inputs, deterministic_time=0.5, progress=False)
    return plan.to_json()


def compile_errors_on_rank(plan_paths: list, axes: dict) -> list:
    """On each rank of a launch: ``autopar.compile`` of the tiny MLP with each saved plan on a mesh
    of ``axes``, and the error each raised (``"compiled"`` if none)."""
    import autopar

    out = []
    for path in plan_paths:
        model, inputs = tiny_mlp()
        try:
            autopar.compile(model, autopar.Mesh(axes, device="cpu"), inputs, plan=path)
            out.append("compiled")
        except autopar.AutoparError as e:
            out.append(f"{type(e).__name__}: {e}")
    return out
