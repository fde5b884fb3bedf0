"""Mixtures of experts at scale, planned: Hugging Face MoE models built on meta in bf16 with their
default ``grouped_mm`` experts, as a user brings them, on H100 meshes.

- ``qwen3_30b``: Qwen3-MoE-30B-A3B's shape (48 layers, hidden 2048, 128 experts of 768, top-8,
  32 query / 4 KV heads of 128, vocabulary 151936), batch 256 x 4096 on (8, 8) H100s.
- ``mixtral_8x7b``: Mixtral-8x7B's shape (32 layers, hidden 4096, 8 experts of 14336, top-2,
  32 / 8 heads, vocabulary 32000), batch 256 x 4096 on (8, 8) H100s.
- ``deepseek_v3_gqa``: DeepSeek-V3's MoE shape (61 layers, hidden 7168, 256 routed experts of 2048,
  top-8, one shared expert of 2048, vocabulary 129280) with grouped-query attention (128 query / 8 KV
  heads) in place of multi-head latent attention, as Hugging Face's Qwen2-MoE writes it, batch
  256 x 4096 on (16, 16) H100s.

Each row prints the planned step time, tokens/s/GPU, MFU, peak memory, planning wall time, and
which grouped products run expert-parallel (tag ``experts``). ``--layers`` plans fewer layers (the
step and memory then cover that depth only; say so when quoting). ``--imbalance`` sets the expert
exchange's imbalance factor (``autopar.cost_model.experts.IMBALANCE``). ``--mesh`` pins the axes
(a ``pp`` axis pipelines); ``--devices N`` has ``autopar.Mesh.devices(N, device="h100")`` choose the
factorization (the row then prints the chosen mesh, ``"chosen"``, and every shape it priced or why
not, ``"compared"``).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/moe_scale.py [--only qwen3_30b] [--layers 4]
        [--batch 64] [--imbalance 1.25] [--mesh dp=32,tp=8 | --devices 64 [--tp 8]] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import warnings

import torch

#: name -> (config class, causal-LM class, config kwargs, mesh axes, batch, seq)
MODELS = {
    "qwen3_30b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                       head_dim=128, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                       num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=4096),
                  {"dp": 8, "tp": 8}, 256, 4096),
    "mixtral_8x7b": ("MixtralConfig", "MixtralForCausalLM",
                     dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                          max_position_embeddings=4096),
                     {"dp": 8, "tp": 8}, 256, 4096),
    # DeepSeek-V3's MoE shape with grouped-query attention in place of multi-head latent attention
    # (Qwen2-MoE's code: routed experts plus one gated shared expert; every layer sparse, where
    # DeepSeek-V3's first three are dense)
    "deepseek_v3_gqa": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                        dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=8,
                             intermediate_size=18432, moe_intermediate_size=2048, shared_expert_intermediate_size=2048,
                             num_experts=256, num_experts_per_tok=8, vocab_size=129280, max_position_embeddings=4096),
                        {"dp": 16, "tp": 16}, 256, 4096),
}


def build(name: str, layers: int | None, batch: int | None = None):
    """``(model on meta in bf16, kwargs, mesh axes)`` of row ``name`` (``batch``: sequences, if not the row's)."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg_cls, model_cls, dims, axes, rows, seq = MODELS[name]
    batch = batch or rows
    dims = dict(dims)
    if layers:
        dims["num_hidden_layers"] = layers
    cfg = getattr(transformers, cfg_cls)(**dims)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16)
    ids = torch.zeros(batch, seq, dtype=torch.int64)
    return model, {"input_ids": ids, "labels": ids}, axes


def row(name: str, layers: int | None, batch: int | None = None, mesh: dict | None = None,
        devices: int | None = None, tp: list | None = None) -> dict:
    """Plan row ``name`` (on ``mesh`` axes, if not the row's; on ``devices`` H100s whose factorization
    ``Mesh.devices`` chooses, if given, with the tensor degrees ``tp`` if given) and report its
    figures (an ``error`` where no plan fits)."""
    import autopar

    model, kwargs, axes = build(name, layers, batch)
    axes = mesh or axes
    target = (autopar.Mesh.devices(devices, device="h100", tp=tp) if devices
              else autopar.Mesh(axes, device="h100"))
    head = {"model": name, "layers": layers or MODELS[name][2]["num_hidden_layers"],
            "mesh": {"devices": devices, "tp": tp} if devices else axes, "batch": list(kwargs["input_ids"].shape)}
    t, cpu = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = autopar.plan(model, target, (), kwargs, progress=False)
        except autopar.errors.InfeasibleError as e:
            return {**head, "plan_s": time.perf_counter() - t, "error": str(e)}
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    if plan.mesh_search:
        head.update(chosen=plan.mesh_search["chosen"], compared=plan.mesh_search["compared"])
    if plan.pipeline is not None:
        p = plan.pipeline
        head["pipeline"] = {"schedule": p.schedule, "microbatches": p.microbatches, "virtual_stages": p.virtual_stages,
                            "bubble": p.bubble, "mesh": dict(zip(p.mesh_names, p.mesh_shape))}
    tags = collections.Counter(tuple(n.get("tags", [])) for n in plan.nodes if n["name"].startswith("_grouped_mm"))
    return {**head, "step_s": plan.step_time, "tokens_per_s_per_gpu": plan.tokens_per_second_per_device, "mfu": plan.mfu,
            "peak_gib": plan.peak_memory / 2**30, "budget_gib": plan.memory_budget / 2**30, "plan_s": wall,
            "plan_cpu_s": cpu,
            "grouped_mm_strategies": {", ".join(k): v for k, v in tags.items()},
            "baselines": {k: v.get("step_time") for k, v in plan.baselines.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default: the row's 256)")
    ap.add_argument("--imbalance", type=float, default=None)
    ap.add_argument("--mesh", default=None, help="mesh axes, e.g. dp=32,tp=8 or pp=8,tp=8 (default: the row's)")
    ap.add_argument("--devices", type=int, default=None,
                    help="H100s whose factorization autopar.Mesh.devices chooses (in place of --mesh)")
    ap.add_argument("--tp", default=None, help="with --devices: the tensor degrees allowed, e.g. 8 or 4,8")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.mesh and a.devices:
        ap.error("give --mesh or --devices, not both")
    if a.imbalance is not None:
        from autopar.cost_model import experts

        experts.IMBALANCE = a.imbalance
    rows = []
    for name in a.only or sorted(MODELS):
        mesh = {k: int(v) for k, v in (x.split("=") for x in a.mesh.split(","))} if a.mesh else None
        tp = [int(x) for x in a.tp.split(",")] if a.tp else None
        r = row(name, a.layers, a.batch, mesh, a.devices, tp)
        rows.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
