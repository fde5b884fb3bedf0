"""Planning with a pipeline axis: LLaMA-3-70B (80 layers) at batch 64 x 2048, bf16-mixed AdamW, on 64
H100s as pp x dp x tp (default 4 x 2 x 8: tp inside a node, pp and dp across nodes); ``--size
llama3.1-405b`` plans the built-in LLaMA at LLaMA-3.1-405B's dims (126 layers, dim 16384, 128 heads,
8 kv heads, ffn 53248, vocab 128256), e.g. ``--mesh 8 8 8 --batch 256 --seq 8192``.

Prints the plan's choice (schedule, micro-batches, stages, bubble), its step time and per-rank memory,
the baselines (the pipelined recipe ``pp_fsdp_tp``; with ``--devices``, the shapes compared),
and the planning time per phase (the inner solves' phases summed, and the total). With ``--pin
SCHEDULE:M`` the pipeline is pinned (one inner solve). A given ``pp`` axis pipelines: the plain plan of
the same devices is compared only under ``--devices`` (the factorization search).

    python benchmarks/pipeline_plan.py [--size llama3-70b] [--mesh 4 2 8] [--layers 80] [--pin 1F1B:16]
        [--batch 64] [--seq 2048]
"""

from __future__ import annotations

import argparse
import os
import time

import autopar
from autopar import models


#: --size: the built-in LLaMA's preset and the dims changed from it
SIZES = {
    "llama3-70b": ("llama3-70b", {}),
    "llama3.1-405b": ("llama3-70b", dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                                         vocab_size=128256)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", type=int, nargs=3, default=(4, 2, 8), metavar=("PP", "DP", "TP"))
    ap.add_argument("--devices", type=int, default=None,
                    help="instead of --mesh: Mesh.devices(N), the planner chooses pp x dp x tp")
    ap.add_argument("--pp", type=int, nargs="*", default=None, help="with --devices: the pp degrees tried")
    ap.add_argument("--tp", type=int, nargs="*", default=None, help="with --devices: the tp degrees tried")
    ap.add_argument("--size", default="llama3-70b", choices=sorted(SIZES))
    ap.add_argument("--layers", type=int, default=None, help="default: the size's own depth")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--pin", default=None, help="SCHEDULE:MICROBATCHES")
    a = ap.parse_args()
    pp, dp, tp = a.mesh
    preset, over = SIZES[a.size]
    layers = a.layers or over.get("n_layers") or 80
    model, inputs = models.make("llama", preset, batch=a.batch, seq=a.seq, device="meta", **dict(over, n_layers=layers))
    if a.devices:
        mesh = autopar.Mesh.devices(a.devices, device="h100", pp=a.pp, tp=a.tp)
    else:
        mesh = autopar.Mesh({"pp": pp, "dp": dp, "tp": tp}, device="h100")
    pin = None
    if a.pin:
        name, m = a.pin.split(":")
        pin = {"schedule": name, "microbatches": int(m)}
    t, cpu = time.perf_counter(), time.process_time()
    plan = autopar.plan(model, mesh, inputs, precision="bf16-mixed", pipeline=pin, progress=False)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    print(f"load {os.getloadavg()} (1, 5, 15 min) at the end; {a.size}, "
          f"{f'Mesh.devices({a.devices})' if a.devices else f'mesh pp={pp} dp={dp} tp={tp}'}; {layers} layers; "
          f"batch {a.batch}x{a.seq}")
    # CPU seconds: on a loaded machine the wall clock inflates with the load, this process's CPU time far less
    print(f"planned in {wall:.1f} s ({cpu:.1f} s CPU); phases {plan.phases}")
    if plan.mesh_search:
        ms = plan.mesh_search
        print(f"mesh search over {ms['devices']} devices chose {ms['chosen']}; compared:")
        for r in ms["compared"]:
            print(f"  {r['shape']}: " + (r["error"][:110] if "error" in r else
                                         f"{r['step_time'] * 1e3:.1f} ms {r['peak_memory'] / 2**30:.1f} GiB "
                                         f"fits={r['fits']} pipelined={r['pipelined']}"))
    pl = plan.pipeline
    if pl:
        print(f"pipeline: {pl.schedule} m={pl.microbatches} v={pl.virtual_stages} bubble {pl.bubble:.3f} "
              f"makespan {pl.makespan * 1e3:.1f} ms sync {pl.sync_time * 1e3:.2f} ms p2p {pl.p2p_time * 1e6:.0f} us")
        print("stages (layers per stage):", [sum(p.startswith("layers.") for p in s) for s in pl.stages])
        print("rank memory GiB:", [round(x / 2**30, 1) for x in pl.rank_memory])
        for c in pl.compared[:8]:
            print(f"  {c.schedule:<16} m={c.microbatches:<3} v={c.virtual_stages} {c.step_time * 1e3:8.1f} ms "
                  f"{c.peak_memory / 2**30:6.1f} GiB bubble {c.bubble:.3f}" + (" (estimated)" if c.estimated else ""))
    print(f"step {plan.step_time * 1e3:.1f} ms, peak {plan.peak_memory / 2**30:.1f} GiB of "
          f"{plan.memory_budget / 2**30:.1f} GiB ({'fits' if plan.fits else 'DOES NOT FIT'}), source {plan.source}")
    for k, v in sorted(plan.baselines.items()):
        print(f"  baseline {k:<14} " + (v["error"][:100] if "error" in v else
                                        f"{v['step_time'] * 1e3:8.1f} ms {v['peak_memory'] / 2**30:6.1f} GiB fits={v['fits']}"))


if __name__ == "__main__":
    main()
