"""Published training runs, priced: MosaicML llm-foundry's MPT benchmark rows (H100 and A100, FSDP,
sequence 2048) against autopar's prediction for the same model, batch, mesh and recomputation.

The published rows are copied below from llm-foundry's ``scripts/train/benchmarking/README.md``
(github.com/mosaicml/llm-foundry, tables "H100 80GB BF16" and "A100 80GB with 1600 Gbps node-node
interconnect (RoCE)"): model, GPUs, micro-batch per GPU, activation checkpointing, MFU and
tokens/s per GPU. Nothing here is fitted to them: the efficiencies come from the presets'
kernel-level sources (``autopar/cost_model/hardware.py``); the rows are a check.

Each row is autopar's GPT at the MPT shape of those runs (vocabulary 50368, biases, learned
positions: the parameter count equals the table's NumParams), global batch = micro-batch x GPUs
sequences of 2048, mesh ``{"dp": GPUs}`` of the preset (8 GPUs and 8 NICs per node),
``recipe="fsdp"`` (FSDP's full sharding), bf16-mixed AdamW (Composer's ``DEFAULT`` FSDP mixed
precision: bf16 gathers, fp32 gradient reduction; the ``PURE`` row reduces in bf16), and
``checkpointing="full"`` where the run recomputed. Attention is priced with the kernel those runs
used (``RUNS_ATTENTION_OF_FA2``), and the price includes the preset's ``overlap_slowdown`` (compute slowed by
the collectives hidden under it: autopar's own cost model) and, as the runs' runtime did it, FSDP1's
gradient concatenation, cast and pre-division (``FSDP1_GRAD_BYTES``) and its exposed first gathers
and last reductions (``EDGE_COLLECTIVES``), its accumulation of the reduced shard over micro-batches
(``SHARD_ACCUMULATE_BYTES``), and the runs' optimizer step (``RUNS_CLIP_BYTES``, ``RUNS_ADAMW_BYTES``)
in place of autopar's. The runs accumulate ``GradAccum`` micro-batches per optimizer step, with
FSDP gathering and reducing every micro-batch: autopar prices one micro-batch step, whose price
holds one optimizer step; ``price`` keeps 1/GradAccum of it. Predicted MFU uses llm-foundry's own
formula on the predicted throughput: (6 N + 12 L d s) x tokens/s / peak, N the parameters, so
predicted/published is the same ratio for MFU and throughput.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/published.py [--only 7b 13b] [--device h100] [--markdown]
        [--kernel preset] [--overlap-slowdown 0] [--no-grad-work] [--no-edges] [--no-runs-optimizer]
        [--intra-bandwidth 450]

``--markdown`` prints where each row's step goes (matmul / attention / other, of it recomputation,
the AdamW step's share, exposed communication, the compute slowed by hidden collectives, FSDP1's
work); ``--intra-bandwidth`` (GB/s) is a what-if on the NVLink figure, not part of the check.

Capturing the 30B and 70B models takes a minute or more each on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

SEQ = 2048
VOCAB = 50368
#: MPT shapes (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml): layers, width, heads
SHAPES = {"1b": (24, 2048, 16), "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40),
          "30b": (48, 7168, 56), "70b": (80, 8192, 64)}
#: (device, model, GPUs, micro-batch per GPU, activation checkpointing, published MFU %, tokens/s/GPU)
ROWS = [
    ("h100", "1b", 8, 14, False, 41.82, 45455),
    ("h100", "3b", 16, 10, False, 43.73, 24142),
    ("h100", "7b", 8, 6, False, 46.44, 10643),
    ("h100", "13b", 8, 2, False, 39.79, 4792),
    ("h100", "30b", 8, 3, True, 38.11, 2002),
    ("h100", "70b", 64, 8, True, 42.57, 1039),
    ("a100", "1b", 8, 14, False, 59.86, 20513),
    ("a100", "3b", 8, 10, False, 62.11, 10811),
    ("a100", "7b", 8, 6, False, 64.23, 4641),
    ("a100", "13b", 8, 2, False, 59.57, 2262),
    ("a100", "30b", 8, 3, True, 55.3, 916),
    ("a100", "70b", 64, 8, True, 53.33, 410),
]
PEAK = {"h100": 989e12, "a100": 312e12}
#: GradAccum of each row (the same tables): micro-batches per optimizer step
ACCUM = {("h100", "1b"): 1, ("h100", "3b"): 3, ("h100", "7b"): 1, ("h100", "13b"): 1, ("h100", "30b"): 21,
         ("h100", "70b"): 4, ("a100", "1b"): 4, ("a100", "3b"): 2, ("a100", "7b"): 2, ("a100", "13b"): 3,
         ("a100", "30b"): 21, ("a100", "70b"): 4}
#: rows whose FSDP mixed precision was PURE (gradients reduced in bf16); every other row ran Composer's
#: DEFAULT (bf16 gathers, fp32 gradient reduction: autopar's "bf16-mixed"; Composer's
#: get_mixed_precision in composer/trainer/mosaic_fsdp_utils.py of the time)
PURE = {("a100", "70b")}
#: The runs' attention kernel. llm-foundry's benchmark launcher (scripts/train/benchmarking/
#: submit_benchmarks.py at b2a43a1, the commit that published these tables) defaults ``--attn_impl``
#: to ``triton`` and sweep.sh does not override it: Tri Dao's FlashAttention in Triton
#: (llmfoundry/models/layers/flash_attn_triton.py on triton-pre-mlir, a pre-MLIR Triton patched to run
#: on sm90 but without Hopper instructions). Its header says forward + backward is "slightly slower"
#: than the CUDA FlashAttention of the time (FlashAttention-1; llm-foundry's TUTORIAL.md: "triton is
#: slightly faster than flash", flash = flash-attn 1.0.9). The presets price torch's SDPA, i.e.
#: FlashAttention-2. Kernel-level figures for both at the rows' shape (causal, head dim 128 on every
#: row: width / heads, sequence 2048) are in the FlashAttention-2 paper's forward + backward charts
#: (T. Dao, arXiv:2307.08691, its A100 and H100 figures; the same charts are
#: assets/flash2_a100_fwd_bwd_benchmark.png and assets/flash2_h100_fwd_bwd_benchmark.png in
#: github.com/Dao-AILab/flash-attention, panel "with causal mask, head dimension 128", sequence 2k;
#: TFLOP/s counted as 3.5 x 4 b h s^2 d / 2, autopar's count):
#: - A100 80GB SXM4: "FlashAttention Triton" 68, FlashAttention-1 69, FlashAttention-2 155 TFLOP/s.
#:   "FlashAttention Triton" is the label the repository's own benchmark script
#:   (benchmarks/benchmark_causal.py at the FlashAttention-2 release, 4f285b35) gives
#:   ``flash_attn.flash_attn_triton``, the kernel llm-foundry copied. 68 / 155 = 0.439.
#: - H100 80GB SXM5: FlashAttention-1 108, FlashAttention-2 265 TFLOP/s; the chart has no Triton bar.
#:   On A100 the Triton kernel ran at FlashAttention-1's rate at this shape (68 against 69), and on
#:   an H100 neither uses Hopper's warpgroup MMA or TMA (FlashAttention-3, arXiv:2407.08608, is the
#:   version that does; triton-pre-mlir's sm90 branch, github.com/vchiley/triton
#:   ``triton_pre_mlir_sm90``, only lets the PTX target be sm_90 (``lib/driver/llvm.cc``; the branch's
#:   whole diff from ``triton_pre_mlir`` is three files) and its tensor-core code is Ampere's
#:   ``mma.sync.aligned.m16n8k16``, ``include/triton/codegen/analysis/layout.h``), so the runs'
#:   kernel is priced at FlashAttention-1's H100 rate: 108 / 265 = 0.408.
#: The presets' FlashAttention-2 curves give 158 (A100) and 263 (H100) TFLOP/s at this shape, the
#: charts' FlashAttention-2 within 2%, so each row's attention is priced at the preset's curve times
#: the chart's ratio of the runs' kernel to FlashAttention-2 (forward and backward alike: the charts
#: give their sum). A kernel-level figure, not a fit; ``price`` refuses a shape the ratio was not read
#: at.
RUNS_ATTENTION_OF_FA2 = {"a100": 68 / 155, "h100": 108 / 265}
#: the shape the ratios above were read at: head dim, sequence, causal
RUNS_ATTENTION_SHAPE = (128, 2048, True)
#: The runs' runtime: torch's FSDP1 (``FULL_SHARD``, ``use_orig_params=True``: Composer's default,
#: ``set_fsdp_default`` in composer/trainer/dist_strategy.py of v0.16.4, the version llm-foundry's
#: setup.py at b2a43a1 pins), per micro-batch and per FSDP unit, three memory-bound kernels over the
#: unsharded gradient, in torch/distributed/fsdp:
#: - ``concat``: the forward uses views of the unsharded flat parameter made with ``torch.split``
#:   under ``enable_grad`` (``_flat_param.py``, ``_use_unsharded_views`` -> ``_get_unflat_views``),
#:   so autograd builds the flat gradient through ``SplitWithSizesBackward0``, which runs
#:   ``aten::cat`` over every parameter's gradient (checked here with the profiler on a CPU flat
#:   parameter; ``tests/test_published.py``): read 2, write 2 bytes per parameter (bf16, the
#:   unsharded parameter's dtype);
#: - ``cast``: ``_post_backward_hook`` (``_runtime_utils.py``) casts the unsharded gradient to the
#:   reduce dtype when they differ (``flat_param.grad.to(handle._reduce_dtype)``: read 2, write 4;
#:   Composer's DEFAULT reduces in fp32, PURE in bf16: no cast);
#: - ``divide``: ``_reduce_grad`` divides it in place by ``_gradient_predivide_factor`` before
#:   ``reduce_scatter_tensor`` (``_div_if_needed``; the factor, ``DefaultState.
#:   _get_gradient_predivide_factor`` in torch/distributed/algorithms/_comm_hooks/default_hooks.py,
#:   is 4 on 8 GPUs and 8 on 64: > 1 on every row; read and write 4 bytes in fp32, 2 in bf16).
#: Read here in torch 2.13's source; the runs used the FSDP1 of PyTorch 2.1 (llm-foundry's image
#: ``mosaicml/pytorch:2.1.0_cu121``, sweep.sh), whose flat-parameter views and ``_reduce_grad`` take
#: the same path (not checked line by line against that version). Bytes per parameter of the
#: unsharded gradient on every GPU, per micro-batch, per kernel. autopar's own runtime does none of
#: the three (it reduces what autograd produced for each parameter), so they are priced here, as the
#: runs' runtime, not in the presets: memory-bound kernels at the preset's memory curve, one of each
#: per layer (an FSDP unit), after the compute (they run on FSDP's post-backward stream beside the
#: backward; priced as not hidden).
FSDP1_GRAD_BYTES = {"fp32": (("concat", 2 + 2), ("cast", 2 + 4), ("divide", 4 + 4)),
                    "bf16": (("concat", 2 + 2), ("divide", 2 + 2))}
#: The runs' runtime on the sharded gradient, per micro-batch (torch's FSDP1, ``_runtime_utils.py``,
#: ``_reduce_grad`` -> ``_accumulate_sharded_grad``): Composer reduces every micro-batch (its
#: ``no_sync`` context is for ``DistributedDataParallel`` only: trainer.py of v0.16.4), and FSDP1
#: adds each reduced shard into the one kept from the micro-batches before
#: (``flat_param._saved_grad_shard += sharded_grad``; ``FlatParamHandle.prepare_gradient_for_backward``
#: moves ``.grad`` there first), so every micro-batch of a step but the first runs an fp32 addition
#: over the shard (read 4 + 4, write 4); a shard reduced in bf16 (``PURE``) is first cast to the fp32
#: parameter dtype (``_cast_grad_to_param_dtype``: read 2, write 4), every micro-batch. Priced like
#: ``FSDP1_GRAD_BYTES`` (one kernel per layer, memory curve, not hidden: FSDP's post-backward stream).
SHARD_ACCUMULATE_BYTES, SHARD_CAST_BYTES = 4 + 4 + 4, 2 + 4
#: The runs' runtime at the edges of each micro-batch (torch's FSDP1 with Composer's defaults:
#: ``forward_prefetch`` False, ``backward_prefetch`` BACKWARD_POST, ``set_fsdp_default`` as above).
#: Every layer's gather hides under the layer before it and every layer's reduction under the layer
#: after it, as autopar prices; the first and the last cannot. The root FSDP unit (MPT's embeddings
#: and final norm, the parameters outside the blocks: llm-foundry's ``fsdp_wrap_fn`` wraps each
#: ``MPTBlock``) gathers first, while nothing runs, and the first block's gather waits behind it
#: (one process group runs its collectives in the order issued; the embedding lookup between them
#: is a few microseconds); at the end of the backward the first block reduces after its own
#: gradient is complete and the root after the embedding's, with only the embedding's backward left
#: to run, and FSDP's final callback (``_post_backward_final_callback`` -> ``_wait_for_post_backward``)
#: makes the compute stream wait for them before the next micro-batch. So per micro-batch
#: ``EDGE_COLLECTIVES`` run exposed: autopar hides them under the layers' compute and charges only
#: the overlap slowdown ``s`` of their time, so the price adds ``(1 - s)`` of their ring time on the
#: row's FSDP axis (gathers in bf16, reductions in the reduce dtype).
EDGE_COLLECTIVES = (("all_gather", "root"), ("all_gather", "layer"), ("reduce_scatter", "layer"),
                    ("reduce_scatter", "root"))
#: The runs' optimizer: llm-foundry's yamls at b2a43a1 set ``optimizer: decoupled_adamw`` with
#: ``weight_decay: 0.0``, Composer's ``DecoupledAdamW`` (composer/optim/decoupled_weight_decay.py of
#: v0.16.4), whose ``adamw`` loops over the parameters and runs, per parameter, unfused in-place
#: kernels over fp32 values (FSDP's sharded fp32 parameters; gradients cast back to fp32,
#: Composer's ``keep_low_precision_grads`` False): ``exp_avg.mul_``, ``exp_avg.add_(grad)``,
#: ``exp_avg_sq.mul_``, ``exp_avg_sq.addcmul_(grad, grad)``, then ``denom = (exp_avg_sq.sqrt() /
#: c).add_(eps)`` (three kernels) and ``param.addcdiv_(exp_avg, denom)`` (the weight-decay
#: ``param.mul_`` is skipped at 0.0). Bytes per element each moves (reads + writes, 4 bytes a value,
#: the gradient read once by ``addcmul_``): 80 in all, where autopar prices its own runtime's
#: foreach AdamW at 28 (``compute.optimizer_time``). The loop also calls ``.item()`` on each
#: parameter's step counter, which lives on the GPU: a device synchronisation per parameter, host
#: time this check does not price.
RUNS_ADAMW_BYTES = (4 + 4, 4 + 4 + 4, 4 + 4, 4 + 4 + 4, 4 + 4, 4 + 4, 4 + 4, 4 + 4 + 4 + 4)
#: Before it, the yamls' ``gradient_clipping`` (``clipping_type: norm``, threshold 1.0): Composer's
#: ``apply_gradient_clipping`` calls the root FSDP module's ``clip_grad_norm_`` (composer/algorithms/
#: gradient_clipping/gradient_clipping.py of v0.16.4), which reads every sharded fp32 gradient for
#: its norm (``_get_grad_norm``: ``vector_norm`` per gradient) and multiplies every gradient by the
#: clamped coefficient, always, to avoid a host sync (``grad.mul_(clip_coef_clamped)``; torch's
#: fully_sharded_data_parallel.py): read 4, then read and write 4 bytes per element.
RUNS_CLIP_BYTES = (4, 4 + 4)


def run_hardware(device: str, kernel: str = "run", overlap_slowdown=None, intra_bandwidth=None):
    """The preset of ``device``, with the attention kernel those runs used (``RUNS_ATTENTION_OF_FA2``) unless
    ``kernel`` is ``"preset"``, ``overlap_slowdown`` in place of the preset's when given (0: the
    price before that term, for comparison) and, for a what-if only, ``intra_bandwidth`` (bytes/s)
    in place of the preset's NVLink bandwidth."""
    import dataclasses

    from autopar.cost_model.hardware import PRESETS

    hw = PRESETS[device]
    if intra_bandwidth is not None:
        hw = dataclasses.replace(hw, intra_node=dataclasses.replace(hw.intra_node, bandwidth=intra_bandwidth))
    if kernel == "run":
        e = hw.efficiency
        hw = dataclasses.replace(hw, efficiency=dataclasses.replace(
            e, attn_fwd=e.attn_fwd * RUNS_ATTENTION_OF_FA2[device],
            attn_bwd=e.attn_bwd * RUNS_ATTENTION_OF_FA2[device]))
    if overlap_slowdown is not None:
        hw = dataclasses.replace(hw, overlap_slowdown=overlap_slowdown)
    return hw


