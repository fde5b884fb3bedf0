"""What each process of ``benchmarks/runtime.py`` runs: the models (GPT-2-style and LLaMA-style),
hand-written tensor parallelism and DDP, the checks against a single-process reference, and the
launched function that builds every variant and times them interleaved (see ``runtime.py``).
"""

from __future__ import annotations

import json
import logging
import time
import types

import torch

FULL = dict(n_embd=256, n_layer=4, n_head=8, vocab_size=1024, block_size=128, batch=8, seq=64)
QUICK = dict(n_embd=128, n_layer=2, n_head=8, vocab_size=512, block_size=64, batch=8, seq=64)
#: the LLaMA-style model of each config: the GPT's width, depth, heads and vocabulary; grouped
#: query attention (half as many key/value heads), SwiGLU with ffn_dim ~ 8/3 of the width, RMSNorm,
#: rotary embeddings, untied head
LLAMA_KV_HEADS = 4
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
