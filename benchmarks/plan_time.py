"""Planning time per phase: the LLaMA-3-8B shape (batch 64, sequence 2048, training) on an (8, 8)
H100 mesh, at 2, 8 and 32 layers. ``--model`` picks the code that has that shape: ``llama`` (the
built-in ``autopar.models.llama``), ``llama_loop`` (the same model written with its layer code in the
parent's ``forward``: RoPE, attention and residual adds outside the layer modules), ``hf_llama``,
``hf_gpt2`` or ``hf_mixtral`` (Hugging Face's ``LlamaForCausalLM``, ``GPT2LMHeadModel`` or
``MixtralForCausalLM``, built on ``meta`` from their configs at the preset's width, heads and
vocabulary; Mixtral with its default experts implementation, ``grouped_mm``, in bf16 because that
kernel's fake implementation takes nothing else) or ``titan_llama`` (the
torchtitan-style Llama 3 of ``tests/_corpus.py``, complex RoPE, at the same dims). ``corpus:NAME``
plans corpus model NAME of ``tests/_corpus.py`` at its tiny size (hidden 64, batch 4, sequence 16)
on a (2, 2) H100 mesh instead.

Prints capture, fold, strategies, cost, merge, solve and total seconds per depth (from
``autopar.planner.intra.run_passes``'s ``phases``) and the process's CPU seconds for the whole
plan (``cpu``: on a shared, loaded machine the wall-clock phases inflate, CPU time far less), and
the ratio of the deepest case's post-capture time (total − capture) to the shallowest's. Targets:
the 32-layer case under 15 s in total; its post-capture phases under 1.5× the 2-layer case's
(identical layers are folded, so depth should cost little after capture).

    python benchmarks/plan_time.py [--model llama|llama_loop|hf_llama|hf_gpt2|hf_mixtral|titan_llama|corpus:NAME] [--layers 2 8 32] [--repeat K]
                                   [--markdown] [--cpu] [--against REF]

``--cpu`` times every phase in this process's CPU seconds (``time.perf_counter`` is replaced by
``time.process_time`` in this process, so the solver's wall-time caps count CPU time too): on a
shared machine under load, wall-clock phases inflate with the load and ratios between runs drift,
while CPU seconds stay near what an idle machine's wall clock shows (the planner runs one thread).

``--table`` plans the workloads of the planning-time table instead (each in a fresh process, the
whole ``autopar.plan``): ``llama8b``, the built-in LLaMA at LLaMA-3-8B's dims, 32 layers, batch 64 x
2048 on (8, 8) H100s; ``llama405b``, the built-in LLaMA at LLaMA-3.1-405B's dims (126 layers, dim
16384, 128 heads, 8 kv heads, ffn 53248, vocab 128256), batch 64 x 8192 on (8, 8, 8) H100s with the
schedule and micro-batch count searched (bf16-mixed, as ``benchmarks/pipeline_plan.py``); ``moe48``,
Hugging Face's ``MixtralForCausalLM`` at Qwen3-30B-A3B's dims (48 layers, 128 experts of width 768,
top 8, hidden 2048, 32 heads, 4 kv heads, vocab 151936: 30B parameters), bf16, batch 8 x 2048 on
(8, 8) H100s; ``llama8b_pp``, the 8B shape on (pp 4, dp 2, tp 8) with the schedule and micro-batch
count searched (bf16-mixed); ``llama8b_again``, the 8B workload planned after a plan of the same
model on (16, 4) H100s within 60 GiB in the same process (that second plan timed, the traces of
both counted). Each row: the planning wall and CPU seconds, the capture phase's seconds
(``plan.phases``) and how many times the model was traced (calls of the joint export); a workload
with no plan that fits says so, with the time that answer took. ``--batch`` changes the LLaMAs'
batch (LLaMA-3.1-405B on (8, 8, 8) fits at 256 x 8192, not at 64). With ``--against REF`` the same
workloads are planned with commit REF's ``autopar`` too, in turns.

    python benchmarks/plan_time.py --table [llama8b llama405b moe48] [--batch 64] [--against REF]

With ``--repeat`` each depth is planned K times and the run with the smallest total is kept.
``--against REF`` (a commit) also plans with that commit, side by side: a git worktree of REF
(made once under the temp dir) and this tree run in turns, one fresh process per depth and side,
so both see the same machine load; it prints both sides' phases and this / REF per phase. The
recipes priced as baselines are their own phase (``recipes``) from this tree on; in an older
tree their time is inside ``solve``.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
from typing import Optional

PHASES = ("capture", "fold", "strategies", "cost", "merge", "recipes", "solve", "total")
TOTAL_TARGET_S = 15.0
RATIO_TARGET = 1.5


MODELS = ("llama", "llama_loop", "hf_llama", "hf_gpt2", "hf_mixtral", "titan_llama")
#: the corpus of tests/_corpus.py at its tiny size (hidden 64, its own batch and sequence), as ``corpus:NAME``
CORPUS = ("titan_llama", "torch_encoder", "hf_gpt2", "hf_llama", "hf_bert", "hf_t5", "hf_bart", "hf_vit", "hf_mixtral",
          "hf_mixtral_grouped")
CORPUS_MESH = {"dp": 2, "tp": 2}


def _corpus():
    import pathlib

    tests = str(pathlib.Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import _corpus

    return _corpus


def _titan(layers: int, batch: int, seq: int, size: str):
    """The torchtitan-style Llama 3 of the corpus (complex RoPE) at preset ``size``'s dims, on meta."""
    import torch

    from autopar.models.llama import PRESETS

    c = _corpus()
    p = PRESETS[size]
    a = c.TitanArgs(dim=p["dim"], n_layers=layers, n_heads=p["n_heads"], n_kv_heads=p["n_kv_heads"],
                    vocab_size=p["vocab_size"], norm_eps=p["norm_eps"], rope_theta=p["rope_theta"],
                    max_seq_len=max(p["max_seq_len"], seq))
    with torch.device("meta"):
        module = c.WithLoss(c.TitanTransformer(a))
        # the feed-forward width of the preset (Llama 3 rounds 4 * dim * 2/3 * multiplier to it)
        for block in module.model.layers.values():
            block.feed_forward = c.FeedForward(p["dim"], p["ffn_dim"] * 3 // 2, 1, None)
    ids = torch.randint(0, p["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    return module, (ids, torch.roll(ids, -1, 1)), {}


def build(model: str, layers: int, batch: int, seq: int, size: str = "llama3-8b"):
    """``(module, args, kwargs)``: ``model`` at the shape of LLaMA preset ``size`` with ``layers`` layers, on meta
    (``corpus:NAME``: corpus model NAME at its tiny size, on CPU)."""
    from autopar.models import make

    if model.startswith("corpus:"):
        c, name = _corpus(), model.split(":", 1)[1]
        if name not in c.CORPUS:  # a builder of the module that the corpus the tests run leaves out
            import torch

            torch.manual_seed(0)
            return getattr(c, name)(layers=layers)
        return c.build(name, layers=layers)
    if model == "titan_llama":
        return _titan(layers, batch, seq, size)
    if not model.startswith("hf_"):
        module, inputs = make(model, size=size, batch=batch, seq=seq, device="meta", n_layers=layers)
        return module, inputs, None
    return _hf_decoder(model, layers, batch, seq, size)


def _hf_decoder(model: str, layers: int, batch: int, seq: int, size: str):
    """Hugging Face's ``LlamaForCausalLM``, ``GPT2LMHeadModel`` or ``MixtralForCausalLM`` (8 experts,
    top 2, each expert the preset's FFN width) from its config at preset ``size``'s dims, on meta."""
    import torch
    import transformers
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                              MixtralForCausalLM)

    from autopar.models.llama import PRESETS

    transformers.logging.set_verbosity_error()
    p = PRESETS[size]
    common = dict(vocab_size=p["vocab_size"], bos_token_id=0, eos_token_id=0, pad_token_id=0)
    llama_like = dict(hidden_size=p["dim"], intermediate_size=p["ffn_dim"], num_hidden_layers=layers,
                      num_attention_heads=p["n_heads"], num_key_value_heads=p["n_kv_heads"],
                      max_position_embeddings=max(p["max_seq_len"], seq), rope_theta=p["rope_theta"],
                      rms_norm_eps=p["norm_eps"], attention_dropout=0.0, **common)
    if model == "hf_gpt2":  # GPT-2's own structure (learned positions, 4x MLP) at the preset's width
        cfg, cls = GPT2Config(n_embd=p["dim"], n_layer=layers, n_head=p["n_heads"], n_positions=max(2048, seq),
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common), GPT2LMHeadModel
    elif model == "hf_mixtral":
        cfg, cls = MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **llama_like), MixtralForCausalLM
    else:
        cfg, cls = LlamaConfig(**llama_like), LlamaForCausalLM
    with torch.device("meta"):
        module = cls(cfg)
    module.config._attn_implementation = "sdpa"
    if model == "hf_mixtral":
        # as a user would: the default experts implementation (``grouped_mm``), whose fake kernel on
        # torch 2.13 takes bf16 only, so the model is bf16
        module = module.to(torch.bfloat16)
    ids = torch.randint(0, p["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    return module, (), {"input_ids": ids, "labels": ids}


def recompute_text(p) -> str:
    """What planned ``p`` recomputes: per recomputing layer group, which instances, the time their
    re-runs add to the step and what one instance saves without and keeps recomputed ("none")."""
    rc = p.recompute
    if rc is None or not rc.any:
        return "none"
    from autopar.passes.search.checkpoint import group_figures

    gib = 1024 ** 3
    return ", ".join(
        f"{g['mode']} {g['checkpointed']}/{g['count']} ({g['paths'][0]}..{g['paths'][g['checkpointed'] - 1]}; "
        f"re-runs add {g['checkpointed'] * g['recompute_time'] * 1e3:.1f} ms; each saves "
        f"{g['saved_bytes'] / gib:.2f} GiB without, keeps {g['input_bytes'] / gib:.2f} GiB recomputed)"
        for g in group_figures(p.unscaled, p.terms, rc, p.choice) if g["checkpointed"])


def plan_once(layers: int, batch: int, seq: int, model: str = "llama", size: str = "llama3-8b") -> dict:
    import autopar
    from autopar.planner.intra import run_passes
    from autopar.planner.options import PlanOptions
    from autopar.cost_model import comm

    comm.cache_clear()  # every depth prices its reshardings from a cold memo, as a fresh process does

    module, args, kwargs = build(model, layers, batch, seq, size)
    mesh = autopar.Mesh(CORPUS_MESH if model.startswith("corpus:") else {"dp": 8, "tp": 8}, device="h100")
    t0, c0 = time.perf_counter(), time.process_time()
    p = run_passes(module, mesh, args, kwargs, PlanOptions(progress=False))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = {k: 0.0 for k in PHASES}
    out.update(p.phases)
    out["wall"] = wall
    out["cpu"] = cpu  # this process's CPU seconds: what a loaded machine inflates least
    out["post"] = p.phases["total"] - p.phases["capture"]
    out["source"] = p.source
    out["step_ms"] = p.cost.step_time * 1e3
    out["peak_gib"] = p.cost.peak_memory / 1024 ** 3
    out["recompute"] = recompute_text(p)
    out["nodes"] = len(p.graph)
    out["solve_nodes"] = len(p.merged.problem.nodes)
    del p, module
    gc.collect()
    return out


#: the planning-time table's workloads (see the module docstring)
WORKLOADS = ("llama8b", "llama405b", "moe48", "llama8b_pp", "llama8b_again")


def workload(name: str, batch: int = 64):
    """``(module, args, kwargs, mesh, plan keywords)`` of table workload ``name`` (the LLaMAs at
    ``batch`` rows), on meta."""
    import torch

    import autopar

    if name in ("llama8b", "llama8b_again"):
        module, args, kwargs = build("llama", 32, batch, 2048)
        return module, args, kwargs, autopar.Mesh({"dp": 8, "tp": 8}, device="h100"), {}
    if name == "llama8b_pp":
        module, args, kwargs = build("llama", 32, batch, 2048)
        return module, args, kwargs, autopar.Mesh({"pp": 4, "dp": 2, "tp": 8}, device="h100"), \
            {"precision": "bf16-mixed"}
    if name == "llama405b":
        from autopar.models import make

        module, args = make("llama", "llama3-70b", batch=batch, seq=8192, device="meta", dim=16384, n_layers=126,
                            n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab_size=128256)
        return module, args, None, autopar.Mesh({"pp": 8, "dp": 8, "tp": 8}, device="h100"), \
            {"precision": "bf16-mixed"}
    if name == "moe48":
        import transformers
        from transformers import MixtralConfig, MixtralForCausalLM

        transformers.logging.set_verbosity_error()
        cfg = MixtralConfig(vocab_size=151936, hidden_size=2048, intermediate_size=768, num_hidden_layers=48,
                            num_attention_heads=32, num_key_value_heads=4, num_local_experts=128,
                            num_experts_per_tok=8, max_position_embeddings=4096, attention_dropout=0.0,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0)
        with torch.device("meta"):
            module = MixtralForCausalLM(cfg)
        module.config._attn_implementation = "sdpa"
        module = module.to(torch.bfloat16)  # the grouped_mm experts' fake kernel takes bf16 only
        ids = torch.randint(0, 151936, (8, 2048), generator=torch.Generator().manual_seed(0))
        return module, (), {"input_ids": ids, "labels": ids}, autopar.Mesh({"dp": 8, "tp": 8}, device="h100"), {}
    raise SystemExit(f"unknown workload {name!r}; choose from {WORKLOADS}")


def run_workload(name: str, batch: int = 64) -> None:
    """Plan table workload ``name`` with the ``autopar`` on the path (this tree's or another's) and
    print one ``workload`` line: wall and CPU seconds, the capture phase, the traces made."""
    torch = __import__("torch")
    torch.set_num_threads(1)
    import autopar
    from autopar import _torch_compat as tc
    from autopar.errors import InfeasibleError

    traces = [0]
    export = tc.export_joint

    def counted(*a, **k):
        traces[0] += 1
        return export(*a, **k)

    tc.export_joint = counted  # every capture traces through it
    module, args, kwargs, mesh, kw = workload(name, batch)
    if name.endswith("_again"):  # planned once before, on another mesh and budget; the second plan is timed
        autopar.plan(module, autopar.Mesh({"dp": 16, "tp": 4}, device="h100"), args, kwargs, progress=False,
                     memory_budget="60GiB", **kw)
    t, c = time.perf_counter(), time.process_time()
    try:
        plan = autopar.plan(module, mesh, args, kwargs, progress=False, **kw)
    except InfeasibleError as e:  # the time to that answer is planning time too
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        print(f"workload {name}: wall {wall:.2f} cpu {cpu:.2f} capture nan traces {traces[0]} | infeasible: "
              f"{str(e)[:160]}; load {os.getloadavg()[0]:.1f}", flush=True)
        return
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    pl = plan.pipeline
    chosen = f"; {pl.schedule} m={pl.microbatches}" if pl is not None else ""
    print(f"workload {name}: wall {wall:.2f} cpu {cpu:.2f} capture {plan.phases.get('capture', 0.0):.2f} "
          f"traces {traces[0]} | step {plan.step_time * 1e3:.1f} ms{chosen}; load {os.getloadavg()[0]:.1f}; "
          f"phases {plan.phases}", flush=True)
    try:  # (trees without the capture cache have no such record)
        from autopar.planner.captures import STATS

        print(f"captures: {STATS}", flush=True)
    except ImportError:
        pass


WORKLOAD_LINE = re.compile(r"^workload (\w+): wall ([0-9.]+) cpu ([0-9.]+) capture ([0-9.]+|nan) traces (\d+)", re.M)


def table(names: list[str], against: Optional[str], batch: int = 64) -> int:
    """The planning-time table: every workload in a fresh process, with commit ``against`` too."""
    import pathlib
    import subprocess

    here = pathlib.Path(__file__).resolve().parent.parent
    trees = [("this", here)]
    if against:
        trees.insert(0, (against, _worktree(here, against)))
    print(f"planning time per workload (the LLaMAs at batch {batch}); load {os.getloadavg()[0]:.1f}", flush=True)
    got: dict[tuple[str, str], tuple] = {}
    for name in names:
        for side, tree in trees:
            proc = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()), "--workload", name,
                                   "--batch", str(batch)],
                                  cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                                  text=True, timeout=7200)
            m = WORKLOAD_LINE.search(proc.stdout)
            if proc.returncode or m is None:
                raise SystemExit(f"{side}: workload {name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
            got[(name, side)] = m.groups()[1:]
            print("\n".join(f"{side:>8} {line}" for line in proc.stdout.strip().splitlines()
                            if line.startswith(("workload", "captures"))), flush=True)
    print("\n| workload | tree | planning s (wall) | CPU s | capture s | traces |\n|---|---|---|---|---|---|")
    for name in names:
        for side, _ in trees:
            wall, cpu, cap, traces = got[(name, side)]
            print(f"| {name} | {side} | {wall} | {cpu} | {cap} | {traces} |")
    return 0


def _worktree(here, ref: str):
    """A detached git worktree of ``ref`` under the temp dir (made once)."""
    import pathlib
    import subprocess
    import tempfile

    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=here, capture_output=True, text=True,
                         check=True).stdout.strip()
    base = pathlib.Path(tempfile.gettempdir()) / f"autopar-plan-time-{sha}"
    if not base.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(base), sha], cwd=here, check=True,
                       capture_output=True)
    return base


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS + tuple(f"corpus:{n}" for n in CORPUS), default="llama",
                    help="the code of the model (see above)")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--size", default="llama3-8b", help="the LLaMA preset whose dims the model takes (llama3-70b, ...)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--against", metavar="REF", help="a commit to plan with side by side (see above)")
    ap.add_argument("--cpu", action="store_true",
                    help="every phase in this process's CPU seconds instead of wall-clock ones (see above)")
    ap.add_argument("--table", nargs="*", metavar="WORKLOAD", default=None,
                    help=f"plan the table's workloads ({', '.join(WORKLOADS)}; default: all) instead")
    ap.add_argument("--workload", help=argparse.SUPPRESS)  # one table workload, in this process
    args = ap.parse_args(argv)
    if args.workload:
        run_workload(args.workload, args.batch)
        return 0
    if args.table is not None:
        return table(args.table or list(WORKLOADS), args.against, args.batch)
    if args.against:
        return against(args)

    import torch

    torch.set_num_threads(1)
    if args.cpu:  # the planner's clock (and its solver's wall-time caps) count this process's CPU time
        time.perf_counter = time.process_time
    shape = ("tiny corpus dims, its own batch and sequence), (2, 2) h100" if args.model.startswith("corpus:")
             else f"{args.size} dims), batch {args.batch}, seq {args.seq}, (8, 8) h100")
    print(f"model {args.model} ({shape}; load {os.getloadavg()[0]:.1f}"
          + ("; phases in CPU seconds" if args.cpu else ""), flush=True)
    rows = {}
    for L in args.layers:
        runs = [plan_once(L, args.batch, args.seq, args.model, args.size) for _ in range(args.repeat)]
        rows[L] = min(runs, key=lambda r: r["total"])
        r = rows[L]
        print(f"{L:>3} layers: " + "  ".join(f"{k} {r[k]:.2f}" for k in PHASES)
              + f"  | cpu {r['cpu']:.2f}; post-capture {r['post']:.2f} s; {r['nodes']} graph nodes,"
              f" {r['solve_nodes']} after merge;"
              f" plan {r['step_ms']:.1f} ms / {r['peak_gib']:.1f} GiB ({r['source']}; recompute {r['recompute']})"
              + (f"; totals {[round(x['total'], 2) for x in runs]}" if args.repeat > 1 else ""))
        sys.stdout.flush()

    lo, hi = min(rows), max(rows)
    ratio = rows[hi]["post"] / rows[lo]["post"] if rows[lo]["post"] > 0 else float("inf")
    print()
    print(f"post-capture {hi} layers / {lo} layers: {rows[hi]['post']:.2f} / {rows[lo]['post']:.2f} s "
          f"= {ratio:.2f}x  (target < {RATIO_TARGET}x: {'met' if ratio < RATIO_TARGET else 'MISSED'})")
    print(f"{hi}-layer total: {rows[hi]['total']:.2f} s  (target < {TOTAL_TARGET_S:.0f} s: "
          f"{'met' if rows[hi]['total'] < TOTAL_TARGET_S else 'MISSED'})")
    if args.markdown:
        print()
        print("| layers | " + " | ".join(PHASES) + " | post-capture | graph nodes | nodes after merge |")
        print("|" + "---|" * (len(PHASES) + 4))
        for L, r in rows.items():
            print(f"| {L} | " + " | ".join(f"{r[k]:.2f}" for k in PHASES)
                  + f" | {r['post']:.2f} | {r['nodes']} | {r['solve_nodes']} |")
    return 0


