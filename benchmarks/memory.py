"""Measured memory per rank against the plan's prediction, on 4 local gloo processes.

For GPT- and LLaMA-style models at a size where activations dominate the memory (batch 16 x 128
tokens, width 128, 4 layers, fp32 on CPU), the searched plan on (4,) and on (2, 2), and the
``fsdp`` recipe on (4,), with checkpointing pinned off and on every layer (``--modes``: ``"full"``
and ``"selective"``): each rank compiles the plan, trains
``--steps`` AdamW steps with ``pmodel.track_memory(optimizer)`` on, and reports its last step's
``pmodel.memory_stats()`` (``autopar.runtime.memory``: the peak of distinct live storages during
the forward and backward, split into parameters, gradients, optimizer state, saved activations
and temporaries). The table sets each against ``plan.peak_memory`` and ``plan.memory``: the
measured peak and activations of the largest rank over the predicted (the plan's figures are the
largest rank's).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/memory.py [--steps 3] [--simulate] [--markdown] [--kept-gathers]

``--kept-gathers`` measures the ``fsdp`` recipe on (4,) and (2, 2) instead, each with its gathers
kept for the backward (``kept_gathers="all"``) and not, checkpointing off and on: the kept blocks
are saved values, so they are in the activations.

``--simulate`` measures with ``autopar.simulate(..., measure_memory=True)`` in this process
instead (one step; the optimizer state is the plan's bytes per parameter element).

``--corpus`` compares the predicted peak (``plan.peak_memory``: the liveness walk of
``autopar.cost_model.liveness``) with the simulator's measured one over a corpus at two sizes each:
the built-in GPT of issue 31 (batch 8 x 128 tokens, width 256, 4 layers) at vocabularies 8192 and
1024 (searched on (4,), and with every layer recomputed, ``checkpointing="full"``), the built-in
LLaMA and MoE, the torchtitan-style Llama 3 and Hugging Face GPT-2 of ``tests/_corpus.py`` at 2 and
4 layers (on (2, 2)), and two pipelined plans on pp=2 x dp=2 under GPipe: the GPT at vocabulary
1024 and the torchtitan-style Llama 3 at 4 layers. A pipelined plan is measured per pipeline rank
(``runtime.pipeline.memory``: each rank's stages, state and stashes apart) in the simulator's GPipe
order, hence the pinned schedule; its row's plan column gives each rank's predicted over measured
peak (``plan.pipeline.rank_memory``). With ``--gloo`` the issue's GPT at
vocabulary 8192 is also run on 4 gloo processes (3 AdamW steps, the last step's ``memory_stats()``).
``--pipelined`` runs the pipelined rows alone. Target: predicted over measured within 0.9-1.15 on
every row.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/memory.py --corpus [--pipelined] [--gloo] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

import autopar
from autopar.models import make

SHAPES = {"gpt": dict(n_embd=128, n_head=4, n_layer=4, block_size=128, vocab_size=256),
          "llama": dict(dim=128, n_heads=4, n_kv_heads=2, ffn_dim=384, n_layers=4, vocab_size=256, max_seq_len=128)}
MESHES = {"4": {"dp": 4}, "2x2": {"dp": 2, "tp": 2}}
#: (mesh, recipe or None for the search)
SETUPS = [("4", None), ("2x2", None), ("4", "fsdp")]
BATCH, SEQ = 16, 128


def _model(family: str):
    torch.manual_seed(0)
    return make(family, "tiny", batch=BATCH, seq=SEQ, **SHAPES[family])


def _plan(family: str, mesh: str, recipe, checkpointing: str, kept: str = "none") -> autopar.Plan:
    model, args = _model(family)
    make_plan = autopar.plan if recipe is None else getattr(autopar.recipes, recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_plan(model, autopar.Mesh(MESHES[mesh], device="cpu"), args, progress=False,
                         checkpointing=checkpointing, kept_gathers=kept)


def _measure_on_rank(cases: list, steps: int) -> list[dict]:
    """On every gloo rank: each case's plan compiled and trained ``steps`` steps; the last step's stats."""
    return [_trained(*_model(family), MESHES[mesh], text, steps) for family, mesh, text in cases]


def _trained(model, args, axes: dict, text: str, steps: int) -> dict:
    """``model`` compiled on this gloo rank with ``text``'s plan, ``steps`` AdamW steps measured: the last's stats."""
    pm = autopar.compile(model, autopar.Mesh(axes, device="cpu"), args, plan=autopar.Plan.from_dict(json.loads(text)))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm.track_memory(opt)
    for _ in range(steps):
        pm(*args).backward()
        opt.step()
        opt.zero_grad()
    return pm.memory_stats()


def _table(head: list, rows: list, markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in [head] + rows:
            print("  ".join(r))


def _split(memory: dict) -> str:
    """Parameters / gradients / optimizer / activations / temporaries, in MiB."""
    return " / ".join(f"{memory.get(k, 0) / (1 << 20):.2f}" for k in ("params", "grads", "optimizer", "activations",
                                                                       "temporaries"))


def _issue_gpt(vocab: int):
    torch.manual_seed(0)
    return make("gpt", "tiny", batch=8, seq=128, n_layer=4, n_embd=256, n_head=8, vocab_size=vocab, block_size=128)


def _corpus_model(name: str, layers: int):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import _corpus

    torch.manual_seed(0)
    return getattr(_corpus, name)(layers=layers)


#: (label, size, builder returning (model, args[, kwargs]), mesh axes, plan keywords)
CORPUS = [
    ("gpt (issue 31)", "vocab 8192", lambda: _issue_gpt(8192), {"dp": 4}, {}),
    ("gpt (issue 31)", "vocab 1024", lambda: _issue_gpt(1024), {"dp": 4}, {}),
    ("gpt recomputed", "vocab 8192", lambda: _issue_gpt(8192), {"dp": 4}, {"checkpointing": "full"}),
    ("gpt recomputed", "vocab 1024", lambda: _issue_gpt(1024), {"dp": 4}, {"checkpointing": "full"}),
    ("llama", "4 layers, batch 16", lambda: _model("llama"), {"dp": 2, "tp": 2}, {}),
    ("llama", "2 layers, batch 8", lambda: (torch.manual_seed(0), make("llama", "tiny", batch=8, seq=128,
                                                                       **dict(SHAPES["llama"], n_layers=2)))[1],
     {"dp": 2, "tp": 2}, {}),
    ("moe", "batch 8", lambda: (torch.manual_seed(0), make("moe", "tiny", batch=8))[1], {"dp": 2, "tp": 2}, {}),
    ("moe", "batch 32, width 64", lambda: (torch.manual_seed(0), make("moe", "tiny", batch=32, dim=64, ffn_dim=128))[1],
     {"dp": 2, "tp": 2}, {}),
    ("titan_llama (corpus)", "2 layers", lambda: _corpus_model("titan_llama", 2), {"dp": 2, "tp": 2}, {}),
    ("titan_llama (corpus)", "4 layers", lambda: _corpus_model("titan_llama", 4), {"dp": 2, "tp": 2}, {}),
    ("hf_gpt2 (corpus)", "2 layers", lambda: _corpus_model("hf_gpt2", 2), {"dp": 2, "tp": 2}, {}),
    ("hf_gpt2 (corpus)", "4 layers", lambda: _corpus_model("hf_gpt2", 4), {"dp": 2, "tp": 2}, {}),
    ("gpt pipelined", "vocab 1024", lambda: _issue_gpt(1024), {"pp": 2, "dp": 2}, {"pipeline": {"schedule": "GPipe"}}),
    ("titan_llama pipelined", "4 layers", lambda: _corpus_model("titan_llama", 4), {"pp": 2, "dp": 2},
     {"pipeline": {"schedule": "GPipe"}}),
]


def _built(builder):
    got = builder()
    return (got[0], got[1], {}) if len(got) == 2 else got


def _gloo_issue_gpt(text: str, steps: int) -> dict:
    """On every gloo rank: the issue's GPT compiled with ``text``'s plan, ``steps`` AdamW steps measured."""
    return _trained(*_issue_gpt(8192), {"dp": 4}, text, steps)


def corpus(a) -> int:
    """The ``--corpus`` table (see the module's docstring)."""
    mib = 1 << 20
    head = ["model", "size", "mesh", "plan", "predicted peak MiB", "measured peak MiB", "predicted / measured",
            "predicted params / grads / optimizer / activations / temporaries MiB", "measured (same) MiB", "peak at"]
    rows, ratios = [], []
    for label, size, builder, axes, kw in CORPUS:
        if a.pipelined and "pipeline" not in kw:
            continue
        model, args, kwargs = _built(builder)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autopar.plan(model, autopar.Mesh(axes, device="cpu"), args, kwargs, progress=False, **kw)
        split = _split(plan.memory)
        mesh = " x ".join(f"{k}{v}" for k, v in axes.items())
        what = "recomputed" if plan.checkpointing else plan.source
        _, _, mem = autopar.simulate(model, plan, args, kwargs, measure_memory=True)
        got = max(mem.values(), key=lambda m: m["peak"])
        if plan.pipeline is not None:  # each rank's predicted over its largest device's measured peak
            pl, at = plan.pipeline, list(plan.pipeline.mesh_names).index(plan.pipeline.axis)
            per = [pl.rank_memory[r] / max(m["peak"] for c, m in mem.items() if c[at] == r) for r in range(pl.degree)]
            what = (f"{pl.schedule}, {pl.microbatches} micro-batches; per rank "
                    + " / ".join(f"{x:.3f}" for x in per))
        ratio = plan.peak_memory / got["peak"]
        ratios.append(ratio)
        measured = _split(got)
        rows.append([label, size, mesh, what, f"{plan.peak_memory / mib:.2f}", f"{got['peak'] / mib:.2f}",
                     f"{ratio:.3f}", split, measured, plan.peak_at])
    if a.gloo:
        model, args = _issue_gpt(8192)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autopar.plan(model, autopar.Mesh({"dp": 4}, device="cpu"), args, progress=False)
        per_rank = autopar.launch(_gloo_issue_gpt, 4, plan.to_json(timing=False), a.steps, timeout=1200.0)
        got = max(per_rank, key=lambda m: m["peak"])
        ratio = plan.peak_memory / got["peak"]
        ratios.append(ratio)
        rows.append(["gpt (issue 31), gloo", "vocab 8192", "dp4", plan.source, f"{plan.peak_memory / mib:.2f}",
                     f"{got['peak'] / mib:.2f}", f"{ratio:.3f}", _split(plan.memory), _split(got), plan.peak_at])
    _table(head, rows, a.markdown)
    print(f"predicted / measured: {min(ratios):.3f} to {max(ratios):.3f} over {len(ratios)} measured rows "
          f"(target 0.9-1.15)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--simulate", action="store_true", help="measure in the simulator instead of on gloo")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--families", nargs="+", default=["gpt", "llama"], choices=sorted(SHAPES))
    ap.add_argument("--modes", nargs="+", default=["full", "selective"], choices=["full", "selective"],
                    help="the checkpointing modes measured besides none")
    ap.add_argument("--kept-gathers", action="store_true", help="fsdp with and without kept gathers")
    ap.add_argument("--corpus", action="store_true", help="predicted against simulated peaks over the corpus")
    ap.add_argument("--gloo", action="store_true", help="with --corpus: the issue's GPT on 4 gloo processes too")
    ap.add_argument("--pipelined", action="store_true", help="with --corpus: the pipelined rows alone")
    a = ap.parse_args(argv)
    if a.corpus:
        return corpus(a)
    cases = [(f, m, r, ck, "none") for f in a.families for m, r in SETUPS for ck in ["none"] + a.modes]
    if a.kept_gathers:
        cases = [(f, m, "fsdp", ck, kg) for f in a.families for m in ("4", "2x2") for ck in ("none", "full")
                 for kg in ("none", "all")]
    print(f"load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    t0 = time.time()
    plans = {c: _plan(*c) for c in cases}
    print(f"planned {len(cases)} cases in {time.time() - t0:.1f} s", file=sys.stderr)
    t0 = time.time()
    if a.simulate:
        measured = {}
        for c in cases:
            model, args = _model(c[0])
            _, _, mem = autopar.simulate(model, plans[c], args, measure_memory=True)
            measured[c] = list(mem.values())
    else:
        texts = [(c[0], c[1], plans[c].to_json(timing=False)) for c in cases]
        per_rank = autopar.launch(_measure_on_rank, 4, texts, a.steps, timeout=1200.0)
        measured = {c: [r[i] for r in per_rank] for i, c in enumerate(cases)}
    print(f"measured in {time.time() - t0:.1f} s", file=sys.stderr)
    mib = 1 << 20
    head = ["model", "mesh", "plan", "checkpointing", "kept gathers", "predicted peak MiB", "measured peak MiB", "peak ratio",
            "predicted activations MiB", "measured at the peak MiB", "ratio", "most alive at once MiB", "ratio",
            "params / grads / optimizer / temporaries at the peak MiB"]
    rows = []
    worst = 0.0
    for c in cases:
        plan, got = plans[c], max(measured[c], key=lambda s: s["peak"])
        pa = plan.memory["activations"]
        ratio, aratio, most = got["peak"] / plan.peak_memory, got["activations"] / pa, got["activations_peak"] / pa
        if c[2] is None:
            worst = max(worst, abs(ratio - 1), abs(aratio - 1))
        rest = " / ".join(f"{got[k] / mib:.2f}" for k in ("params", "grads", "optimizer", "temporaries"))
        rows.append([c[0], "x".join(str(v) for v in MESHES[c[1]].values()), c[2] or "search", c[3], c[4],
                     f"{plan.peak_memory / mib:.2f}", f"{got['peak'] / mib:.2f}", f"{ratio:.3f}", f"{pa / mib:.2f}",
                     f"{got['activations'] / mib:.2f}", f"{aratio:.3f}", f"{got['activations_peak'] / mib:.2f}",
                     f"{most:.3f}", rest])
    _table(head, rows, a.markdown)
    print(f"searched plans: largest deviation of the peak or the activations at the peak from the prediction: "
          f"{worst * 100:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
