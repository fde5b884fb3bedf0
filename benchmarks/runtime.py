"""Lowered programs against hand-written parallelism, and predicted against measured step time,
on 4 local gloo processes, GPT-2-style and LLaMA-style models.

One ``autopar.launch(run, 4)`` run builds every variant, checks each against a single-process
reference (loss and every gradient), then times them interleaved (round robin, a barrier before
every step), so machine noise hits all variants alike:

1. **autopar against hand-written** on mesh (4,):
   - the lowered program of ``autopar.recipes.megatron_tp`` against DTensor tensor parallelism
     written by hand: ``parallelize_module`` with ``ColwiseParallel`` on ``attn.qkv`` and
     ``mlp.fc`` and ``RowwiseParallel`` on ``attn.proj`` and ``mlp.proj`` (the qkv rows permuted
     so each rank holds whole heads of q, k and v, the attention run on the local heads, as
     Megatron does); embeddings, LayerNorms and the tied LM head replicated;
   - the lowered program of ``autopar.recipes.ddp`` against ``DistributedDataParallel`` (each rank
     its quarter of the same global batch).
2. **predicted against measured**: plans made with the calibrated ``cpu`` profile, per case
   (``CASES``: GPT and LLaMA, meshes (4,) and (2, 2), the config's batch and twice it) the recipes
   and the searched plan; the plan's ``step_time`` against the measured training step (forward,
   backward and the AdamW step, which the plan prices too), their Spearman rank correlation, and
   per case whether the searched plan measured fastest or its min-max range overlaps the fastest's.

Every variant's collectives per forward + backward are counted (a dispatch mode on the
``_c10d_functional`` and ``c10d`` ops, so DDP's bucketed all-reduces count too), in an untimed
steady-state step. The script exits 1 if a variant's loss or gradients differ from the reference
(relative 1e-5 / 1e-4).

Step time = forward + backward (the loss's ``backward()`` returns with every gradient in place),
the max over ranks, median over the timed steps; the AdamW step is timed too and reported apart in
the hand-written comparison; predicted against measured compares the whole step. Every variant's
AdamW runs with ``foreach=True`` (torch's default on CPU is the per-parameter loop; the same
setting for all, so the comparison is like for like: on DTensor parameters, whose every op pays
DTensor dispatch, the multi-tensor ops dispatch once per step instead of once per parameter;
DTensor and plain parameters go in separate parameter groups, as a multi-tensor op takes one kind).

    OMP_NUM_THREADS=1 python benchmarks/runtime.py [--quick] [--profile cpu-profile.json]
        [--steps 9] [--warmup 2] [--cprofile] [--only 'llama (2, 2)']

Without ``--profile`` the script first runs ``autopar.cost_model.calibrate.calibrate(path,
nprocs=4)`` into a temporary file (the ``autopar calibrate`` CLI) and reports how long it took.
Plans are made in the launching process (on a ``meta`` copy of the model) before the launch.
The models, the hand-written variants, the checks and the launched function are in
``runtime_ranks.py``; the report (tables, rank correlations, verdicts) in ``runtime_report.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

import torch

from runtime_ranks import FULL, QUICK, build, run  # noqa: F401  (FULL, build: also benchmarks/soak.py's)
from runtime_report import case_of, plan_key, report

#: the cases: (family, mesh shape, batch multiple of the config's, recipes); each also has a
#: searched plan, which should measure fastest of its case (or within the min-max noise)
CASES = [
    ("gpt", (4,), 1, ("ddp", "fsdp", "megatron_tp", "megatron_sp")),
    ("gpt", (2, 2), 1, ("ddp", "fsdp_tp", "megatron_tp")),
    ("gpt", (4,), 2, ("ddp", "megatron_tp")),
    ("llama", (4,), 1, ("ddp", "fsdp", "megatron_tp")),
    ("llama", (2, 2), 1, ("ddp", "fsdp_tp", "megatron_tp")),
    ("llama", (2, 2), 2, ("ddp", "megatron_tp")),
]
QUICK_CASES = [("gpt", (4,), 1, ("ddp", "megatron_tp")), ("llama", (2, 2), 1, ("ddp", "megatron_tp"))]
NPROCS = 4


def make_plans(cfg: dict, profile: str, quick: bool, det_time: float, only: str | None = None) -> list:
    """Every case's recipes and searched plan, priced on ``profile`` (made in this process, on
    ``meta`` copies of the models)."""
    import autopar
    from autopar.ir.capture import capture

    graphs = {}
    plans = []
    for family, shape, mult, recipes in (QUICK_CASES if quick else CASES):
        if only and only not in case_of(plan_key(family, shape, "x", mult)):
            continue
        batch = cfg["batch"] * mult
        for recipe in (*recipes, "search"):
            axes = {"dp": shape[0]} if len(shape) == 1 else {"dp": shape[0], "tp": shape[1]}
            if recipe in ("megatron_tp", "megatron_sp") and len(shape) == 1:
                axes = {"tp": shape[0]}
            mesh = autopar.Mesh(axes, device="cpu", profile=profile)
            model, inputs = build(cfg, device="meta", batch=batch, family=family)
            if (family, batch) not in graphs:
                graphs[family, batch] = capture(model, inputs)
            graph = graphs[family, batch]
            t0 = time.perf_counter()
            if recipe == "search":
                plan = autopar.plan(model, mesh, inputs, graph=graph, deterministic_time=det_time, progress=False)
            else:
                plan = getattr(autopar.recipes, recipe)(model, mesh, inputs, graph=graph, progress=False)
            key = plan_key(family, shape, recipe, mult)
            plans.append(dict(key=key, family=family, recipe=recipe, source=plan.source, batch=batch,
                              mesh_shape=list(plan.mesh_shape), axis_names=list(plan.axis_names),
                              json=plan.to_json(timing=False), step_time=plan.step_time,
                              compute_time=plan.compute_time, comm_time=plan.comm_time,
                              n_collectives=_planned_collectives(plan), plan_s=time.perf_counter() - t0))
            print(f"planned {key}: {plan.source}, predicted {plan.step_time * 1e3:.1f} ms "
                  f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    return plans


def _planned_collectives(plan) -> int:
    """Collective calls per step the plan lists (``plan.collectives``, each ``count`` times)."""
    return sum(int(c.get("count", 1)) for c in plan.collectives)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, fewer plans and steps (smoke run)")
    ap.add_argument("--profile", help="a calibrated cpu profile (default: calibrate now into a temp file)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 9; 3 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2; 1 with --quick)")
    ap.add_argument("--deterministic-time", type=float, default=None, help="solver budget of the searched plans")
    ap.add_argument("--cprofile", action="store_true", help="also cProfile 3 steps of the TP and DDP variants")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--only", help="run only the cases whose name contains this (e.g. 'llama (2, 2)'; development)")
    args = ap.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    steps = args.steps or (3 if args.quick else 9)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    det = args.deterministic_time or (1.0 if args.quick else 5.0)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    print(f"autopar runtime benchmark, {datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs",
          file=sys.stderr)

    import autopar

    calib_s = None
    calib_lines = []
    profile = args.profile
    tmp = None
    if profile is None:
        from autopar.cost_model.calibrate import calibrate

        tmp = tempfile.TemporaryDirectory()
        profile = os.path.join(tmp.name, "cpu-profile.json")
        t0 = time.perf_counter()
        calib_lines: list = []
        calibrate(profile, nprocs=NPROCS, quick=args.quick, report=calib_lines)
        print("\n".join(calib_lines), file=sys.stderr, flush=True)
        calib_s = time.perf_counter() - t0
        print(f"calibrated in {calib_s:.1f} s", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    plans = make_plans(cfg, profile, args.quick, det, args.only)
    print(f"planned {len(plans)} plans in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    res = autopar.launch(run, NPROCS, cfg, plans, steps, warmup, args.cprofile, timeout=3600)[0]
    res["load"] = (load0, os.getloadavg()[0])
    with open(profile) as f:
        hw = json.load(f)
    res["profile_figures"] = (f"fp32 {hw['peak_flops']['float32'] / 1e9:.0f} GFLOP/s, memory {hw['hbm_bandwidth'] / 1e9:.1f} GB/s, "
                              f"launch {hw['launch_floor'] * 1e6:.1f} us, gloo link {hw['intra_node']['latency'] * 1e6:.0f} us + "
                              f"{hw['intra_node']['bandwidth'] / 1e9:.2f} GB/s"
                              + "".join(f", {k} x{f:.2f}" for k, f in sorted(hw["intra_node"].get("factors", {}).items()))
                              + f", overlap_slowdown {hw.get('overlap_slowdown', 0.0):.2f}")
    res["calibration"] = calib_lines
    print(f"launch run: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return report(cfg, res, plans, steps, warmup, calib_s, args.profile or "calibrated now (temporary file)", args)


if __name__ == "__main__":
    sys.exit(main())