LINE = re.compile(r"^\s*(\d+) layers: (.*?)(?:\s+\||$)", re.M)


def phases_in(text: str) -> dict[int, dict[str, float]]:
    """``{layers: {phase: seconds}}`` from a ``plan_time.py`` run's output (any version's)."""
    return {int(m.group(1)): {k: float(v) for k, v in re.findall(r"(\w+) ([0-9.]+)", m.group(2))}
            for m in LINE.finditer(text)}


def against(args) -> int:
    """Plan each depth with commit ``args.against`` and with this tree, in turns (see the docstring)."""
    import pathlib
    import subprocess

    from ab import run_once

    here = pathlib.Path(__file__).resolve().parent.parent
    base = _worktree(here, args.against)
    sha = base.name.rsplit("-", 1)[1]
    this = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip()
    dirty = " (with uncommitted changes)" if subprocess.run(["git", "status", "--porcelain", "--", "autopar"], cwd=here,
                                                             capture_output=True, text=True).stdout.strip() else ""
    print(f"plan time, {sha} (base, {base}) against {this}{dirty} (this), side by side; batch {args.batch}, "
          f"seq {args.seq}; load {os.getloadavg()[0]:.1f}" + ("; phases in CPU seconds" if args.cpu else ""), flush=True)
    got: dict[str, dict[int, list[dict]]] = {"base": {}, "this": {}}
    for L in args.layers:
        for _ in range(args.repeat):
            for side, tree in (("base", base), ("this", here)):
                model = ["--model", args.model] if args.model != "llama" else []  # older trees: llama only
                model += ["--cpu"] if args.cpu else []  # (trees before --cpu existed refuse it)
                text, _ = run_once(tree, "plan_time.py", model + ["--layers", str(L), "--batch", str(args.batch),
                                                                  "--seq", str(args.seq)], 3600)
                row = phases_in(text)[L]
                got[side].setdefault(L, []).append(row)
                print(f"{side:>4} {L:>3} layers: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    print(f"\n| layers | phase | {sha} s | {this} s | this / base |\n|---|---|---|---|---|")
    for L in args.layers:
        b = min(got["base"][L], key=lambda r: r["total"])
        t = min(got["this"][L], key=lambda r: r["total"])
        for k in PHASES:
            if k in t or k in b:
                bv, tv = b.get(k, 0.0), t.get(k, 0.0)
                print(f"| {L} | {k} | {bv:.2f} | {tv:.2f} | {tv / bv if bv else float('nan'):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
