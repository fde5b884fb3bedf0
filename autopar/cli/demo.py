"""``autopar demo``: what autopar does, on this machine, with nothing to configure.

1. Plans GPT-2 125M (built on ``meta``: nothing allocated) for 8 H100s as a ``dp=2 x tp=4`` mesh and
   prints the plan, with the hand-written recipes priced by the same cost model.
2. Plans a small GPT for 4 local CPU processes (``dp=2 x tp=2``).
3. Trains that GPT for a few AdamW steps on 4 gloo processes (``autopar.launch`` +
   ``autopar.compile`` with the saved plan) and prints each step's loss next to the loss of the
   same model, from the same weights, trained on one device in this process.

``--quick`` uses the small GPT in step 1 too and short searches (tests); ``--no-train`` stops after
step 2. This module imports only the standard library at the top: the training ranks import it
to find ``_train_rank`` (pickled by reference as ``autopar.cli.demo._train_rank``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings

SEED = 0
LR, EPS = 1e-2, 1e-6
#: the small GPT of steps 2 and 3: autopar.models' "tiny" preset, batch 8 x 16 tokens
SMALL = dict(size="tiny", batch=8, seq=16)
CPU_AXES = {"dp": 2, "tp": 2}
GPU_AXES = {"dp": 2, "tp": 4}


def _say(text: str = "") -> None:
    """Print a line of the demo's output at once (ranks and progress lines interleave)."""
    print(text, flush=True)


def counting_batch(step: int, batch: int, seq: int, vocab: int, seed: int = SEED):
    """The same ``(tokens, targets)`` everywhere: sequences counting up from a random start with a
    random stride, modulo ``vocab`` (a task the model can learn: the loss falls)."""
    import torch

    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    seqs = (start + stride * torch.arange(seq + 1)) % vocab
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def _train(model, steps: int, batch: int, seq: int) -> list[float]:
    """``steps`` AdamW steps of ``model`` (plain or a ParallelModule) on the counting task."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    vocab = _vocab(model)
    losses = []
    for step in range(steps):
        tokens, targets = counting_batch(step, batch, seq, vocab)
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
    return losses


def _vocab(model) -> int:
    """The vocabulary size of the demo's GPT (or of the ParallelModule wrapping it)."""
    inner = getattr(model, "module", model)  # a ParallelModule wraps the user's model
    return int(inner.cfg.vocab_size)


def _train_rank(plan_path: str, axes: dict, state: dict, steps: int) -> dict:
    """One rank of step 3: the small GPT from the parent's weights, compiled with the saved plan."""
    warnings.simplefilter("ignore")
    import torch.distributed as dist

    import autopar
    from autopar.models import make

    t0 = time.perf_counter()
    model, example = make("gpt", SMALL["size"], batch=SMALL["batch"], seq=SMALL["seq"])
    model.load_state_dict(state)
    pm = autopar.compile(model, autopar.Mesh(axes, device="cpu"), example, plan=plan_path)
    t1 = time.perf_counter()
    losses = _train(pm, steps, SMALL["batch"], SMALL["seq"])
    return {"rank": dist.get_rank(), "losses": losses, "compile_s": t1 - t0,
            "step_s": (time.perf_counter() - t1) / max(steps, 1)}


def _recipes_line(plan) -> str:
    """The plan against the hand-written recipes, in one sentence."""
    from autopar.plans import human_bytes

    mine = f"{plan.step_time * 1e3:.2f} ms per step, {human_bytes(plan.peak_memory)} per device"
    if plan.source.startswith("recipe:"):
        return f"no searched plan beat the recipes, so the plan is the {plan.source[7:]} recipe: {mine}"
    ok = {k: v for k, v in plan.baselines.items() if "step_time" in v and v.get("fits")}
    if not ok:
        return f"the searched plan: {mine}; no hand-written recipe fits the memory"
    best = min(ok, key=lambda k: ok[k]["step_time"])
    ratio = ok[best]["step_time"] / plan.step_time if plan.step_time else float("nan")
    return (f"the searched plan: {mine}; the best hand-written recipe, {best}: "
            f"{ok[best]['step_time'] * 1e3:.2f} ms per step ({ratio:.2f}x slower)")


