"""Measure autopar's efficiency tables on one CUDA GPU and a one-GPU training step of a small LLaMA,
and print them against what the preset predicts.

Needs only torch with CUDA (any version since 1.13) and the standard library; never imported by
``make test``. At most about 10 minutes: the tables stop at ``--budget`` seconds (420; what is left
is skipped and said so), then the training step takes under a minute. Without a CUDA device it says so and exits with status 2.

    python benchmarks/gpu_calibrate.py [--preset h100] [--budget 540] [--json out.json]

Tables (bf16, random normal data: zeros run faster than real data, as power draw differs):

- matmul: achieved fraction of the preset's peak for square, skinny and short-K shapes and the
  shapes of a 7B decoder, against ``efficiency.matmul`` of the preset;
- attention: SDPA forward and backward (the flash backend where torch lets it be chosen) by
  sequence, head dim and causality, against ``efficiency.attention``;
- memory: copies of 64 KiB to 1 GiB, and a fused AdamW step, against ``efficiency.memory``;
- the fitted ``efficiency`` parameters (to paste into a profile's ``"efficiency"``);
- a training step (forward, backward, fused AdamW) of a small LLaMA in bf16 autocast: measured
  against autopar's plan for one device of the preset when autopar imports here, else against a
  per-kernel sum of the same curves (said which).

The predicted side reads ``autopar/cost_model/efficiency.py`` and ``hardware.py`` from this checkout
(both need only the standard library); the rest of autopar is used only if it imports.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import statistics
import sys
import time
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
START = time.monotonic()


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def cost_model():
    """(hardware module, efficiency module): from autopar if it imports, else the two files alone."""
    try:
        sys.path.insert(0, str(ROOT))
        import autopar.cost_model.efficiency as ef
        import autopar.cost_model.hardware as hw
        return hw, ef, True
    except Exception:  # autopar's other dependencies are missing here: load the two stdlib-only files
        for name in [m for m in sys.modules if m == "autopar" or m.startswith("autopar.")]:
            del sys.modules[name]
    for name in ("autopar", "autopar.cost_model"):
        mod = types.ModuleType(name)
        mod.__path__ = []
        sys.modules[name] = mod
    out = []
    for name in ("efficiency", "hardware"):
        spec = importlib.util.spec_from_file_location(f"autopar.cost_model.{name}", ROOT / "autopar" / "cost_model" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        out.append(mod)
    return out[1], out[0], False


def timed(fn, reps: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``reps`` CUDA-event-timed calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def over_budget(args) -> bool:
    return time.monotonic() - START > args.budget


MATMULS = [(8192, 8192, 8192), (4096, 4096, 4096), (2048, 2048, 2048), (1024, 1024, 1024), (512, 512, 512),
           (256, 8192, 8192), (1024, 8192, 8192), (8192, 8192, 256), (8192, 8192, 1024),
           (12288, 12288, 4096), (12288, 4096, 4096), (12288, 11008, 4096), (4096, 12288, 12288)]


def matmul_table(args, hwm, ef, preset, rows: list) -> None:
    import torch

    peak = preset.flops("bfloat16")
    _say(f"{'M':>6} {'N':>6} {'K':>6} {'TFLOP/s':>8} {'measured':>9} {'predicted':>9} {'pred/meas':>9}")
    for m, n, k in MATMULS:
        if over_budget(args):
            _say("(budget spent: the remaining matmul shapes skipped)")
            return
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        t = timed(lambda: a @ b)
        meas = 2 * m * n * k / t / peak
        pred = ef.matmul(preset.efficiency, m * n, k)
        rows.append(("matmul", (m, n, k), meas, pred))
        _say(f"{m:>6} {n:>6} {k:>6} {meas * peak / 1e12:>8.0f} {meas:>9.3f} {pred:>9.3f} {pred / meas:>9.2f}")
        del a, b


def _sdpa_context(torch):
    """The flash backend where this torch can select it, else a no-op context."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    except Exception:
        try:
            return torch.backends.cuda.sdp_kernel(enable_flash=True, enable_math=False, enable_mem_efficient=False)
        except Exception:
            import contextlib
            return contextlib.nullcontext()