def _say(msg: str) -> None:
    print(msg, flush=True)


def foundry_flops_per_token(params: int, layers: int, width: int) -> float:
    """llm-foundry's model FLOPs per token: 6 N + 12 L d s (attention without the causal halving)."""
    return 6.0 * params + 12.0 * layers * width * SEQ


def fsdp1_grad_seconds(params: int, layers: int, reduce: str, hw) -> float:
    """Seconds per micro-batch of FSDP1's gradient work (``FSDP1_GRAD_BYTES``: the flat gradient's
    concatenation, the cast to the reduce dtype, the pre-division) on one GPU: one memory-bound
    kernel of each per layer over its unsharded gradient, at the memory curve."""
    from autopar.cost_model import efficiency as eff

    per_layer = params / layers
    total = 0.0
    for _name, per_param in FSDP1_GRAD_BYTES[reduce]:
        nbytes = per_param * per_layer
        total += layers * nbytes / (hw.hbm_bandwidth * eff.memory(hw.efficiency, nbytes))
    return total


def fsdp1_shard_seconds(params: int, layers: int, gpus: int, reduce: str, accum: int, hw) -> float:
    """Seconds per micro-batch (averaged over the ``accum`` micro-batches of a step) of FSDP1's work
    on the reduced shard (``SHARD_ACCUMULATE_BYTES``, ``SHARD_CAST_BYTES``) on one GPU."""
    from autopar.cost_model import efficiency as eff

    per_layer = params / gpus / layers
    kernels = [(SHARD_ACCUMULATE_BYTES, (accum - 1) / accum)]
    if reduce == "bf16":
        kernels.append((SHARD_CAST_BYTES, 1.0))
    return sum(share * layers * b * per_layer / (hw.hbm_bandwidth * eff.memory(hw.efficiency, b * per_layer))
               for b, share in kernels)


