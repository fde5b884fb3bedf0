"""Planning time per phase: the LLaMA-3-8B shape (batch 64, sequence 2048, training) on an (8, 8)
H100 mesh, at 2, 8 and 32 layers.

Prints capture, fold, strategies, cost, merge, solve and total seconds per depth (from
``autopar.passes.pipeline.run_passes``'s ``phases``), and the ratio of the deepest case's post-capture time
(total − capture) to the shallowest's. Targets: the 32-layer case under 15 s in total; its
post-capture phases under 1.5× the 2-layer case's (identical layers are folded, so depth should
cost little after capture).

    python benchmarks/plan_time.py [--layers 2 8 32] [--repeat K] [--markdown]

With ``--repeat`` each depth is planned K times and the run with the smallest total is kept.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

PHASES = ("capture", "fold", "strategies", "cost", "merge", "solve", "total")
TOTAL_TARGET_S = 15.0
RATIO_TARGET = 1.5


def plan_once(layers: int, batch: int, seq: int) -> dict:
    import autopar
    from autopar.passes.pipeline import run_passes
    from autopar.cost_model import comm
    from autopar.models import make

    comm.cache_clear()  # every depth prices its reshardings from a cold memo, as a fresh process does

    model, inputs = make("llama", size="llama3-8b", batch=batch, seq=seq, device="meta", n_layers=layers)
    mesh = autopar.Mesh({"dp": 8, "tp": 8}, device="h100")
    t0 = time.perf_counter()
    p = run_passes(model, mesh, inputs, progress=False)
    wall = time.perf_counter() - t0
    out = dict(p.phases)
    out["wall"] = wall
    out["post"] = p.phases["total"] - p.phases["capture"]
    out["source"] = p.source
    out["step_ms"] = p.cost.step_time * 1e3
    out["peak_gib"] = p.cost.peak_memory / 1024 ** 3
    out["nodes"] = len(p.graph)
    out["solve_nodes"] = len(p.merged.problem.nodes)
    del p, model
    gc.collect()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    rows = {}
    for L in args.layers:
        runs = [plan_once(L, args.batch, args.seq) for _ in range(args.repeat)]
        rows[L] = min(runs, key=lambda r: r["total"])
        r = rows[L]
        print(f"{L:>3} layers: " + "  ".join(f"{k} {r[k]:.2f}" for k in PHASES)
              + f"  | post-capture {r['post']:.2f} s; {r['nodes']} graph nodes, {r['solve_nodes']} after merge;"
              f" plan {r['step_ms']:.1f} ms / {r['peak_gib']:.1f} GiB ({r['source']})"
              + (f"; totals {[round(x['total'], 2) for x in runs]}" if args.repeat > 1 else ""))
        sys.stdout.flush()

    lo, hi = min(rows), max(rows)
    ratio = rows[hi]["post"] / rows[lo]["post"] if rows[lo]["post"] > 0 else float("inf")
    print()
    print(f"post-capture {hi} layers / {lo} layers: {rows[hi]['post']:.2f} / {rows[lo]['post']:.2f} s "
          f"= {ratio:.2f}x  (target < {RATIO_TARGET}x: {'met' if ratio < RATIO_TARGET else 'MISSED'})")
    print(f"{hi}-layer total: {rows[hi]['total']:.2f} s  (target < {TOTAL_TARGET_S:.0f} s: "
          f"{'met' if rows[hi]['total'] < TOTAL_TARGET_S else 'MISSED'})")
    if args.markdown:
        print()
        print("| layers | " + " | ".join(PHASES) + " | post-capture | graph nodes | nodes after merge |")
        print("|" + "---|" * (len(PHASES) + 4))
        for L, r in rows.items():
            print(f"| {L} | " + " | ".join(f"{r[k]:.2f}" for k in PHASES)
                  + f" | {r['post']:.2f} | {r['nodes']} | {r['solve_nodes']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
