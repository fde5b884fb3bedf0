"""Soak test: autopar programs alone, trained for many steps on 4 local gloo processes.

It exists to reproduce an intermittent crash (a rank dies with a segfault inside a gloo
collective's ``wait_tensor``, or aborts with ``malloc_consolidate(): unaligned fastbin chunk
detected``) that ``benchmarks/runtime.py`` hit in 2 of 3 full runs on 2026-11-30 and once at
723d711. No hand-written DDP or DTensor model runs here: at 36f095e, 150 steps of the four plans
below crashed rank 0 (segfault in an all-to-all's wait in the backward) after about 4 minutes;
60 steps passed once. Run it with ``PYTHONFAULTHANDLER=1`` to get the Python stack of the rank
that dies (glibc 2.34+ reads ``MALLOC_CHECK_`` only with ``LD_PRELOAD=libc_malloc_debug.so``).

The crash was torch 2.13's gloo backend (two worker threads of one group write its status string
without a lock; ``benchmarks/gloo_race_repro.py``): at 09d2950 this soak aborted within 90 s in 2
of 2 runs; since ``compile`` gives programs single-worker gloo groups, 150 steps passed twice and
300 steps once (281 to 694 s of training each, under load).

    PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/soak.py [--steps 150] [--every-axis]

Prints the seconds each rank trained, or the launch error naming the rank that died.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from runtime import FULL, build  # noqa: E402  (the runtime benchmark's model, seeded alike)

PLANS = (("megatron_tp", (("tp", 4),)), ("ddp", (("dp", 4),)), ("fsdp", (("dp", 4),)),
         ("megatron_tp", (("dp", 2), ("tp", 2))))
#: ``--every-axis`` adds FSDP x TP on (2, 2): parameter gathers issued a layer ahead on the data axis
#: and activation all-reduces on the tensor axis, several collectives in flight on every axis at once.
EVERY_AXIS = (("fsdp_tp", (("dp", 2), ("tp", 2))),)


def train(cfg: dict, plans: list, steps: int) -> float:
    """On every rank: compile each plan, then run ``steps`` rounds of forward, backward and AdamW
    over all of them in turn."""
    import autopar
    from autopar.plans import Plan

    runs = []
    for text, axes in plans:
        model, args = build(cfg)
        pm = autopar.compile(model, autopar.Mesh(dict(axes), device="cpu"), args, plan=Plan.from_dict(json.loads(text)))
        runs.append((pm, args, torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True)))
    t0 = time.perf_counter()
    for _ in range(steps):
        for pm, args, opt in runs:
            pm(*args).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    import autopar

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every-axis", action="store_true", help="also FSDP x TP on (2, 2) (collectives in flight "
                    "on both axes)")
    args = ap.parse_args(argv)
    plans = []
    for recipe, axes in PLANS + (EVERY_AXIS if args.every_axis else ()):
        model, inputs = build(FULL, device="meta")
        plan = getattr(autopar.recipes, recipe)(model, autopar.Mesh(dict(axes), device="cpu"), inputs)
        plans.append((plan.to_json(), axes))
    print("seconds per rank:", autopar.launch(train, 4, FULL, plans, args.steps, timeout=3600))
    return 0


if __name__ == "__main__":
    sys.exit(main())