def runs_optimizer_seconds(params: int, layers: int, gpus: int, hw) -> float:
    """Seconds of one step of the runs' optimizer (``RUNS_CLIP_BYTES`` then ``RUNS_ADAMW_BYTES``) on
    one GPU's shard: each of their kernels once per layer over that layer's shard, at the memory
    curve."""
    from autopar.cost_model import efficiency as eff

    per_layer = params / gpus / layers
    return sum(layers * b * per_layer / (hw.hbm_bandwidth * eff.memory(hw.efficiency, b * per_layer))
               for b in RUNS_CLIP_BYTES + RUNS_ADAMW_BYTES)


def fsdp1_edge_seconds(root_params: int, layer_params: int, reduce: str, mesh) -> float:
    """Seconds per micro-batch that FSDP1's first gathers and last reductions add to autopar's
    price (``EDGE_COLLECTIVES``): their ring time on the mesh's one (FSDP) axis, times ``1 - s``
    (autopar counts them as hidden, slowing compute by ``s`` of their time)."""
    from autopar.cost_model.comm import collective_time

    n, link = mesh.shape[0], mesh.links[0]
    grad_bytes = 4 if reduce == "fp32" else 2
    total = 0.0
    for kind, unit in EDGE_COLLECTIVES:
        count = root_params if unit == "root" else layer_params
        total += collective_time(kind, count * (2 if kind == "all_gather" else grad_bytes), n, link)
    return (1.0 - mesh.hardware.overlap_slowdown) * total


