"""A/B: one benchmark script run alternately on two checkouts, so both see the same machine load.

This machine is shared and noisy: speeds compare only as ratios measured in one run. ``ab.py`` runs
``benchmarks/SCRIPT`` of the base checkout and of this one in turns (base, this, base, this, ...),
each in a fresh process with its own tree first on ``PYTHONPATH``, pulls the figures named by
``--metric NAME=REGEX`` (the first group of the last match in the run's output) and prints each
run's figures, their medians and the ratio this / base.

    git worktree add /tmp/autopar-base <base commit>
    OMP_NUM_THREADS=1 python benchmarks/ab.py --base /tmp/autopar-base --rounds 3 \\
        --metric "total32=32 layers: .*? total ([0-9.]+)" -- plan_time.py --layers 2 32
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent.parent


def run_once(tree: pathlib.Path, script: str, args: list[str], timeout: float) -> tuple[str, float]:
    """One run of ``tree``'s benchmark ``script``: its output and wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(tree / "benchmarks" / script), *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {script} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return proc.stdout, wall


def figures(text: str, metrics: dict[str, re.Pattern]) -> dict[str, float]:
    """Each metric's value in one run's output (the first group of its last match)."""
    out = {}
    for name, pat in metrics.items():
        found = pat.findall(text)
        if not found:
            raise SystemExit(f"metric {name!r}: no match of {pat.pattern!r} in:\n{text[-2000:]}")
        last = found[-1]
        out[name] = float(last[0] if isinstance(last, tuple) else last)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the base checkout (a git worktree of the base commit)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--metric", action="append", default=[], help="NAME=REGEX (a figure to compare; repeatable)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--show", action="store_true", help="print every run's whole output")
    ap.add_argument("script", help="the benchmark under benchmarks/, then its arguments after --")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    metrics = {}
    for m in a.metric:
        name, _, rx = m.partition("=")
        metrics[name] = re.compile(rx)
    trees = {"base": pathlib.Path(a.base).resolve(), "this": HERE}
    rev = {k: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=t, capture_output=True, text=True).stdout.strip()
           for k, t in trees.items()}
    print(f"A/B of benchmarks/{a.script} {' '.join(a.args)}: base {rev['base']} ({trees['base']}), "
          f"this {rev['this']}; {a.rounds} rounds, interleaved")
    got: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    for r in range(a.rounds):
        for side in ("base", "this"):
            load = os.getloadavg()[0]
            text, wall = run_once(trees[side], a.script, a.args, a.timeout)
            vals = figures(text, metrics)
            got[side].append(vals)
            print(f"round {r + 1} {side:<4}: " + "  ".join(f"{k} {v:.3f}" for k, v in vals.items())
                  + f"  (wall {wall:.1f} s, load {load:.1f})", flush=True)
            if a.show:
                print(text)
    print("\n| metric | base median | this median | this / base |\n|---|---|---|---|")
    for name in metrics:
        b = statistics.median(v[name] for v in got["base"])
        t = statistics.median(v[name] for v in got["this"])
        print(f"| {name} | {b:.3f} | {t:.3f} | {t / b if b else float('nan'):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
