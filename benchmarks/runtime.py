"""Lowered programs against hand-written parallelism, and predicted against measured step time,
on 4 local gloo processes, GPT-2-style and LLaMA-style models.

One ``autopar.launch(run, 4)`` run builds every variant, checks each against a single-process
reference (loss and every gradient), then times them interleaved (round robin, a barrier before
every step), so machine noise hits all variants alike:

1. **autopar against hand-written** on mesh (4,):
   - the lowered program of ``autopar.recipes.megatron_tp`` against DTensor tensor parallelism
     written by hand: ``parallelize_module`` with ``ColwiseParallel`` on ``attn.qkv`` and
     ``mlp.fc`` and ``RowwiseParallel`` on ``attn.proj`` and ``mlp.proj`` (the qkv rows permuted
     so each rank holds whole heads of q, k and v, the attention run on the local heads, as
     Megatron does); embeddings, LayerNorms and the tied LM head replicated;
   - the lowered program of ``autopar.recipes.ddp`` against ``DistributedDataParallel`` (each rank
     its quarter of the same global batch).
2. **predicted against measured**: plans made with the calibrated ``cpu`` profile, per case
   (``CASES``: GPT and LLaMA, meshes (4,) and (2, 2), the config's batch and twice it) the recipes
   and the searched plan; the plan's ``step_time`` against the measured training step (forward,
   backward and the AdamW step, which the plan prices too), their Spearman rank correlation, and
   per case whether the searched plan measured fastest or its min-max range overlaps the fastest's.

Every variant's collectives per forward + backward are counted (a dispatch mode on the
``_c10d_functional`` and ``c10d`` ops, so DDP's bucketed all-reduces count too), in an untimed
steady-state step. The script exits 1 if a variant's loss or gradients differ from the reference
(relative 1e-5 / 1e-4).

Step time = forward + backward (the loss's ``backward()`` returns with every gradient in place),
the max over ranks, median over the timed steps; the AdamW step is timed too and reported apart in
the hand-written comparison; predicted against measured compares the whole step. Every variant's
AdamW runs with ``foreach=True`` (torch's default on CPU is the per-parameter loop; the same
setting for all, so the comparison is like for like: on DTensor parameters, whose every op pays
DTensor dispatch, the multi-tensor ops dispatch once per step instead of once per parameter;
DTensor and plain parameters go in separate parameter groups, as a multi-tensor op takes one kind).

    OMP_NUM_THREADS=1 python benchmarks/runtime.py [--quick] [--profile cpu-profile.json]
        [--steps 9] [--warmup 2] [--cprofile] [--only 'llama (2, 2)']

Without ``--profile`` the script first runs ``autopar.cost_model.calibrate.calibrate(path,
nprocs=4)`` into a temporary file (the ``autopar calibrate`` CLI) and reports how long it took.
Plans are made in the launching process (on a ``meta`` copy of the model) before the launch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import types

import torch

FULL = dict(n_embd=256, n_layer=4, n_head=8, vocab_size=1024, block_size=128, batch=8, seq=64)
QUICK = dict(n_embd=128, n_layer=2, n_head=8, vocab_size=512, block_size=64, batch=8, seq=64)
#: the LLaMA-style model of each config: the GPT's width, depth, heads and vocabulary; grouped
#: query attention (half as many key/value heads), SwiGLU with ffn_dim ~ 8/3 of the width, RMSNorm,
#: rotary embeddings, untied head
LLAMA_KV_HEADS = 4
#: the cases: (family, mesh shape, batch multiple of the config's, recipes); each also has a
#: searched plan, which should measure fastest of its case (or within the min-max noise)
CASES = [
    ("gpt", (4,), 1, ("ddp", "fsdp", "megatron_tp", "megatron_sp")),
    ("gpt", (2, 2), 1, ("ddp", "fsdp_tp", "megatron_tp")),
    ("gpt", (4,), 2, ("ddp", "megatron_tp")),
    ("llama", (4,), 1, ("ddp", "fsdp", "megatron_tp")),
    ("llama", (2, 2), 1, ("ddp", "fsdp_tp", "megatron_tp")),
    ("llama", (2, 2), 2, ("ddp", "megatron_tp")),
]
QUICK_CASES = [("gpt", (4,), 1, ("ddp", "megatron_tp")), ("llama", (2, 2), 1, ("ddp", "megatron_tp"))]
NPROCS = 4
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # relative, fp32
TP_LAYERS = {"attn.qkv": "colwise", "mlp.fc": "colwise", "attn.proj": "rowwise", "mlp.proj": "rowwise"}


# ------------------------------------------------------------------------------------------------
# model


def build(cfg: dict, device=None, batch=None, family: str = "gpt"):
    """The seeded model (``family`` "gpt" or "llama") and its (seeded) inputs: identical on every rank."""
    from autopar.models import make

    torch.manual_seed(0)
    if family == "llama":
        C = cfg["n_embd"]
        over = dict(dim=C, n_layers=cfg["n_layer"], n_heads=cfg["n_head"], n_kv_heads=LLAMA_KV_HEADS,
                    ffn_dim=(8 * C // 3 + 63) // 64 * 64, vocab_size=cfg["vocab_size"], max_seq_len=cfg["block_size"])
        return make("llama", "tiny", batch=batch or cfg["batch"], seq=cfg["seq"], device=device, **over)
    over = {k: cfg[k] for k in ("n_embd", "n_layer", "n_head", "vocab_size", "block_size")}
    return make("gpt", "tiny", batch=batch or cfg["batch"], seq=cfg["seq"], device=device, **over)


def _tp_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``CausalSelfAttention.forward`` on this rank's heads: ``qkv`` (colwise) yields this rank's
    [q | k | v] columns, ``proj`` (rowwise) sums the ranks' partial outputs."""
    import torch.nn.functional as F

    B, T, C = x.shape
    q, k, v = self.qkv(x).chunk(3, dim=-1)
    hd = C // self.n_head
    h = q.shape[-1] // hd
    q, k, v = (t.view(B, T, h, hd).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(B, T, h * hd))


