"""Plan once, save the plan as JSON, and train from the saved file later.

    python examples/reuse_plan.py --small            # tiny GPT on 4 local CPU ranks, seconds
    python examples/reuse_plan.py                    # GPT 125M on a dp=2 x tp=2 mesh

Planning needs no process group and no memory for the weights: the model is built on ``meta``
and ``autopar.plan`` searches in this process. The plan goes to a JSON file (canonical: the same
plan gives the same bytes), ``autopar.load_plan`` reads it back, and ``autopar.launch`` starts the
ranks, each of which builds the real model and calls ``autopar.compile(..., plan=path)``: nothing
is searched again there, and the plan's graph fingerprint must match the model's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch


def train(plan_path: str, axes: dict, device: str, size: str, batch: int, seq: int, steps: int) -> list[float]:
    """On every rank: the real model, compiled with the saved plan, ``steps`` AdamW steps."""
    import torch.distributed as dist

    import autopar
    from autopar.models import make

    torch.manual_seed(0)
    model, (tokens, targets) = make("gpt", size, batch=batch, seq=seq)
    pm = autopar.compile(model, autopar.Mesh(axes, device=device), (tokens, targets), plan=plan_path)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-6)
    losses = []
    for step in range(steps):
        loss = pm(tokens, targets)  # one batch, again and again: the loss must fall
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"step {step + 1} loss {losses[-1]:.6f}", flush=True)
    return losses


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny GPT, batch 8 x 16 tokens, 4 ranks, short search")
    p.add_argument("--mesh", help="axes as name=size,... (default dp=2,tp=2; --small: dp=4)")
    p.add_argument("--device", default="cpu", help="cost-model preset to plan for (default cpu)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", help="where to save the plan (default: a temporary directory)")
    args = p.parse_args(argv)

    import autopar
    from autopar.models import make

    size, batch, seq = ("tiny", 8, 16) if args.small else ("125M", 8, 256)
    text = args.mesh or ("dp=4" if args.small else "dp=2,tp=2")
    axes = {k: int(v) for k, v in (part.split("=") for part in text.split(","))}
    mesh = autopar.Mesh(axes, device=args.device)

    # 1. plan, on a model that allocates nothing
    model, example = make("gpt", size, batch=batch, seq=seq, device="meta")
    plan = autopar.plan(model, mesh, example, deterministic_time=0.5 if args.small else 20.0)

    # 2. save and load back: the file holds everything compile needs
    with tempfile.TemporaryDirectory() as tmp:
        path = args.out or os.path.join(tmp, "plan.json")
        plan.save(path)
        again = autopar.load_plan(path)
        assert again.to_json() == plan.to_json(), "a saved plan reads back unchanged"
        print(f"plan saved to {path} ({os.path.getsize(path)} bytes); loaded back:")
        print(again.summary())

        # 3. train with it on mesh.size local ranks
        losses = autopar.launch(train, mesh.size, path, axes, args.device, size, batch, seq, args.steps,
                                timeout=1800)
    print("losses (rank 0):", " ".join(f"{x:.6f}" for x in losses[0]))
    if any(r != losses[0] for r in losses):
        sys.exit("the ranks disagree on the loss")


if __name__ == "__main__":
    main(sys.argv[1:])
