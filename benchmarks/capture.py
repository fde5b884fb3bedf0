"""Capture benchmark: the joint training graph of a LLaMA-3-8B-shaped model built on meta.

32 layers, dim 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256, batch 64, seq 2048. Checks
that every parameter has a gradient and prints the time, node count and distinct op count.
Target: under 10 s.

    python benchmarks/capture.py [--layers N] [--repeat K]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import torch


def build(layers: int, batch: int, seq: int):
    try:
        from autopar.models import make
    except ImportError:  # the model zoo is optional here
        make = None
    if make is not None:
        return make("llama", size="llama3-8b", batch=batch, seq=seq, device="meta", n_layers=layers)
    raise SystemExit("autopar.models is not available: cannot build the LLaMA-3-8B shape")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args(argv)

    from autopar.ir.capture import capture

    model, inputs = build(args.layers, args.batch, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        graph = capture(model, inputs)
        times.append(time.perf_counter() - t0)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    missing = [fqn for fqn, p in model.named_parameters() if p.requires_grad and fqn not in graph.grads]
    assert not missing, f"missing gradients: {missing[:5]}"
    fused = sum(1 for n in graph.ops() if n.op == "aten._scaled_dot_product_flash_attention_for_cpu.default")
    print(f"model        LLaMA-3-8B shape, {args.layers} layers, {n_params / 1e9:.2f}B params (meta), "
          f"batch {args.batch}, seq {args.seq}")
    print(f"capture      {min(times):.2f} s (best of {len(times)})")
    print(f"nodes        {len(graph)} ({len(graph) / args.layers:.0f} per layer), "
          f"{len(graph.op_names())} distinct ops")
    print(f"gradients    {len(graph.grads)}/{len(graph.params)} parameters, fused attention x{fused}")
    print(f"peak RSS     {rss1:.0f} MiB (before capture {rss0:.0f} MiB)")
    print(f"torch        {torch.__version__}")
    print(f"target       < 10 s: {'met' if min(times) < 10 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
