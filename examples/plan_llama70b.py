"""Plan LLaMA-3-70B for 64 H100s (8 nodes of 8) from a laptop: the model is built on ``meta``, so
no weight is ever allocated; capture, search and the plan all run on fake tensors.

    python examples/plan_llama70b.py                 # 80 layers, batch 64 x 2048, mesh dp=8 x tp=8
    python examples/plan_llama70b.py --small --search-time 1   # 2 layers, a short solve (CI)
    python examples/plan_llama70b.py --save plan.json --html plan.html

Prints the plan's summary next to the hand-written recipes, and saves it if asked.
"""

from __future__ import annotations

import argparse
import time

import autopar
from autopar.models import make


def main(argv=None) -> autopar.Plan:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="2 layers instead of 80 (same layer shapes)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--search-time", type=float, default=None,
                    help="the solver's deterministic time limit (default: autopar's)")
    ap.add_argument("--save", help="write the plan's JSON here")
    ap.add_argument("--html", help="write the plan's HTML page here")
    args = ap.parse_args(argv)

    overrides = {"n_layers": 2} if args.small else {}
    t0 = time.perf_counter()
    model, inputs = make("llama", "llama3-70b", batch=args.batch, seq=args.seq, device="meta", **overrides)
    mesh = autopar.Mesh({"dp": 8, "tp": 8}, device="h100")  # tp inside a node (NVLink), dp across (IB)
    kw = {} if args.search_time is None else {"deterministic_time": args.search_time}
    plan = autopar.plan(model, mesh, inputs, **kw)
    print(plan.summary())
    print(f"\nplanned in {time.perf_counter() - t0:.1f} s")
    if args.save:
        plan.save(args.save)
        print(f"saved {args.save}")
    if args.html:
        from autopar.plans.html import write_html

        write_html(plan, args.html)
        print(f"wrote {args.html}")
    return plan


if __name__ == "__main__":
    main()
