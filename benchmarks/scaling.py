"""Weak scaling of FSDP, priced: MPT-13B-shaped training (MosaicML llm-foundry's benchmark shapes) with
``recipe="fsdp"`` on 8, 64 and 512 H100s (mesh ``{"dp": N}``, 8 GPUs and 8 NICs per node).

The model is autopar's GPT at llm-foundry's MPT-13B shape: 40 layers, width 5120, 40 heads, vocabulary
50368, sequence 2048, no biases, tied embedding (MPT uses ALiBi where GPT has learned positions: 10M
parameters of 13B), micro-batch 2 sequences per GPU, one micro-batch per step, built on the meta
device. Per mesh it prints the predicted step time, tokens/s per GPU, compute, the exposed
communication (activation transfers plus parameter traffic that does not fit under its layer's
compute) and the collectives per step, in three pricings of the dp axis:

- ``rails``: the default links (``autopar.cost_model.mesh.axis_link``: hierarchical on k NIC rails);
- ``rails, alpha=0``: the same bandwidth with no latency, so ``rails`` minus this is what the
  collectives' latency (n x alpha each) costs in the step;
- ``before``: what autopar priced before topology: NVLink when the axis fits in a node, else the
  flat ring at one NIC per GPU.

and the ratio of each mesh's tokens/s per GPU to the smallest mesh's, next to llm-foundry's
published figures (4,792 / 4,800 / 4,952 tokens/s per GPU on 8 / 64 / 512 H100s: flat).

    python benchmarks/scaling.py [--gpus 8 64 512] [--layers 40] [--no-compare]

Planning is quick once the model is captured; capturing 40 layers takes 10-20 s per mesh here.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

SEQ = 2048
MICRO_BATCH = 2
SHAPE = dict(n_layer=40, n_embd=5120, n_head=40, vocab_size=50368, block_size=SEQ, bias=False)
PUBLISHED = {8: 4792, 64: 4800, 512: 4952}  # llm-foundry MPT-13B, tokens/s per GPU (H100, bf16)
LATENCY_FREE = 1e-15  # a Link needs latency > 0; this is zero at any step's scale


def _say(msg: str) -> None:
    print(msg, flush=True)


def _latency_per_step(plan, mesh) -> tuple[int, float]:
    """Collectives per step and the latency term they pay (n x alpha each; all-reduce (2n-1) x alpha)."""
    count, seconds = 0, 0.0
    for c in plan.collectives:
        n, alpha = mesh.axis_size(c["axis"]), mesh.link(c["axis"]).latency
        steps = 2 * n - 1 if c["kind"] == "all_reduce" else n
        count += c["count"]
        seconds += c["count"] * steps * alpha
    return count, seconds


def price(model, inputs, graph, n: int, links=None) -> dict:
    """One FSDP pricing of the captured model on ``{"dp": n}`` H100s (``links`` overrides dp's)."""
    import autopar
    from autopar.planner.intra import run_passes
    from autopar.planner.options import PlanOptions
    from autopar.planner.report import build_plan

    mesh = autopar.Mesh({"dp": n}, device="h100", links=links)
    t0 = time.perf_counter()
    p = run_passes(model, mesh, inputs, options=PlanOptions(recipe="fsdp", graph=graph, progress=False))
    plan = build_plan(p)
    count, latency = _latency_per_step(plan, mesh)
    kinds = Counter()
    for c in plan.collectives:
        kinds[c["kind"]] += c["count"]
    c = p.cost
    return {"step": c.step_time, "tok_gpu": MICRO_BATCH * SEQ / c.step_time, "compute": c.compute_time,
            "activation": c.comm_time - c.exposed_param_comm, "exposed_param": c.exposed_param_comm,
            "exposed": c.comm_time, "collectives": count, "latency": latency, "kinds": dict(kinds),
            "link": mesh.link("dp"), "plan_s": time.perf_counter() - t0, "fits": c.peak_memory <= p.problem.memory_budget}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 512], help="data-parallel mesh sizes")
    ap.add_argument("--layers", type=int, default=SHAPE["n_layer"], help="decoder layers (MPT-13B: 40)")
    ap.add_argument("--no-compare", action="store_true", help="price only the default links")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    import autopar
    from autopar.cost_model.hardware import PRESETS
    from autopar.ir.capture import capture
    from autopar.models import make, num_params

    ib = PRESETS["h100"].inter_node
    rows: dict[str, dict[int, dict]] = {"rails": {}, "rails, alpha=0": {}, "before": {}}
    for n in args.gpus:
        t0 = time.perf_counter()
        model, inputs = make("gpt", size="13B", batch=MICRO_BATCH * n, seq=SEQ, device="meta",
                             **{**SHAPE, "n_layer": args.layers})
        _say(f"[{n} GPUs] capturing {args.layers} layers, {num_params(model) / 1e9:.2f}B parameters, "
             f"batch {MICRO_BATCH * n} x {SEQ} ...")
        graph = capture(model, tuple(inputs))
        _say(f"[{n} GPUs] captured in {time.perf_counter() - t0:.1f} s; pricing")
        rows["rails"][n] = price(model, inputs, graph, n)
        if not args.no_compare:
            bw = autopar.Mesh({"dp": n}, device="h100").link("dp").bandwidth
            rows["rails, alpha=0"][n] = price(model, inputs, graph, n, links={"dp": (LATENCY_FREE, bw)})
            flat = {"dp": ib} if n > PRESETS["h100"].devices_per_node else None
            rows["before"][n] = price(model, inputs, graph, n, links=flat)
        r = rows["rails"][n]
        _say(f"[{n} GPUs] step {r['step'] * 1e3:.1f} ms, {r['tok_gpu']:.0f} tokens/s/GPU, dp link "
             f"{r['link'].latency * 1e6:.2f} us / {r['link'].bandwidth / 1e9:.1f} GB/s ({r['plan_s']:.1f} s)")
        del model, graph

    base = min(args.gpus)
    _say("")
    _say(f"MPT-13B-shaped FSDP ({args.layers} layers), H100, micro-batch {MICRO_BATCH} x {SEQ} per GPU; times in ms")
    _say(f"{'pricing':<15} {'GPUs':>5} {'step':>8} {'tok/s/GPU':>10} {'vs ' + str(base):>7} {'compute':>8} "
         f"{'exposed':>8} {'(act':>7} {'param)':>7} {'colls':>6} {'n*alpha':>8} {'published':>10}")
    for name, by_n in rows.items():
        for n, r in by_n.items():
            ratio = r["tok_gpu"] / by_n[base]["tok_gpu"] if base in by_n else float("nan")
            pub = PUBLISHED.get(n)
            _say(f"{name:<15} {n:>5} {r['step'] * 1e3:>8.1f} {r['tok_gpu']:>10.0f} {ratio:>7.3f} "
                 f"{r['compute'] * 1e3:>8.1f} {r['exposed'] * 1e3:>8.1f} {r['activation'] * 1e3:>7.1f} "
                 f"{r['exposed_param'] * 1e3:>7.1f} {r['collectives']:>6} {r['latency'] * 1e3:>8.1f} "
                 f"{pub if pub else '-':>10}" + ("" if r["fits"] else "  (over memory)"))
    if not args.no_compare:
        _say("")
        for n in args.gpus:
            a, z = rows["rails"][n], rows["rails, alpha=0"][n]
            _say(f"{n} GPUs: of {a['exposed'] * 1e3:.1f} ms exposed, latency (n x alpha) {(a['step'] - z['step']) * 1e3:.1f} ms, "
                 f"bandwidth {z['exposed'] * 1e3:.1f} ms (exposed with alpha = 0); collectives per step {a['kinds']}")
    if base in PUBLISHED:
        _say("published ratios: " + ", ".join(f"{n}/{base} {PUBLISHED[n] / PUBLISHED[base]:.3f}"
                                            for n in args.gpus if n in PUBLISHED and n != base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