def collective_seconds(plan, mesh) -> float:
    """Seconds of every collective the plan issues in one step, at autopar's ring prices."""
    from autopar.cost_model.comm import collective_time

    size = dict(zip(mesh.names, mesh.shape))
    link = dict(zip(mesh.names, mesh.links))
    return sum(c["count"] * collective_time(c["kind"], c["bytes"], size[c["axis"]], link[c["axis"]])
               for c in plan.collectives if c["axis"] in size)


def price(row, graph_cache: dict, kernel: str = "run", overlap_slowdown=None, grad_work: bool = True,
          edges: bool = True, intra_bandwidth=None, runs_optimizer: bool = True) -> dict:
    """Plan one row (FSDP recipe, pinned recomputation) and return its predicted throughput and
    where its step goes; ``kernel="run"`` prices attention with the runs' kernel, ``"preset"`` with
    the preset's; ``overlap_slowdown`` and ``intra_bandwidth`` replace the preset's; ``grad_work``
    adds FSDP1's gradient kernels (``FSDP1_GRAD_BYTES``, ``SHARD_ACCUMULATE_BYTES``), ``edges``
    its exposed first gathers and last reductions (``EDGE_COLLECTIVES``), and ``runs_optimizer``
    prices the runs' optimizer (``RUNS_CLIP_BYTES``, ``RUNS_ADAMW_BYTES``) in place of autopar's."""
    import dataclasses

    import autopar
    from autopar.cost_model.compute import optimizer_time
    from autopar.cost_model.precision import get_precision
    from autopar.ir.capture import capture
    from autopar.models import make, num_params
    from autopar.planner.intra import run_passes
    from autopar.planner.options import PlanOptions
    from autopar.planner.report import build_plan

    device, name, gpus, mb, ckpt, mfu, tok = row
    layers, width, heads = SHAPES[name]
    if kernel == "run" and (width // heads, SEQ, True) != RUNS_ATTENTION_SHAPE:
        raise ValueError(f"{name}: the runs' attention ratio (RUNS_ATTENTION_OF_FA2) was read at head dim, "
                         f"sequence, causal = {RUNS_ATTENTION_SHAPE}, not ({width // heads}, {SEQ}, True)")
    key = (name, gpus * mb)
    t0 = time.perf_counter()
    if key not in graph_cache:
        model, inputs = make("gpt", size="tiny", batch=gpus * mb, seq=SEQ, device="meta", vocab_size=VOCAB,
                             block_size=SEQ, n_layer=layers, n_embd=width, n_head=heads, bias=True)
        graph_cache.clear()  # one graph at a time: the large ones are big
        graph_cache[key] = (model, inputs, capture(model, tuple(inputs)), num_params(model),
                            sum(p.numel() for p in model.blocks[0].parameters()))
    model, inputs, graph, params, layer_params = graph_cache[key]
    t_capture = time.perf_counter() - t0
    hw = run_hardware(device, kernel, overlap_slowdown, intra_bandwidth)
    mesh = autopar.Mesh({"dp": gpus}, device=hw)
    precision = get_precision("bf16-mixed", mesh.hardware)
    reduce = "bf16" if (device, name) in PURE else "fp32"
    if reduce == "bf16":  # gradients reduced in bf16
        precision = dataclasses.replace(precision, grad_bytes=2)
    planned = run_passes(model, mesh, inputs, options=PlanOptions(recipe="fsdp", graph=graph, progress=False,
                                                                checkpointing="full" if ckpt else None,
                                                                precision=precision))
    plan = build_plan(planned)
    # the price holds one AdamW step over this device's shard (compute.optimizer_time: 28 B per
    # element for bf16-mixed, at the memory curve); the run takes it once every ACCUM micro-batches
    shard = params / gpus
    state = {"params": precision.param_bytes * shard, "grads": precision.grad_bytes * shard,
             "optimizer": precision.optimizer_bytes * shard}
    opt = optimizer_time(state, mesh.hardware)
    grad_s = (fsdp1_grad_seconds(params, layers, reduce, mesh.hardware)
              + fsdp1_shard_seconds(params, layers, gpus, reduce, ACCUM[(device, name)], mesh.hardware)
              if grad_work else 0.0)
    edge_s = fsdp1_edge_seconds(params - layers * layer_params, layer_params, reduce, mesh) if edges else 0.0
    step_opt = runs_optimizer_seconds(params, layers, gpus, mesh.hardware) if runs_optimizer else opt
    step = planned.cost.step_time - opt + step_opt / ACCUM[(device, name)] + grad_s + edge_s
    tok_gpu = mb * SEQ / step
    parts = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for n in plan.nodes:  # every op instance at its chosen strategy's priced seconds, re-runs included
        op = n["op"]
        kind = ("matmul" if op.split(".")[1] in ("mm", "addmm", "bmm", "baddbmm") else
                "attention" if "scaled_dot_product" in op or op.startswith("autopar.attention") else "other")
        parts[kind] += n["compute"]
    recompute = sum(g.get("checkpointed", 0) * g.get("recompute_time", 0.0) for g in plan.layer_groups)
    fpt = foundry_flops_per_token(params, layers, width)
    collectives = collective_seconds(plan, mesh)
    return {"tok_gpu": tok_gpu, "mfu": fpt * tok_gpu / PEAK[device], "step": step,
            "collectives": collectives, "contention": planned.cost.contention, "grad_work": grad_s,
            "edges": edge_s, "optimizer": step_opt / ACCUM[(device, name)], "recompute": recompute,
            "overlap_slowdown": mesh.hardware.overlap_slowdown,
            "compute": planned.cost.compute_time,
            "exposed": planned.cost.comm_time - planned.cost.contention - opt,
            "plan_mfu": getattr(plan, "mfu", float("nan")), "fits": plan.fits, "params": params, "parts": parts,
            "capture_s": t_capture, "plan_s": time.perf_counter() - t0 - t_capture}


def _by_row(results):
    return sorted(results, key=lambda x: (x[0][0], SHAPES[x[0][1]][1]))


def markdown(results) -> None:
    """The per-row table of docs/benchmarks.md: where each row's step goes (ms per micro-batch step;
    every column but "hidden collectives" is part of "step")."""
    _say("| device | model | GPUs | micro-batch | recompute | step | matmul / attention / other | of it re-run "
         "| AdamW | exposed comm | hidden collectives | slowed compute | FSDP1 gradient work | FSDP1 edges "
         "| tokens/s/GPU | published | predicted/published |")
    _say("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row, r in _by_row(results):
        device, name, gpus, mb, ckpt, _mfu, tok = row
        parts = " / ".join(f"{r['parts'][k] * 1e3:.1f}" for k in ("matmul", "attention", "other"))
        ms = {k: f"{r[k] * 1e3:.1f}" for k in ("step", "recompute", "optimizer", "exposed", "collectives",
                                             "contention", "grad_work", "edges")}
        _say(f"| {device.upper()} | {name.upper()} | {gpus} | {mb} | {'yes' if ckpt else 'no'} | {ms['step']} | "
             f"{parts} | {ms['recompute']} | {ms['optimizer']} | {ms['exposed']} | {ms['collectives']} | "
             f"{ms['contention']} | {ms['grad_work']} | {ms['edges']} | {r['tok_gpu']:,.0f} | {tok:,} | "
             f"{r['tok_gpu'] / tok:.3f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=sorted(SHAPES), help="price only these models")
    ap.add_argument("--device", nargs="+", choices=sorted(PEAK), help="price only these devices")
    ap.add_argument("--kernel", choices=("run", "preset"), default="run",
                    help="attention at the runs' kernel (default) or at the preset's (torch's SDPA)")
    ap.add_argument("--markdown", action="store_true", help="also print the per-row table as markdown")
    ap.add_argument("--overlap-slowdown", type=float, default=None,
                    help="price with this overlap_slowdown instead of the preset's (0: hidden collectives free)")
    ap.add_argument("--no-grad-work", action="store_true",
                    help="leave out FSDP1's gradient concatenation, cast, pre-division and shard accumulation "
                         "(the runs' runtime)")
    ap.add_argument("--no-edges", action="store_true",
                    help="leave out FSDP1's exposed first gathers and last reductions (the runs' runtime)")
    ap.add_argument("--no-runs-optimizer", action="store_true",
                    help="price autopar's own AdamW instead of the runs' (Composer's DecoupledAdamW)")
    ap.add_argument("--intra-bandwidth", type=float, default=None,
                    help="what-if: price with this NVLink bandwidth (GB/s, one way) instead of the preset's")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = [r for r in ROWS if (not args.only or r[1] in args.only) and (not args.device or r[0] in args.device)]
    # rows sharing a model and global batch share one capture
    rows.sort(key=lambda r: (SHAPES[r[1]][1], r[2] * r[3], r[0]))
    cache: dict = {}
    results = []
    intra = args.intra_bandwidth * 1e9 if args.intra_bandwidth else None
    for row in rows:
        r = price(row, cache, kernel=args.kernel, overlap_slowdown=args.overlap_slowdown,
                  grad_work=not args.no_grad_work, edges=not args.no_edges, intra_bandwidth=intra,
                  runs_optimizer=not args.no_runs_optimizer)
        results.append((row, r))
        _say(f"[{row[0]} {row[1]} x{row[2]}] predicted {r['tok_gpu']:.0f} tokens/s/GPU (published {row[6]}), "
             f"ratio {r['tok_gpu'] / row[6]:.3f}; capture {r['capture_s']:.0f} s, plan {r['plan_s']:.0f} s")
    _say("")
    _say(f"{'device':<6} {'model':<5} {'GPUs':>4} {'mb':>3} {'ckpt':>5} {'step ms':>8} {'compute':>8} {'exposed':>8} "
         f"{'tok/s/GPU':>10} {'published':>10} {'MFU':>6} {'pub MFU':>8} {'plan.mfu':>8} {'pred/pub':>8}")
    by_dev: dict[str, list[float]] = {}
    for row, r in _by_row(results):
        device, name, gpus, mb, ckpt, mfu, tok = row
        ratio = r["tok_gpu"] / tok
        by_dev.setdefault(device, []).append(ratio)
        _say(f"{device:<6} {name:<5} {gpus:>4} {mb:>3} {'yes' if ckpt else 'no':>5} {r['step'] * 1e3:>8.1f} "
             f"{r['compute'] * 1e3:>8.1f} {r['exposed'] * 1e3:>8.1f} {r['tok_gpu']:>10.0f} {tok:>10} "
             f"{100 * r['mfu']:>6.1f} {mfu:>8.2f} {100 * r['plan_mfu']:>8.1f} {ratio:>8.3f}"
             + ("" if r["fits"] else "  (over memory)"))
    _say("")
    _say("predicted compute by kind of op (ms per step, recomputed forward ops included): matmul / attention / other;"
         " of it recomputation")
    for row, r in _by_row(results):
        p = r["parts"]
        _say(f"{row[0]:<6} {row[1]:<5} " + " / ".join(f"{p[k] * 1e3:.1f}" for k in ("matmul", "attention", "other"))
             + f"; re-run {r['recompute'] * 1e3:.1f}")
    _say("")
    _say("collectives (ms per step at autopar's ring prices), the compute they slow (in the price: the preset's "
         "overlap_slowdown x hidden traffic), the AdamW step's share, and the runs' runtime: FSDP1's gradient "
         "concatenation, cast and pre-division, and its exposed first gathers and last reductions:")
    for row, r in _by_row(results):
        _say(f"{row[0]:<6} {row[1]:<5} collectives {r['collectives'] * 1e3:8.1f}  slowed compute "
             f"{r['contention'] * 1e3:7.1f} (s = {r['overlap_slowdown']:.3f})  AdamW {r['optimizer'] * 1e3:6.1f}  "
             f"FSDP1 gradient work {r['grad_work'] * 1e3:6.1f}  edges {r['edges'] * 1e3:5.1f}")
    if args.markdown:
        _say("")
        markdown(results)
    for device, ratios in by_dev.items():
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        _say(f"{device}: geomean predicted/published {geo:.3f} over {len(ratios)} rows, "
             f"range {min(ratios):.3f}-{max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
