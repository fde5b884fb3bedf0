"""One GPU checks autopar's programs and its compute model: one script, one table, at most 8 minutes.

    python benchmarks/gpu_check.py [--device cuda|cpu] [--budget 480] [--json out.json]

On a CUDA GPU (one H100 or H200 is enough: every rank of a 4- or 8-device plan runs as a thread of
this process on it, with real CUDA kernels) it prints one table:

- **parity**: GPT, LLaMA (autopar.models) and a Hugging Face Llama (its default config shrunk, SDPA
  attention, default dropout), each with a searched (2, 2) plan and the FSDP recipe on (8,), run by
  ``autopar.simulate(..., device="cuda")`` in bf16-mixed, against the model on one GPU under bf16
  autocast: the loss's relative difference and the worst parameter's gradient error
  ``|g - g_ref| / |g_ref|`` (bf16 tolerances: 3e-2 and 1e-1);
- **compiled**: a one-rank NCCL ``autopar.compile`` of a small LLaMA (the real process-group path
  end to end), eager and ``compile=True``: median step time, the cold compile, the loss difference;
- **kernels**: sustained bf16 cuBLAS at MPT-7B's GEMM shapes (12288 tokens: Wqkv, out, up and down
  projections, and the backward's two GEMMs of each), 10 s of warm-up, then each shape back to
  back for ``--sustain`` seconds (median TFLOP/s of its second half, SM clock and power logged by
  nvidia-smi where it exists), and the SDPA flash kernel forward + backward at causal, head dim
  128, sequence 2048 and 8192, each against the preset's price (``autopar.cost_model``);
- **memory**: the measured peak of one device of a plan against ``plan.peak_memory`` (the compiled
  one-rank run: ``torch.cuda.max_memory_allocated``; the simulated (2, 2) plan: autopar's storage
  count).

``--device cpu`` runs the same checks at toy sizes in fp32 on CPU in under 2 minutes (the suite runs
it, so the script works on the day a GPU is lent); the kernel rows then compare against the "cpu"
preset and say nothing about a GPU. The exit status is 1 when a parity or compiled check fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

START = time.monotonic()
ROWS: list[dict] = []


def row(section: str, case: str, measured: str, reference: str, verdict: str) -> None:
    ROWS.append({"section": section, "case": case, "measured": measured, "reference": reference, "verdict": verdict})
    print(f"  {section:9s} {case:42s} {measured:>22s}  vs {reference:>22s}  {verdict}", flush=True)


def left(budget: float) -> float:
    return budget - (time.monotonic() - START)


# -- models ------------------------------------------------------------------------------------------

def models(toy: bool):
    """(name, model, args, kwargs) of every parity model, seeded, on CPU."""
    from autopar.models import make

    torch.manual_seed(0)
    seq, batch = (32, 8) if toy else (512, 8)
    gpt = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=seq) if toy else \
        dict(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, block_size=seq)
    llama = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=seq) if toy else \
        dict(n_layers=4, dim=512, n_heads=8, n_kv_heads=4, vocab_size=8192, max_seq_len=seq)
    out = [("gpt", *make("gpt", "tiny", batch=batch, seq=seq, **gpt), {}),
           ("llama", *make("llama", "tiny", batch=batch, seq=seq, **llama), {})]
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return out
    transformers.logging.set_verbosity_error()
    width = 64 if toy else 512
    cfg = LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256 if toy else 8192, max_position_embeddings=seq)
    hf = LlamaForCausalLM(cfg)
    hf.config._attn_implementation = "sdpa"
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    out.append(("hf_llama", hf, (), {"input_ids": ids, "labels": ids}))
    return out


def _to(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def reference(model, args, kwargs, device: str, bf16: bool):
    """Loss and gradients of the model on one device (bf16 autocast on CUDA when ``bf16``)."""
    import copy

    m = copy.deepcopy(model).to(device)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    with ctx:
        out = m(*[_to(a, device) for a in args], **{k: _to(v, device) for k, v in kwargs.items()})
    loss = out if isinstance(out, torch.Tensor) else out["loss"]
    loss.float().backward()
    return loss.item(), {k: p.grad.float().cpu() for k, p in m.named_parameters() if p.grad is not None}


def grad_error(grads: dict, ref: dict) -> tuple[float, str]:
    worst, name = 0.0, ""
    for k, g in ref.items():
        e = float((grads[k].float().cpu() - g).norm() / g.norm().clamp_min(1e-12))
        if e > worst:
            worst, name = e, k
    return worst, name


def parity(device: str, preset: str, toy: bool, budget: float) -> bool:
    import autopar

    ok = True
    loss_tol, grad_tol = (1e-4, 1e-3) if toy else (3e-2, 1e-1)
    bf16 = not toy
    for name, model, args, kwargs in models(toy):
        ref_loss, ref_grads = reference(model, args, kwargs, device, bf16)
        for what, axes, recipe in (("searched (2, 2)", {"dp": 2, "tp": 2}, None), ("fsdp (8,)", {"dp": 8}, "fsdp")):
            if left(budget) < 30:
                row("parity", f"{name} {what}", "skipped", "(budget)", "skip")
                continue
            mesh = autopar.Mesh(axes, device=preset)
            plan = autopar.plan(model, mesh, args, kwargs, **({"recipe": recipe} if recipe else {}))
            run = model.to(device)
            extra = {"device": device} if device != "cpu" else {}
            loss, grads = autopar.simulate(run, plan, [_to(a, device) for a in args],
                                           {k: _to(v, device) for k, v in kwargs.items()},
                                           precision="plan" if bf16 else "model", **extra)
            model.to("cpu")
            loss = float(loss if isinstance(loss, torch.Tensor) else loss["loss"])  # the model's own output
            dl = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
            dg, worst = grad_error(grads, ref_grads)
            good = dl <= loss_tol and dg <= grad_tol
            ok &= good
            row("parity", f"{name} {what}", f"loss {dl:.1e}, grad {dg:.1e}", f"<= {loss_tol:.0e}, {grad_tol:.0e}",
                "ok" if good else f"FAIL ({worst})")
    return ok


# -- compiled one-rank run ---------------------------------------------------------------------------

def _one_rank(toy: bool, backend: str, preset: str, steps: int) -> dict:
    import autopar
    from autopar.models import make

    device = "cuda" if torch.cuda.is_available() and preset != "cpu" else "cpu"
    dims = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64) if toy else \
        dict(n_layers=4, dim=1024, n_heads=16, n_kv_heads=8, vocab_size=16384, max_seq_len=1024)
    seq = 64 if toy else 1024
    out: dict = {}
    for choice in (False, backend):
        torch.manual_seed(0)
        model, inputs = make("llama", "tiny", batch=4, seq=seq, **dims)
        pm = autopar.compile(model, autopar.Mesh({"dp": 1}, device=preset), [x.to(device) for x in inputs],
                             compile=choice)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        times, losses = [], []
        for i in range(steps):
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            loss = pm(*[x.to(device) for x in inputs])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            losses.append(loss.item())
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        if device == "cpu" and not choice:  # one more step, measured (watching every op slows it)
            pm.track_memory(opt)
            pm(*inputs).backward()
            opt.step()
            opt.zero_grad()
            peak = pm.memory_stats()["peak"]
        out["compiled" if choice else "eager"] = {"first": times[0], "median": statistics.median(times[2:]),
                                                  "losses": losses, "peak": peak,
                                                  "predicted": pm.plan.peak_memory}
    return out


def compiled(preset: str, toy: bool, backend: str, budget: float) -> bool:
    import autopar

    if left(budget) < 60:
        row("compiled", "one-rank llama", "skipped", "(budget)", "skip")
        return True
    nccl = torch.cuda.is_available() and preset != "cpu"
    res = autopar.launch(_one_rank, 1, toy, backend, preset, 6 if toy else 12, backend="nccl" if nccl else "gloo")[0]
    e, c = res["eager"], res["compiled"]
    diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(e["losses"], c["losses"]))
    good = diff <= (1e-4 if toy else 2e-2)
    label = f"one-rank {'nccl' if nccl else 'gloo'} llama, {backend}"
    row("compiled", label + " step", f"{c['median'] * 1e3:.2f} ms", f"eager {e['median'] * 1e3:.2f} ms",
        f"x{e['median'] / c['median']:.2f}")
    row("compiled", label + " cold compile", f"{c['first']:.1f} s", f"eager first {e['first']:.1f} s", "")
    row("compiled", label + " loss", f"{diff:.1e}", "<= " + ("1e-4" if toy else "2e-2"), "ok" if good else "FAIL")
    row("memory", "one-rank llama (eager) peak", f"{e['peak'] / 2**20:.1f} MiB",
        f"plan {e['predicted'] / 2**20:.1f} MiB", f"x{e['peak'] / max(e['predicted'], 1):.2f} measured/plan")
    return good


# -- kernels -----------------------------------------------------------------------------------------

def _clock_log(path: Path):
    """nvidia-smi logging SM clock, power and throttle reasons every 100 ms, or None without it."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    fh = open(path, "w")
    return subprocess.Popen([smi, "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active",
                             "--format=csv,noheader,nounits", "-lms", "100"], stdout=fh, stderr=subprocess.DEVNULL)


