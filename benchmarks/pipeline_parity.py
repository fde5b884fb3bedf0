"""The pipeline parity matrix in the simulator: every schedule torch 2.13 runs (GPipe, 1F1B,
Interleaved1F1B, ZBVZeroBubble) x pp=2 x dp=2, pp=2 x tp=2, pp=4 x autopar's GPT (tied embedding and
head) and LLaMA, 8 layers, 4 micro-batches of 2 samples. Each case plans with the schedule pinned and
takes 3 AdamW steps of ``autopar.simulate`` next to the single-device model
(``tests/_pipeline_parity.parity``, which the suite's cases run too); it prints the worst relative
errors of the loss, of every gradient and of the parameters after the steps, and whether the
collectives and point-to-point transfers each simulated device ran equal the predicted ones in count
and bytes, every step. The suite runs a few cases of it; this runs them all (minutes).

    PYTHONPATH=. python benchmarks/pipeline_parity.py [--only gpt-ZBV] [--markdown] [--json out.json]

``--only`` keeps the cases whose id (``family-schedule-mesh``) contains any of the given strings.
Exit status 1 when a case fails (an error over ``--tol`` or a difference, or an exception).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from _pipeline_parity import MESHES, SCHEDULES, matrix_case  # noqa: E402

FAMILIES = ("gpt", "llama")


def case_ids() -> list[tuple[str, str, str]]:
    """Every (family, schedule, mesh) of the matrix."""
    return [(f, s, m) for f in FAMILIES for m in MESHES for s in SCHEDULES]


def run_one(family: str, schedule: str, mesh: str, args) -> dict:
    """One case's row: its figures, or the error it raised."""
    t0 = time.perf_counter()
    row = {"case": f"{family}-{schedule}-{mesh}", "family": family, "schedule": schedule, "mesh": mesh}
    try:
        row.update(matrix_case(family, schedule, mesh, n_layers=args.layers, batch=args.batch, steps=args.steps))
        row["ok"] = max(row["loss"], row["grad"], row["param"]) <= args.tol and not row["differences"]
    except Exception as e:  # noqa: BLE001 - reported as the case's result
        row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        row["traceback"] = traceback.format_exc()
        row["ok"] = False
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def line(row: dict) -> str:
    if "error" in row:
        return f"{row['case']:<34} FAILED {row['error']}  ({row['seconds']} s)"
    comm = "equal" if not row["differences"] else f"{len(row['differences'])} differences"
    return (f"{row['case']:<34} loss {row['loss']:.1e}  grad {row['grad']:.1e} ({row['grad_at']})  "
            f"param {row['param']:.1e}  executed vs predicted: {comm} ({row['collectives']} collectives, "
            f"{row['transfers']} transfers)  {'ok' if row['ok'] else 'FAIL'}  ({row['seconds']} s)")


def markdown(rows: list[dict]) -> str:
    out = ["| model | mesh | schedule | stage ranks | loss | worst gradient | params after steps | "
           "collectives / transfers = predicted | collectives of step 1 (all devices) | s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['family']} | {r['mesh']} | {r['schedule']} | | **failed**: {r['error']} | | | | | "
                       f"{r['seconds']} |")
            continue
        comm = (f"yes ({r['collectives']} / {r['transfers']})" if not r["differences"]
                else f"**no** ({len(r['differences'])} differ)")
        out.append(f"| {r['family']} | {r['mesh']} | {r['schedule']} | {','.join(map(str, r['stage_ranks']))} | "
                   f"{r['loss']:.1e} | {r['grad']:.1e} | {r['param']:.1e} | {comm} | "
                   f"{', '.join(f'{k} {v}' for k, v in r.get('kinds', {}).items()) or '-'} | {r['seconds']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="keep cases whose id contains any of these")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="4: one sample per micro-batch, so a second axis cannot "
                    "split the batch")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--markdown", action="store_true", help="also print the results as a markdown table")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args(argv)
    cases = [c for c in case_ids() if not args.only or any(o in "-".join(c) for o in args.only)]
    rows = []
    for c in cases:
        rows.append(run_one(*c, args))
        print(line(rows[-1]), flush=True)
        for d in rows[-1].get("differences", [])[:6]:
            print("    " + d)
        if "traceback" in rows[-1] and os.environ.get("PARITY_TRACEBACK"):
            print(rows[-1]["traceback"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "traceback"} for r in rows], f, indent=1)
    if args.markdown:
        print(markdown(rows))
    bad = [r["case"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} cases passed" + (f"; failed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