def attention_table(args, hwm, ef, preset, rows: list) -> None:
    import torch
    import torch.nn.functional as F

    peak = preset.flops("bfloat16")
    _say(f"{'seq':>6} {'hd':>4} {'causal':>6} {'fwd meas':>9} {'fwd pred':>9} {'bwd meas':>9} {'bwd pred':>9}")
    tokens = 16384
    for hd in (128, 64):
        for causal in (True, False):
            for s in (512, 1024, 2048, 4096, 8192):
                if over_budget(args):
                    _say("(budget spent: the remaining attention shapes skipped)")
                    return
                heads = 2048 // hd
                b = max(1, tokens // s)
                q, k, v = (torch.randn(b, heads, s, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                flops = 4.0 * b * heads * s * s * hd / (2 if causal else 1)
                with _sdpa_context(torch):
                    t_f = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    g = torch.randn_like(out)
                    t_b = timed(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
                mf, mb = flops / t_f / peak, 2.5 * flops / t_b / peak
                pf = ef.attention(preset.efficiency, "fwd", s, hd, causal)
                pb = ef.attention(preset.efficiency, "bwd", s, hd, causal)
                rows.append(("attention", (s, hd, causal), (mf, mb), (pf, pb)))
                _say(f"{s:>6} {hd:>4} {str(causal):>6} {mf:>9.3f} {pf:>9.3f} {mb:>9.3f} {pb:>9.3f}")
                del q, k, v, out, g


def memory_table(args, hwm, ef, preset, rows: list) -> None:
    import torch

    bw = preset.hbm_bandwidth
    _say(f"{'bytes moved':>12} {'GB/s':>8} {'measured':>9} {'predicted':>9}")
    for size in (64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30):
        if over_budget(args):
            _say("(budget spent: the remaining copies skipped)")
            return
        x = torch.empty(size // 2, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        t = timed(lambda: y.copy_(x), reps=20)
        moved = 2 * size
        meas, pred = moved / t / bw, ef.memory(preset.efficiency, moved)
        rows.append(("memory", moved, meas, pred))
        _say(f"{moved:>12} {moved / t / 1e9:>8.0f} {meas:>9.3f} {pred:>9.3f}")
        del x, y
    # the optimizer step: fused AdamW over 100M fp32 parameters (read 16, write 12 bytes each)
    n = 100_000_000
    p = torch.zeros(n, device="cuda", requires_grad=True)
    p.grad = torch.randn(n, device="cuda")
    try:
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    except Exception:
        opt = torch.optim.AdamW([p], lr=1e-4)
    t = timed(opt.step, reps=10)
    moved = 28 * n
    meas, pred = moved / t / bw, ef.memory(preset.efficiency, moved)
    rows.append(("adamw", n, meas, pred))
    _say(f"AdamW step, 100M params: {t * 1e3:.2f} ms, {meas:.3f} of the bandwidth (predicted {pred:.3f})")
    del p, opt


def fit(ef, rows: list, preset) -> dict:
    """The efficiency parameters the measurements give (the preset's where a table was skipped)."""
    e = preset.efficiency.to_dict()
    mm = {shape: meas for kind, shape, meas, _ in rows if kind == "matmul"}
    if (8192, 8192, 8192) in mm:
        big = mm[(8192, 8192, 8192)]
        e["mm_max"] = max(mm.values())
        if (256, 8192, 8192) in mm:
            x = 256 * 8192
            e["mm_half_mn"] = max(0.0, x * (big / mm[(256, 8192, 8192)] - 1))
        if (8192, 8192, 256) in mm:
            e["mm_half_k"] = max(0.0, 256 * (big / mm[(8192, 8192, 256)] - 1))
    att = {shape: meas for kind, shape, meas, _ in rows if kind == "attention"}
    s1, s2 = (512, 128, False), (8192, 128, False)
    if s1 in att and s2 in att:
        for i, key in ((0, "attn_fwd"), (1, "attn_bwd")):
            e1, e2 = att[s1][i], att[s2][i]
            r = e1 / e2
            den = r * 8192 - 512
            h = 512 * 8192 * (1 - r) / den if den > 0 and r < 1 else 0.0
            e[key] = e2 * (8192 + h) / 8192
            if i == 0:
                e["attn_half_seq"] = h
        if (8192, 64, False) in att:
            ratio = att[(8192, 64, False)][0] / att[s2][0]  # = (64/(64+h)) / (128/(128+h))
            if 0 < ratio < 1:
                e["attn_half_head_dim"] = 64 * 128 * (1 - ratio) / (128 * ratio - 64) if 128 * ratio > 64 else 0.0
    mem = {moved: meas for kind, moved, meas, _ in rows if kind == "memory"}
    if mem:
        top = max(mem)
        e["mem_max"] = mem[top]
        small = min(mem)
        e["mem_half_bytes"] = max(0.0, small * (mem[top] / mem[small] - 1))
    return e


def llama_step(args, hwm, ef, preset, full_autopar: bool) -> None:
    """A one-GPU training step of a small LLaMA (RMSNorm, RoPE-free for brevity, SwiGLU, causal SDPA)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    dim, layers, heads, ffn, vocab, seq, batch = 2048, 8, 16, 5632, 32000, 2048, 4

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            norm = getattr(nn, "RMSNorm", nn.LayerNorm)  # RMSNorm from torch 2.4
            self.n1, self.n2 = norm(dim), norm(dim)
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
            self.w1, self.w3 = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
            self.w2 = nn.Linear(ffn, dim, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            h = self.n1(x)
            q, k, v = (w(h).view(b, s, heads, dim // heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, dim)
            x = x + self.wo(a)
            h = self.n2(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, ids, targets):
            x = self.emb(ids)
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.view(-1, vocab).float(), targets.view(-1))

    model = Llama().cuda()
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except Exception:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    measured = timed(step, reps=10, warmup=3)
    params = sum(p.numel() for p in model.parameters())
    mm_weights = params - vocab * dim  # the embedding is a lookup
    flops = (6 * mm_weights + 12 * layers * dim * seq) * batch * seq
    _say(f"LLaMA {layers} x {dim}, {params / 1e6:.0f}M params, batch {batch} x {seq}: measured step "
         f"{measured * 1e3:.1f} ms, MFU {flops / measured / preset.flops('bfloat16'):.3f}")
    predicted, how = None, ""
    if full_autopar:
        try:
            import autopar

            with torch.device("meta"):
                meta_model = Llama()
            cpu_ids = torch.randint(0, vocab, (batch, seq))
            plan = autopar.plan(meta_model, autopar.Mesh({"d": 1}, device=args.preset),
                                (cpu_ids, cpu_ids), progress=False)
            predicted, how = plan.step_time, f"autopar.plan on {args.preset} (MFU {plan.mfu:.3f})"
        except Exception as exc:  # say why, and fall back
            how = f"autopar.plan failed ({type(exc).__name__}: {exc})"
    if predicted is None:
        e, peak = preset.efficiency, preset.flops("bfloat16")
        tok = batch * seq
        t = 0.0
        for n_out, k in [(dim, dim)] * 4 + [(ffn, dim)] * 2 + [(dim, ffn)]:
            t += 3 * 2 * tok * n_out * k / (peak * ef.matmul(e, tok * n_out, k))  # forward, dgrad, wgrad
        att = 4.0 * batch * heads * seq * seq * (dim // heads) / 2
        t += att / (peak * ef.attention(e, "fwd", seq, dim // heads, True))
        t += 2.5 * att / (peak * ef.attention(e, "bwd", seq, dim // heads, True))
        t *= layers
        t += 3 * 2 * tok * vocab * dim / (peak * ef.matmul(e, tok * vocab, dim))
        elementwise = layers * tok * dim * 2 * 60 + tok * vocab * 4 * 6  # ~60 h-wide bf16 passes a layer; the loss
        t += elementwise / (preset.hbm_bandwidth * e.mem_max)
        t += 28 * params / (preset.hbm_bandwidth * e.mem_max)
        predicted, how = t, how + ("; " if how else "") + "per-kernel sum of the preset's curves (autopar not used)"
    _say(f"predicted step {predicted * 1e3:.1f} ms ({how}); predicted/measured {predicted / measured:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="h100", help="the preset to predict with (h100, h200, a100)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the tables; the step runs after")
    ap.add_argument("--json", help="write the measurements and the fitted efficiency here")
    ap.add_argument("--skip-step", action="store_true", help="leave out the LLaMA training step")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        _say("gpu_calibrate: torch is not installed")
        return 2
    if not torch.cuda.is_available():
        _say("gpu_calibrate: no CUDA device here (torch.cuda.is_available() is False); nothing measured")
        return 2
    hwm, ef, full = cost_model()
    preset = hwm.PRESETS[args.preset]
    _say(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}; predicting with "
         f"the {args.preset} preset (autopar {'imported' if full else 'not importable: cost model files only'})")
    rows: list = []
    for name, table in (("matmul (fraction of peak bf16)", matmul_table), ("attention", attention_table),
                        ("memory (fraction of HBM bandwidth)", memory_table)):
        _say(f"\n== {name}")
        table(args, hwm, ef, preset, rows)
        torch.cuda.empty_cache()
    fitted = fit(ef, rows, preset)
    _say("\n== fitted efficiency (a profile's \"efficiency\"):")
    _say(json.dumps(fitted, indent=1))
    if not args.skip_step:
        _say("\n== training step")
        llama_step(args, hwm, ef, preset, full)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [list(map(str, r)) for r in rows], "fitted": fitted}, f, indent=1)
    _say(f"\ndone in {time.monotonic() - START:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
