"""What ranks run in tests/test_gloo_groups.py (a module of its own, so spawned ranks import it
without pytest)."""

from __future__ import annotations

import json

import torch


def program_groups_on_rank(cases: list) -> list:
    """For each ``(axes, plan_text)``: compile the tiny MLP, run one training step, and report the
    process group of each mesh axis the program's collectives use (ranks, gloo workers, timeout)."""
    import torch.distributed as dist

    import autopar
    from _parity import build

    out = []
    for axes, text in cases:
        model, args = build("mlp")
        pm = autopar.compile(model, autopar.Mesh(dict(axes), device="cpu"), args,
                             plan=autopar.Plan.from_dict(json.loads(text)))
        pm(*args).backward()
        groups = []
        for g in pm._comm.groups:
            backend = g._get_backend(torch.device("cpu"))
            groups.append({"ranks": dist.get_process_group_ranks(g), "threads": backend.options._threads,
                           "world": g is dist.group.WORLD, "name": g.group_name,
                           "timeout": backend.options._timeout.total_seconds()})
        world = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        out.append({"groups": groups, "world_timeout": world,
                    "grads": all(p.grad is not None for p in pm.parameters())})
    return out
