"""Eager against compiled rank programs on local gloo processes: cold compile time and step time.

    python benchmarks/compiled.py [--nprocs 4] [--mesh dp=2,tp=2] [--family gpt] [--backend inductor]
                                  [--steps 20]

Every rank compiles the same model twice, once eagerly and once with ``compile=BACKEND``, and times
its steps (forward, backward, SGD step), after ``--warmup`` steps, interleaving eager and compiled
steps so that a busy machine slows both alike. The first compiled step is the cold compile
(dynamo, AOTAutograd and the backend; Inductor's on-disk cache makes a second run warm: pass
``--fresh-cache`` to measure cold). Prints one table: median step time of each, their ratio, cold
compile time, the losses' largest difference, and the graph breaks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def _rank(family: str, axes: dict, backend: str, steps: int, warmup: int, cfg: dict) -> dict:
    import autopar
    from autopar import _torch_compat as tc
    from autopar.models import make

    def build(choice):
        torch.manual_seed(0)
        model, inputs = make(family, "tiny", batch=cfg["batch"], seq=cfg["seq"], **cfg["model"])
        pm = autopar.compile(model, autopar.Mesh(axes, device="cpu"), inputs, compile=choice)
        return pm, torch.optim.SGD(pm.parameters(), lr=1e-3), inputs

    def step(pm, opt, inputs):
        t = time.perf_counter()
        loss = pm(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t, loss.item()

    eager, compiled = build(False), build(backend)
    before = tc.graph_breaks()
    cold, first_loss = step(*compiled)
    breaks = sum((tc.graph_breaks() - before).values())
    e_loss0 = step(*eager)[1]
    for _ in range(warmup):
        step(*eager), step(*compiled)
    te, tcomp, diff = [], [], abs(first_loss - e_loss0)
    for _ in range(steps):
        a, la = step(*eager)
        b, lb = step(*compiled)
        te.append(a), tcomp.append(b)
        diff = max(diff, abs(la - lb))
    return {"eager": statistics.median(te), "compiled": statistics.median(tcomp), "cold": cold,
            "loss_diff": diff, "breaks": breaks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--mesh", default="dp=2,tp=2")
    ap.add_argument("--family", default="gpt", choices=["gpt", "llama", "mlp"])
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fresh-cache", action="store_true", help="a new, empty Inductor cache directory")
    args = ap.parse_args()
    import autopar

    if args.fresh_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-inductor-")
    axes = {k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))}
    model = {} if args.family == "mlp" else dict(n_embd=256, n_layer=4, n_head=8, vocab_size=1024, block_size=128) \
        if args.family == "gpt" else dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=1024, max_seq_len=128)
    cfg = {"batch": 8, "seq": 128, "model": model}
    t = time.time()
    rows = autopar.launch(_rank, args.nprocs, args.family, axes, args.backend, args.steps, args.warmup, cfg,
                          timeout=3600)
    wall = time.time() - t
    print(f"{args.family} on {args.mesh} ({args.nprocs} gloo processes), backend {args.backend}, "
          f"{args.steps} interleaved steps, load {os.getloadavg()[0]:.1f}, wall {wall:.0f} s")
    print("| rank | eager step (ms) | compiled step (ms) | compiled / eager | cold compile (s) | max loss diff | graph breaks |")
    print("|---|---|---|---|---|---|---|")
    for r, row in enumerate(rows):
        print(f"| {r} | {row['eager'] * 1e3:.1f} | {row['compiled'] * 1e3:.1f} | {row['compiled'] / row['eager']:.2f} | "
              f"{row['cold']:.1f} | {row['loss_diff']:.1e} | {row['breaks']} |")


if __name__ == "__main__":
    main()