def demo(quick: bool = False, train: bool = True, steps: int | None = None) -> int:
    """Run the demo (the module docstring's steps 1-3; ``train=False`` stops after step 2) -> the
    exit status: 1 when the sharded run's loss differs from the single-device run's."""
    from autopar.cli.errors import USAGE, CLIError
    from autopar.cli.progress import PLAN_PHASES, Progress, is_terminal

    steps = steps if steps is not None else (2 if quick else 5)
    if steps < 1:
        raise CLIError(f"--steps {steps}: give at least 1 training step", USAGE)
    if train and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise CLIError("the demo starts its own 4 processes: run `autopar demo` directly, not under torchrun "
                       "(or unset RANK and WORLD_SIZE), or pass --no-train", USAGE)
    tty = is_terminal()
    t_start = time.perf_counter()
    _say("autopar demo: loading torch and autopar ...")
    import torch

    import autopar
    import autopar.models as M

    # 1. a real model for a GPU cluster, planned here on meta tensors
    gpu_mesh = autopar.Mesh(GPU_AXES, device="h100")
    size, batch, seq = ("tiny", 8, 32) if quick else ("125M", 8, 1024)
    _say(f"\n[1/3] planning GPT-2 {size} (built on meta: nothing allocated), batch {batch} x {seq} tokens, for "
         f"8 H100s as mesh dp=2 x tp=4:\n      capture the training step, price every op's strategies, solve the ILP, "
         f"and price the hand-written recipes the same way")
    model, inputs = M.make("gpt", size=size, batch=batch, seq=seq, device="meta")
    search = {"deterministic_time": 2.0} if quick else {"time_limit": 60.0}
    with Progress("planning", PLAN_PHASES, enabled=tty):
        plan = autopar.plan(model, gpu_mesh, inputs, progress=tty, **search)
    _say(plan.summary())
    _say(f"\n=> {_recipes_line(plan)}")

    # 2. a small GPT for 4 local CPU processes
    cpu_mesh = autopar.Mesh(CPU_AXES, device="cpu")
    _say(f"\n[2/3] planning a small GPT (2 layers, 4 heads, width 64, vocabulary 128), batch {SMALL['batch']} x "
         f"{SMALL['seq']} tokens,\n      for 4 local CPU processes as mesh dp=2 x tp=2")
    torch.manual_seed(SEED)
    small, example = M.make("gpt", SMALL["size"], batch=SMALL["batch"], seq=SMALL["seq"])
    state = {k: v.detach().clone() for k, v in small.state_dict().items()}
    with Progress("planning", PLAN_PHASES, enabled=tty):
        plan2 = autopar.plan(small, cpu_mesh, example, progress=tty, deterministic_time=1.0 if quick else 2.0)
    _say(plan2.summary())
    if not train:
        _say(f"\n(--no-train: not starting processes) demo finished in {time.perf_counter() - t_start:.0f} s")
        return 0

    # 3. train it on 4 gloo processes, and on one device here
    _say(f"\n[3/3] training it for {steps} AdamW steps on 4 gloo processes: each starts Python, imports autopar, "
         f"captures the model\n      and lowers the plan to its own sharded program, then trains; the same weights "
         f"also train on one device here")
    with tempfile.TemporaryDirectory(prefix="autopar-demo-") as tmp:
        path = os.path.join(tmp, "plan.json")
        plan2.save(path)
        t0 = time.perf_counter()
        saved = os.environ.get("PYTHONWARNINGS")
        os.environ["PYTHONWARNINGS"] = "ignore"  # the ranks' imports: keep the table readable
        try:
            with Progress("training on 4 processes (start, capture, lower, train)", enabled=tty):
                results = autopar.launch(_train_rank, cpu_mesh.size, path, CPU_AXES, state, steps, timeout=600)
        except autopar.LaunchError as e:
            first = str(e).strip().splitlines()[0]
            raise CLIError(f"training on 4 gloo processes failed: {first}; rerun with --debug for the rank's "
                           f"traceback") from e
        finally:
            if saved is None:
                os.environ.pop("PYTHONWARNINGS", None)
            else:
                os.environ["PYTHONWARNINGS"] = saved
        wall = time.perf_counter() - t0
    small.load_state_dict(state)
    ref = _train(small, steps, SMALL["batch"], SMALL["seq"])
    par = results[0]["losses"]
    agree = all(r["losses"] == par for r in results)
    compile_s = max(r["compile_s"] for r in results)
    step_ms = max(r["step_s"] for r in results) * 1e3
    _say(f"4 processes done in {wall:.0f} s (compile: capture + lowering {compile_s:.1f} s per rank; "
         f"{step_ms:.0f} ms per step)\n")
    _say(f"  {'step':>4}  {'loss on 4 processes':>20}  {'loss on 1 device':>17}  {'difference':>10}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(par, ref)):
        worst = max(worst, abs(a - b) / max(1.0, abs(b)))
        _say(f"  {i + 1:>4}  {a:>20.6f}  {b:>17.6f}  {a - b:>10.2e}")
    same = worst <= 1e-4 and agree
    verdict = (f"the sharded run matches the single-device run (largest relative difference {worst:.1e})" if same else
               f"the sharded run does NOT match the single-device run (largest relative difference {worst:.1e}"
               + ("" if agree else "; the ranks disagree on the loss") + ")")
    _say(f"\n=> {verdict}")
    _say(f"demo finished in {time.perf_counter() - t_start:.0f} s")
    if not same:
        print("autopar demo: error: the loss on 4 processes differs from the single-device loss; "
              "rerun with --debug and report it", file=sys.stderr)
        return 1
    return 0


__all__ = ["counting_batch", "demo"]