def _qkv_order(C: int, tp: int) -> torch.Tensor:
    """Row order of the fused qkv weight that puts [q_r | k_r | v_r] in rank r's contiguous block."""
    w = C // tp
    return torch.cat([torch.arange(part * C + r * w, part * C + (r + 1) * w)
                      for r in range(tp) for part in range(3)])


def hand_tp(model, dmesh):
    """Hand-written Megatron tensor parallelism with DTensor's ``parallelize_module``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = dmesh.size()
    C = model.cfg.n_embd
    order = _qkv_order(C, tp)
    plan = {}
    with torch.no_grad():
        for i, blk in enumerate(model.blocks):
            blk.attn.qkv.weight.copy_(blk.attn.qkv.weight[order])
            blk.attn.qkv.bias.copy_(blk.attn.qkv.bias[order])
            blk.attn.forward = types.MethodType(_tp_attention_forward, blk.attn)
            for name, kind in TP_LAYERS.items():
                plan[f"blocks.{i}.{name}"] = ColwiseParallel() if kind == "colwise" else RowwiseParallel()
    return parallelize_module(model, dmesh, plan), order


# ------------------------------------------------------------------------------------------------
# checks


class CountCollectives:
    """Counts the collectives this thread dispatches (torch's functional ``_c10d_functional`` ops
    and the ``c10d`` process-group ops that ``torch.distributed`` and DDP's reducer call), by kind."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "_opname", "")
                if getattr(func, "namespace", "") in ("_c10d_functional", "c10d") and name not in (
                        "wait_tensor", "barrier", "monitored_barrier", "_wrap_tensor_autograd"):
                    flat = name.replace("_", "")
                    key = next((k for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
                                if k.replace("_", "") in flat), name.rstrip("_"))
                    counts[key] = counts.get(key, 0) + 1
                return func(*args, **(kwargs or {}))

        self.counts = counts
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def grad_error(model, ref_grads: dict, qkv_order=None) -> float:
    """Largest relative gradient error of ``model`` against the reference (a collective: every rank)."""
    worst = 0.0
    for n, p in model.named_parameters():
        name = n.replace("module.", "", 1) if n.startswith("module.") else n
        g = _full(p.grad)
        ref = ref_grads[name]
        if qkv_order is not None and name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
            ref = ref[qkv_order]
        worst = max(worst, _rel(g, ref))
    return worst


def adamw(module) -> "torch.optim.Optimizer":
    """AdamW with ``foreach=True``; DTensor and plain parameters in separate groups (a multi-tensor
    op takes one kind: hand-written TP mixes them)."""
    from torch.distributed.tensor import DTensor

    params = list(module.parameters())
    groups = [{"params": g} for g in ([p for p in params if isinstance(p, DTensor)],
                                      [p for p in params if not isinstance(p, DTensor)]) if g]
    return torch.optim.AdamW(groups, lr=1e-4, foreach=True)


# ------------------------------------------------------------------------------------------------
# the launched function


def run(cfg: dict, plans: list, steps: int, warmup: int, cprofile: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    import autopar
    from autopar.plans import Plan

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # full_tensor() on (2, 2)
    rank, world = dist.get_rank(), dist.get_world_size()
    t_start = time.perf_counter()
    # reference: one process, the whole batch
    ref, args = build(cfg)
    ref_loss = ref(*args)
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    ref_loss = ref_loss.item()
    del ref

    variants = []  # dicts: name, module, fn (forward, returns the loss), order (qkv rows), global_loss, opt

    # hand-written DTensor TP
    dmesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    m, _ = build(cfg)
    m, order = hand_tp(m, dmesh)
    variants.append(dict(name="hand:dtensor_tp", module=m, order=order, fn=(lambda m=m: m(*args)), global_loss=True))

    # hand-written DDP: this rank's quarter of the batch
    m, _ = build(cfg)
    b = cfg["batch"] // world
    local = tuple(a[rank * b:(rank + 1) * b] for a in args)
    ddp = DistributedDataParallel(m)
    variants.append(dict(name="hand:ddp", module=ddp, order=None, fn=(lambda d=ddp: d(*local)), global_loss=False))

    # autopar: every plan made by the parent
    compile_s = {}
    refs = {"gpt": (ref_loss, ref_grads)}
    for p in plans:
        fam = p["family"]
        if fam not in refs:  # this family's single-process reference at the config's batch
            r, ra = build(cfg, family=fam)
            rl = r(*ra)
            rl.backward()
            refs[fam] = (rl.item(), {n: q.grad.detach().clone() for n, q in r.named_parameters()})
            del r
        t0 = time.perf_counter()
        m, a = build(cfg, batch=p["batch"], family=fam)
        mesh = autopar.Mesh(dict(zip(p["axis_names"], p["mesh_shape"])), device="cpu")
        pm = autopar.compile(m, mesh, a, plan=Plan.from_dict(json.loads(p["json"])))
        compile_s[p["key"]] = time.perf_counter() - t0
        same_batch = p["batch"] == cfg["batch"]
        variants.append(dict(name=p["key"], module=pm, order=None, fn=(lambda pm=pm, a=a: pm(*a)),
                             global_loss=True, checked=same_batch, ref=refs[fam]))
    for v in variants:
        v["opt"] = adamw(v["module"])

    # checks: first step of every variant against the reference (loss and every gradient)
    checks = {}
    for v in variants:
        loss = v["fn"]()
        loss.backward()
        lv = loss.detach().clone()
        if not v["global_loss"]:
            dist.all_reduce(lv)
            lv /= world
        if v.get("checked", True):
            mod = v["module"].module if isinstance(v["module"], autopar.ParallelModule) else v["module"]
            rl, rg = v.get("ref", (ref_loss, ref_grads))
            checks[v["name"]] = dict(loss=lv.item(), ref_loss=rl, loss_err=abs(lv.item() - rl) / abs(rl),
                                     grad_err=grad_error(mod, rg, v["order"]))
        v["opt"].zero_grad(set_to_none=True)
    # the collectives of a steady-state forward+backward (the third: DDP rebuilds its buckets in the
    # second), untimed
    n_coll = {}
    for _ in range(2):
        for v in variants:
            with CountCollectives() as cc:
                v["fn"]().backward()
            n_coll[v["name"]] = cc.counts
            v["opt"].zero_grad(set_to_none=True)
    setup_s = time.perf_counter() - t_start

    # timing, interleaved
    times = {v["name"]: [] for v in variants}
    opt_times = {v["name"]: [] for v in variants}
    step_times = {v["name"]: [] for v in variants}
    for i in range(warmup + steps):
        order_i = variants if i % 2 == 0 else variants[::-1]
        for v in order_i:
            dist.barrier()
            t0 = time.perf_counter()
            loss = v["fn"]()
            loss.backward()
            t1 = time.perf_counter()
            v["opt"].step()
            v["opt"].zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if i >= warmup:
                times[v["name"]].append(t1 - t0)
                opt_times[v["name"]].append(t2 - t1)
                step_times[v["name"]].append(t2 - t0)
    # max over ranks, per step
    packed = torch.tensor([[*times[v["name"]], *opt_times[v["name"]], *step_times[v["name"]]] for v in variants],
                          dtype=torch.float64)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    out = {}
    for k, v in enumerate(variants):
        row = packed[k].tolist()
        out[v["name"]] = dict(fwd_bwd=row[:steps], opt=row[steps:2 * steps], step=row[2 * steps:])

    prof = None
    if cprofile:
        prof = profile_steps(variants, ["hand:dtensor_tp", "gpt (4,) megatron_tp", "hand:ddp", "gpt (4,) ddp"])
    if rank != 0:
        return None
    return dict(times=out, checks=checks, collectives=n_coll, compile_s=compile_s, setup_s=setup_s, cprofile=prof,
                world=world, torch=torch.__version__)


def profile_steps(variants, names, reps: int = 3) -> dict:
    """cProfile of ``reps`` forward+backward steps of each named variant, on every rank (rank 0's
    report kept): the top functions by own time."""
    import cProfile
    import io
    import pstats

    import torch.distributed as dist

    res = {}
    for v in variants:
        if v["name"] not in names:
            continue
        pr = cProfile.Profile()
        dist.barrier()
        pr.enable()
        for _ in range(reps):
            v["fn"]().backward()
            v["opt"].zero_grad(set_to_none=True)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
        res[v["name"]] = s.getvalue()
    return res


# ------------------------------------------------------------------------------------------------
# parent: calibrate, plan, launch, report


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1  # ties share the mean rank
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else float("nan")


def _key(family: str, shape, recipe: str, mult: int) -> str:
    return f"{family} ({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''}) {recipe}" + (
        f" b x{mult}" if mult != 1 else "")


def case_of(key: str) -> str:
    """The case (family, mesh, batch) of a plan's key: the key without its recipe."""
    head, rest = key.split(") ", 1)
    parts = rest.split(" ")
    return head + ")" + ("".join(" " + x for x in parts[1:]))


def make_plans(cfg: dict, profile: str, quick: bool, det_time: float, only: str | None = None) -> list:
    """Every case's recipes and searched plan, priced on ``profile`` (made in this process, on
    ``meta`` copies of the models)."""
    import autopar
    from autopar.ir.capture import capture

    graphs = {}
    plans = []
    for family, shape, mult, recipes in (QUICK_CASES if quick else CASES):
        if only and only not in case_of(_key(family, shape, "x", mult)):
            continue
        batch = cfg["batch"] * mult
        for recipe in (*recipes, "search"):
            axes = {"dp": shape[0]} if len(shape) == 1 else {"dp": shape[0], "tp": shape[1]}
            if recipe in ("megatron_tp", "megatron_sp") and len(shape) == 1:
                axes = {"tp": shape[0]}
            mesh = autopar.Mesh(axes, device="cpu", profile=profile)
            model, inputs = build(cfg, device="meta", batch=batch, family=family)
            if (family, batch) not in graphs:
                graphs[family, batch] = capture(model, inputs)
            graph = graphs[family, batch]
            t0 = time.perf_counter()
            if recipe == "search":
                plan = autopar.plan(model, mesh, inputs, graph=graph, deterministic_time=det_time, progress=False)
            else:
                plan = getattr(autopar.recipes, recipe)(model, mesh, inputs, graph=graph, progress=False)
            key = _key(family, shape, recipe, mult)
            plans.append(dict(key=key, family=family, recipe=recipe, source=plan.source, batch=batch,
                              mesh_shape=list(plan.mesh_shape), axis_names=list(plan.axis_names),
                              json=plan.to_json(timing=False), step_time=plan.step_time,
                              compute_time=plan.compute_time, comm_time=plan.comm_time,
                              n_collectives=_planned_collectives(plan), plan_s=time.perf_counter() - t0))
            print(f"planned {key}: {plan.source}, predicted {plan.step_time * 1e3:.1f} ms "
                  f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    return plans


def _planned_collectives(plan) -> int:
    """Collective calls per step the plan lists (``plan.collectives``, each ``count`` times)."""
    return sum(int(c.get("count", 1)) for c in plan.collectives)


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def report(cfg, res, plans, steps, warmup, calib_s, profile, args) -> int:
    T = res["times"]
    med = {k: statistics.median(v["fwd_bwd"]) for k, v in T.items()}
    omed = {k: statistics.median(v["opt"]) for k, v in T.items()}
    spread = {k: (min(v["fwd_bwd"]), max(v["fwd_bwd"])) for k, v in T.items()}
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}

    def coll(k):
        c = res["collectives"][k]
        return f"{sum(c.values())} (" + " ".join(f"{v} {short.get(n, n)}" for n, v in sorted(c.items())) + ")"
    print(f"\nGPT and LLaMA (GQA {LLAMA_KV_HEADS} kv heads, SwiGLU) n_layer={cfg['n_layer']} n_embd={cfg['n_embd']} "
          f"n_head={cfg['n_head']} vocab={cfg['vocab_size']}, "
          f"global batch {cfg['batch']} x seq {cfg['seq']}, fp32, {res['world']} gloo processes, "
          f"torch {res['torch']}; warmup {warmup}, median of {steps} steps (max over ranks), interleaved")
    print(f"autopar at {_git_rev()}")
    print(f"load average (1 min) before / after the launch: {res['load'][0]:.1f} / {res['load'][1]:.1f}")
    print(f"profile: {profile}" + (f" (calibrated in {calib_s:.1f} s)" if calib_s is not None else "") +
          f": {res['profile_figures']}")
    for line in res.get("calibration") or ():
        print(f"    {line}")
    print(f"setup in the ranks (reference, compile x{len(plans)}, checks): {res['setup_s']:.1f} s; "
          f"compile per plan: {', '.join(f'{v:.1f}' for v in res['compile_s'].values())} s\n")

    print("### autopar against hand-written, mesh (4,)\n")
    print("| variant | loss (ref) | max rel. grad err | collectives per fwd+bwd | fwd+bwd ms median [min-max] | AdamW (foreach) step ms | ratio fwd+bwd | ratio fwd+bwd+opt |")
    print("|---|---|---|---|---|---|---|---|")
    for mine, hand in (("gpt (4,) megatron_tp", "hand:dtensor_tp"), ("gpt (4,) ddp", "hand:ddp")):
        if mine not in T:
            continue
        for k in (mine, hand):
            c = res["checks"][k]
            lo, hi = spread[k]
            r1 = med[mine] / med[hand]
            r2 = (med[mine] + omed[mine]) / (med[hand] + omed[hand])
            ratio = (f"**{r1:.2f}**", f"{r2:.2f}") if k == mine else ("1", "1")
            label = {"hand:dtensor_tp": "hand-written: DTensor parallelize_module (Colwise/Rowwise)",
                     "hand:ddp": "hand-written: torch DistributedDataParallel"}.get(k) or f"autopar {k}"
            print(f"| {label} | {c['loss']:.6f} ({c['ref_loss']:.6f}) | {c['grad_err']:.1e} | {coll(k)} | {ms(med[k])} "
                  f"[{ms(lo)}-{ms(hi)}] | {ms(omed[k])} | {ratio[0]} | {ratio[1]} |")

    print("\n### predicted (calibrated cpu profile) against measured\n")
    print("Measured: one training step (forward + backward + AdamW foreach step: what a plan's step time "
          "prices), max over ranks; median [min-max] of the timed steps.\n")
    print("| plan | source | batch | predicted ms (compute / comm) | measured step ms median [min-max] | measured / predicted | collectives per fwd+bwd (planned per step) | check: loss err, grad err |")
    print("|---|---|---|---|---|---|---|---|")
    smed = {k: statistics.median(v["step"]) for k, v in T.items()}
    srange = {k: (min(v["step"]), max(v["step"])) for k, v in T.items()}
    xs, ys = [], []
    for p in plans:
        k = p["key"]
        c = res["checks"].get(k)
        chk = f"{c['loss_err']:.0e}, {c['grad_err']:.0e}" if c else "(other batch)"
        lo, hi = srange[k]
        print(f"| {k} | {p['source']} | {p['batch']}x{cfg['seq']} | {ms(p['step_time'])} ({ms(p['compute_time'])} / "
              f"{ms(p['comm_time'])}) | {ms(smed[k])} [{ms(lo)}-{ms(hi)}] | {smed[k] / p['step_time']:.2f} | {coll(k)} "
              f"({p.get('n_collectives', '?')}) | {chk} |")
        xs.append(p["step_time"])
        ys.append(smed[k])
    rho = spearman(xs, ys)
    print(f"\nSpearman rank correlation, predicted vs measured, {len(xs)} plans: **{rho:.2f}**")
    ncoll = [sum(res["collectives"][p["key"]].values()) for p in plans]
    print(f"Spearman rank correlation, number of collectives vs measured: {spearman(ncoll, ys):.2f}")
    pearson_log = _pearson([math.log(x) for x in xs], [math.log(y) for y in ys])
    print(f"Pearson correlation of log times: {pearson_log:.2f}; "
          f"measured/predicted median {statistics.median(y / x for x, y in zip(xs, ys)):.2f}")
    print("\n### the searched plan in each case\n")
    print("| case | searched plan ms median [min-max] | fastest measured | its ms median [min-max] | predicted fastest | verdict |")
    print("|---|---|---|---|---|---|")
    cases: dict = {}
    for p in plans:
        cases.setdefault(case_of(p["key"]), []).append(p)
    fails = 0
    for case, ps in cases.items():
        srch = next((p for p in ps if p["recipe"] == "search"), None)
        if srch is None:
            continue
        best = min(ps, key=lambda p: smed[p["key"]])
        pbest = min(ps, key=lambda p: p["step_time"])
        s_lo, s_hi = srange[srch["key"]]
        b_lo, b_hi = srange[best["key"]]
        if best is srch:
            verdict = "fastest"
        elif s_lo <= b_hi:
            verdict = "overlaps the fastest"
        else:
            verdict = "**slower**"
            fails += 1
        print(f"| {case} | {ms(smed[srch['key']])} [{ms(s_lo)}-{ms(s_hi)}] | {best['recipe']} | {ms(smed[best['key']])} "
              f"[{ms(b_lo)}-{ms(b_hi)}] | {pbest['recipe']} | {verdict} |")
    print(f"\nsearched plan fastest or within the fastest's min-max in {len(cases) - fails} of {len(cases)} cases; "
          f"Spearman {rho:.2f} over {len(xs)} plans")
    if res.get("cprofile"):
        print("\n### cProfile, rank 0, 3 forward+backward steps each\n")
        for k, text in res["cprofile"].items():
            print(f"#### {k}\n```\n{text.strip()}\n```")
    bad = [k for k, c in res["checks"].items() if not (c["loss_err"] < LOSS_TOL and c["grad_err"] < GRAD_TOL)]
    if bad:
        print(f"\nMISMATCH against the single-process reference (loss rel. err >= {LOSS_TOL:g} or grad rel. err >= "
              f"{GRAD_TOL:g}): {', '.join(bad)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cfg=cfg, res=res, plans=[{k: v for k, v in p.items() if k != "json"} for p in plans]), f, indent=1)
    return 1 if bad else 0


def _git_rev() -> str:
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "../autopar"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev or "?") + (" + uncommitted changes in autopar/" if dirty else "")
    except Exception:  # noqa: BLE001 - not a git checkout
        return "unknown revision"


def _pearson(a, b) -> float:
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    num = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    den = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return num / den if den else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, fewer plans and steps (smoke run)")
    ap.add_argument("--profile", help="a calibrated cpu profile (default: calibrate now into a temp file)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 9; 3 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2; 1 with --quick)")
    ap.add_argument("--deterministic-time", type=float, default=None, help="solver budget of the searched plans")
    ap.add_argument("--cprofile", action="store_true", help="also cProfile 3 steps of the TP and DDP variants")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--only", help="run only the cases whose name contains this (e.g. 'llama (2, 2)'; development)")
    args = ap.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    steps = args.steps or (3 if args.quick else 9)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    det = args.deterministic_time or (1.0 if args.quick else 5.0)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    print(f"autopar runtime benchmark, {datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs",
          file=sys.stderr)

    import autopar

    calib_s = None
    calib_lines = []
    profile = args.profile
    tmp = None
    if profile is None:
        from autopar.cost_model.calibrate import calibrate

        tmp = tempfile.TemporaryDirectory()
        profile = os.path.join(tmp.name, "cpu-profile.json")
        t0 = time.perf_counter()
        calib_lines: list = []
        calibrate(profile, nprocs=NPROCS, quick=args.quick, report=calib_lines)
        print("\n".join(calib_lines), file=sys.stderr, flush=True)
        calib_s = time.perf_counter() - t0
        print(f"calibrated in {calib_s:.1f} s", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    plans = make_plans(cfg, profile, args.quick, det, args.only)
    print(f"planned {len(plans)} plans in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    res = autopar.launch(run, NPROCS, cfg, plans, steps, warmup, args.cprofile, timeout=3600)[0]
    res["load"] = (load0, os.getloadavg()[0])
    with open(profile) as f:
        hw = json.load(f)
    res["profile_figures"] = (f"fp32 {hw['peak_flops']['float32'] / 1e9:.0f} GFLOP/s, memory {hw['hbm_bandwidth'] / 1e9:.1f} GB/s, "
                              f"launch {hw['launch_floor'] * 1e6:.1f} us, gloo link {hw['intra_node']['latency'] * 1e6:.0f} us + "
                              f"{hw['intra_node']['bandwidth'] / 1e9:.2f} GB/s")
    res["calibration"] = calib_lines
    print(f"launch run: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return report(cfg, res, plans, steps, warmup, calib_s, args.profile or "calibrated now (temporary file)", args)


if __name__ == "__main__":
    sys.exit(main())
