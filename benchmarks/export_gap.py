"""The price of a plan's module-level projection (``autopar.export``) beside the plan's own, for
LLaMA-3-8B dims on (8, 8) H100: ``python benchmarks/export_gap.py [--layers N] [--batch B]``."""

from __future__ import annotations

import argparse
import time

import autopar
from autopar.export import export
from autopar.models import make


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    a = ap.parse_args()
    model, args = make("llama", "llama3-8b", batch=a.batch, seq=a.seq, device="meta", n_layers=a.layers)
    mesh = autopar.Mesh({"dp": 8, "tp": 8}, device="h100")
    t = time.perf_counter()
    plan = autopar.plan(model, mesh, args, progress=False)
    planned = time.perf_counter() - t
    e = export(plan, "dtensor", model, args)
    r = e.report
    gap = r["projected"]["step_time"] / r["original"]["step_time"] - 1
    print(f"plan ({plan.source}): {r['original']['step_time'] * 1e3:.1f} ms, projected "
          f"{r['projected']['step_time'] * 1e3:.1f} ms ({gap:+.1%}); peak {r['original']['peak_memory'] / 2**30:.1f} / "
          f"{r['projected']['peak_memory'] / 2**30:.1f} GiB; {len(r['changed'])} placements changed; "
          f"planned in {planned:.0f} s, exported in {time.perf_counter() - t - planned:.0f} s")
    print("\n".join(f"note: {n}" for n in r["notes"]))
    print("recipes:", ", ".join(f"{k} {v['step_time'] * 1e3:.1f} ms" for k, v in sorted(plan.baselines.items())
                                if "step_time" in v))
    print("TP_PLAN modules:", e.text.count("'colwise'"), "colwise,", e.text.count("'rowwise'"), "rowwise")
    # the tensor-parallel projections: Megatron's pairs alone, with sequence parallelism, and with
    # the output head split on the vocabulary (loss_parallel) too
    for label, sp, loss in (("tp", False, False), ("tp + sp", True, False), ("tp + sp + loss_parallel", True, True)):
        t = time.perf_counter()
        r = export(plan, "dtensor", model, args, tensor_parallel=True, sequence_parallel=sp, loss_parallel=loss).report
        print(f"projection {label}: {r['projected']['step_time'] * 1e3:.1f} ms, peak "
              f"{r['projected']['peak_memory'] / 2**30:.1f} GiB, fits {r['projected']['fits']}; "
              f"{len(r['changed'])} placements changed ({time.perf_counter() - t:.0f} s)")
        print("\n".join(f"  note: {n}" for n in r["notes"] if "price at" not in n))

if __name__ == "__main__":
    main()
