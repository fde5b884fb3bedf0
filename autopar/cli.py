"""The ``autopar`` command line. Today: ``autopar demo``; ``plan``/``show``/``explain``/``diff``
arrive with the search issue."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import Counter


def demo() -> int:
    """Capture a GPT-2-style model for an 8-device (2 x 4) mesh, show what can be sharded, and prove
    the rules of a small one by simulating every device."""
    import torch

    import autopar.models as M
    from autopar.ir.capture import capture
    from autopar.ir.rules import op_call, strategies
    from autopar.runtime.verify import Report, cases, dedupe, record_values, verify

    mesh = (2, 4)
    print(f"autopar demo: GPT-2 125M (built on meta, nothing allocated), batch 8, seq 512, mesh {mesh}")
    t = time.perf_counter()
    model, inputs = M.make("gpt", size="125M", batch=8, seq=512, device="meta")
    graph = capture(model, inputs)
    print(f"  captured the joint forward+backward graph: {len(graph)} nodes, "
          f"{len(graph.op_names())} distinct aten ops, {len(graph.grads)} gradients, {time.perf_counter() - t:.1f} s")
    per_module: Counter = Counter()
    n_ops = 0
    for node in graph.ops():
        per_module[node.module_path.split(".")[0] or "<root>"] += len(strategies(op_call(graph, node), mesh))
        n_ops += 1
    print(f"  sharding strategies on {mesh}: {sum(per_module.values())} over {n_ops} ops")
    for mod, n in sorted(per_module.items()):
        print(f"    {mod:<10} {n:>7}")
    print("  proving the rules of a tiny GPT by simulating every device of meshes (2,) and (2, 2) ...")
    torch.manual_seed(0)
    tiny, tiny_inputs = M.make("gpt", batch=3, seq=7, vocab_size=37, n_embd=30, n_head=3, n_layer=1, dtype=torch.float64)
    g = capture(tiny, tiny_inputs)
    cs = dedupe(cases(g, record_values(g, tiny, tiny_inputs)))
    report = Report()
    for m in [(2,), (2, 2)]:
        verify(cs, m, report)
    print(f"  verified {len(report.pairs)} (op, strategy) pairs over {len(report.ops)} ops: "
          f"{len(report.failures)} mismatches")
    print("  (the cost model, the ILP plan and running on gloo processes come with the next issues)")
    return 1 if report.failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization of PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="capture a GPT-2-style model and prove its sharding rules")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.command == "demo":
        return demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