def _clocks_between(path: Path, t0: float, t1: float, wall0: float) -> str:
    """Median SM clock (MHz) and power (W) of the log's lines between monotonic ``t0`` and ``t1``."""
    import datetime

    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = [p.strip() for p in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((stamp, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue
    sel = [r for r in rows if wall0 + t0 <= r[0] <= wall0 + t1]
    if not sel:
        return ""
    return f"{statistics.median(r[1] for r in sel):.0f} MHz {statistics.median(r[2] for r in sel):.0f} W"


def _rate(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:.1f} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.1f} GFLOP/s"


def _sustain(fn, seconds: float) -> float:
    """Median seconds of one call of ``fn`` over the second half of ``seconds`` of back-to-back calls."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        sync()
        t = time.perf_counter()
        for _ in range(5):
            fn()
        sync()
        times.append((time.perf_counter() - t) / 5)
    return statistics.median(times[len(times) // 2:])


def kernels(device: str, preset: str, toy: bool, sustain: float, warmup: float, budget: float) -> None:
    from autopar.cost_model import efficiency as ef
    from autopar.cost_model.hardware import PRESETS

    hw = PRESETS[preset]
    dtype = torch.float32 if toy else torch.bfloat16
    peak = hw.peak_flops["float32" if toy else "bfloat16"]
    tokens, width = (256, 128) if toy else (12288, 4096)
    shapes = [("Wqkv", 3 * width, width), ("out", width, width), ("up", 4 * width, width), ("down", width, 4 * width)]
    gemms = []  # (label, m, n, k): forward y = x W^T, input grad dx = dy W, weight grad dW = dy^T x
    for name, n, k in shapes:
        gemms += [(f"{name} fwd", tokens, n, k), (f"{name} dgrad", tokens, k, n), (f"{name} wgrad", n, k, tokens)]
    log = Path(tempfile.mkdtemp(prefix="autopar-gpu-check-")) / "clocks.csv"
    smi = _clock_log(log) if device == "cuda" else None
    wall0 = time.time() - time.monotonic()
    try:
        first = True
        for label, m, n, k in gemms:
            if left(budget) < sustain + 5:
                row("kernels", f"matmul {label}", "skipped", "(budget)", "skip")
                continue
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            if first:  # the GPU warm at its sustained clock before the first measurement
                _sustain(lambda: a @ b, warmup)
                first = False
            t0 = time.monotonic()
            sec = _sustain(lambda: a @ b, sustain)
            got = 2 * m * n * k / sec
            want = peak * ef.matmul(hw.efficiency, m * n, k)
            clocks = _clocks_between(log, t0 + sustain / 2, time.monotonic(), wall0) if smi else ""
            row("kernels", f"matmul {label} {m}x{n}x{k}", _rate(got), f"preset {_rate(want)}",
                f"x{got / want:.3f} {clocks}".rstrip())
        heads, hd = (4, 32) if toy else (32, 128)
        for seq in ((128, 256) if toy else (2048, 8192)):
            if left(budget) < sustain + 5:
                row("kernels", f"sdpa causal s={seq}", "skipped", "(budget)", "skip")
                continue
            batch = max(1, (tokens if not toy else 512) // seq)
            q, k_, v = (torch.randn(batch, heads, seq, hd, device=device, dtype=dtype, requires_grad=True)
                        for _ in range(3))
            g = torch.randn(batch, heads, seq, hd, device=device, dtype=dtype)

            def step():
                out = torch.nn.functional.scaled_dot_product_attention(q, k_, v, is_causal=True)
                torch.autograd.grad(out, (q, k_, v), g)

            if device == "cuda":
                from torch.nn.attention import SDPBackend, sdpa_kernel
                ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
            else:
                import contextlib
                ctx = contextlib.nullcontext()
            with ctx:
                sec = _sustain(step, sustain)
            fwd = 4 * batch * heads * seq * seq * hd / 2
            want = fwd / (peak * ef.attention(hw.efficiency, "fwd", seq, hd, True)) + \
                2.5 * fwd / (peak * ef.attention(hw.efficiency, "bwd", seq, hd, True))
            row("kernels", f"sdpa{' flash' if device == 'cuda' else ''} causal fwd+bwd b={batch} s={seq} d={hd}",
                f"{sec * 1e3:.2f} ms ({_rate(3.5 * fwd / sec)})", f"preset {want * 1e3:.2f} ms",
                f"x{want / sec:.3f} speed/price")
    finally:
        if smi is not None:
            smi.terminate()


def memory(device: str, preset: str, toy: bool, budget: float) -> None:
    import autopar

    if left(budget) < 30:
        row("memory", "simulated (2, 2)", "skipped", "(budget)", "skip")
        return
    name, model, args, kwargs = models(toy)[0]
    plan = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, device=preset), args, kwargs)
    extra = {"device": device} if device != "cpu" else {}
    run = model.to(device)
    *_, measured = autopar.simulate(run, plan, [_to(a, device) for a in args], {k: _to(v, device) for k, v in kwargs.items()},
                                    precision="plan" if not toy else "model", measure_memory=True, **extra)
    model.to("cpu")
    first = measured[min(measured)]
    row("memory", f"{name} searched (2, 2), device {min(measured)}", f"{first['peak'] / 2**20:.2f} MiB",
        f"plan {plan.peak_memory / 2**20:.2f} MiB", f"x{first['peak'] / max(plan.peak_memory, 1):.2f} measured/plan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (480 on cuda, 110 on cpu)")
    ap.add_argument("--sustain", type=float, default=None, help="seconds each kernel runs back to back (10 / 0.2)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (inductor on cuda, aot_eager on cpu)")
    ap.add_argument("--only", default="parity,compiled,kernels,memory", help="comma-separated sections")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    toy = args.device == "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --device cpu for the toy checks", file=sys.stderr)
        return 2
    budget = args.budget or (110.0 if toy else 480.0)
    sustain = args.sustain or (0.2 if toy else 10.0)
    preset = "cpu" if toy else ("h200" if "H200" in torch.cuda.get_device_name() else "h100")
    backend = args.compile_backend or ("aot_eager" if toy else "inductor")
    only = set(args.only.split(","))
    where = torch.cuda.get_device_name() if not toy else "CPU (toy sizes, fp32)"
    print(f"gpu_check on {where}, preset {preset}, torch {torch.__version__}, budget {budget:.0f} s", flush=True)
    ok = True
    if "parity" in only:
        ok &= parity(args.device, preset, toy, budget)
    if "compiled" in only:
        ok &= compiled(preset, toy, backend, budget)
    if "kernels" in only:
        kernels(args.device, preset, toy, sustain, 10.0 if not toy else 0.2, budget)
    if "memory" in only:
        memory(args.device, preset, toy, budget)
    print("\n| section | case | measured | reference | verdict |\n|---|---|---|---|---|")
    for r in ROWS:
        print(f"| {r['section']} | {r['case']} | {r['measured']} | {r['reference']} | {r['verdict']} |")
    print(f"\n{'all checks passed' if ok else 'a check FAILED'} in {time.monotonic() - START:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "preset": preset, "ok": ok, "rows": ROWS}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
