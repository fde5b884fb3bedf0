"""Train the GPT-2-style model of autopar's zoo, sharded by autopar, for N steps of AdamW.

Run it on local CPU processes (gloo), either way:

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --small --steps 3
    python examples/train_gpt.py --launch 4 --small --steps 3

Every rank builds the same model from the same seed; rank 0 plans (or loads ``--plan``) and
``autopar.compile`` shares the plan and turns the parameters into DTensors holding this rank's
blocks; a plain ``torch.optim.AdamW`` then trains them. Rank 0 prints the loss of every step.

    --small                 tiny preset, batch 8, sequence 16, short search (for tests and demos)
    --mesh dp=2,tp=2        mesh axes (default: one axis "dp" over all ranks)
    --device cpu            cost-model preset the planner prices for (cpu, a100, h100, h200)
    --recipe fsdp           use a hand-written recipe instead of searching
    --plan PATH             use a plan saved before;  --save-plan PATH  saves the plan used
    --check                 rank 0 also trains a single-device copy and prints its loss beside

The data is a synthetic task the model can learn: each sequence counts up from a random start with
a random stride (modulo the vocabulary), and the model predicts the next token.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch


def parse_mesh(text: str | None, world: int) -> dict[str, int]:
    if not text:
        return {"dp": world}
    axes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip() or not size.strip().isdigit():
            raise SystemExit(f"--mesh: expected name=size[,name=size...], got {text!r}")
        axes[name.strip()] = int(size)
    return axes


def counting_batch(step: int, batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same ``(tokens, targets)`` on every rank: arithmetic sequences modulo ``vocab``."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    seqs = (start + stride * torch.arange(seq + 1)) % vocab
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def train(args: argparse.Namespace) -> list[float]:
    import torch.distributed as dist

    import autopar
    from autopar.models import make

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model, example = make("gpt", args.size, batch=args.batch, seq=args.seq)
    vocab, (batch, seq) = model.cfg.vocab_size, example[0].shape
    ref = copy.deepcopy(model) if args.check and rank == 0 else None

    mesh = autopar.Mesh(parse_mesh(args.mesh, world), device=args.device)
    kw = {} if args.plan else {"deterministic_time": args.search_time}
    if args.recipe and not args.plan:
        kw["recipe"] = args.recipe
    t0 = time.perf_counter()
    pm = autopar.compile(model, mesh, example, plan=args.plan, **kw)
    if rank == 0:
        print(f"compiled for mesh {mesh.axes} in {time.perf_counter() - t0:.1f} s: plan {pm.plan.source}, "
              f"predicted step {pm.plan.step_time * 1e3:.3f} ms", flush=True)
        if args.save_plan:
            pm.plan.save(args.save_plan)
            print(f"saved the plan to {args.save_plan}", flush=True)

    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr, eps=1e-6) if ref is not None else None
    losses = []
    for step in range(args.steps):
        tokens, targets = counting_batch(step, batch, seq, vocab, args.seed)
        loss = pm(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if rank == 0:
            line = f"step {step + 1} loss {losses[-1]:.6f}"
            if ref is not None:
                ref_loss = ref(tokens, targets)
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad(set_to_none=True)
                line += f" ref {ref_loss.item():.6f}"
            print(line, flush=True)
    return losses


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launch", type=int, metavar="N", help="spawn N local ranks (without torchrun)")
    p.add_argument("--small", action="store_true", help="tiny preset, short sequence and search")
    p.add_argument("--size", default="125M", help="GPT preset (default 125M; --small: tiny)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, help="sequence length (default 256; --small: 16)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", help="axes as name=size,...; default one axis over all ranks")
    p.add_argument("--device", default="cpu", help="cost-model preset (default cpu)")
    p.add_argument("--recipe", choices=["ddp", "fsdp", "megatron_tp", "megatron_sp", "fsdp_tp"])
    p.add_argument("--plan", metavar="PATH", help="use this saved plan instead of planning")
    p.add_argument("--save-plan", metavar="PATH", help="save the plan to PATH (rank 0)")
    p.add_argument("--search-time", type=float, help="solver effort (default 20; --small: 0.5)")
    p.add_argument("--check", action="store_true", help="rank 0 also trains a single-device copy")
    args = p.parse_args(argv)
    if args.small:
        args.size = "tiny"
    args.seq = args.seq or (16 if args.small else 256)
    args.search_time = args.search_time or (0.5 if args.small else 20.0)

    import autopar

    if args.launch:
        autopar.launch(train, args.launch, args, timeout=1800)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        autopar.launch(train, int(os.environ["WORLD_SIZE"]), args)  # this rank of the torchrun job
    else:
        p.error("start it with torchrun (torchrun --standalone --nproc-per-node 4 examples/train_gpt.py ...) "
                "or pass --launch N to spawn N local ranks")


if __name__ == "__main__":
    main(sys.argv[1:])
