"""The liveness walk (``cost_model.liveness.step_peak``: int codes, a walk shared per graph, a numpy
sweep) equals the plain op-by-op walk of ``tests/_liveness_reference.py``, peak for peak (bytes, parts,
phase and op), on every choice the planner prices: each recipe's and the search's, with and without
recomputation and kept gathers, training and inference, on several models and meshes."""

from __future__ import annotations

import warnings

import pytest
import torch
from _corpus import build as corpus_build
from _liveness_reference import reference_peak

import autopar
from autopar.cost_model.liveness import step_peak
from autopar.ir.recompute import recomputed_ops
from autopar.models import make
from autopar.passes.search.checkpoint import checkpointed_paths, levels
from autopar.passes.search.kept import kept_reads
from autopar.passes.search.peak import strategy_lookup
from autopar.planner.intra import run_passes
from autopar.planner.options import PlanOptions


def _gpt():
    torch.manual_seed(0)
    model, args = make("gpt", "tiny", batch=8, seq=32, n_embd=64, n_layer=3, block_size=32)
    return model, args, None


def _llama():
    torch.manual_seed(0)
    model, args = make("llama", "tiny", batch=4, seq=32, n_layers=3)
    return model, args, None


def _moe():
    torch.manual_seed(0)
    model, args = make("moe", "tiny", batch=8, n_layers=2)
    return model, args, None


def _corpus(name):
    return lambda: corpus_build(name, layers=3)


CASES = [
    ("gpt", _gpt, {"dp": 2, "tp": 2}, {}),
    ("gpt-inference", _gpt, {"dp": 2, "tp": 2}, {"training": False}),
    ("llama-3d", _llama, {"dp": 2, "sp": 2, "tp": 2}, {"attention": {"sp": "ring"}}),
    ("moe", _moe, {"dp": 2, "ep": 2}, {}),
    ("titan", _corpus("titan_llama"), {"dp": 2, "tp": 2}, {}),
    ("hf_gpt2", _corpus("hf_gpt2"), {"dp": 4}, {}),
]


def _variants(p):
    """(recomputed paths, kept paths) to walk each choice with: none; and with layer groups, every
    instance but the last recomputed (each mode), and every instance keeping its gathers."""
    out = [(None, [])]
    if p.terms and p.graph.training:
        for mode in ("full", "selective"):
            rc = levels(p.terms, mode, max(t.count for t in p.terms) - 1)
            out.append((checkpointed_paths(p.terms, rc) if rc.any else None, []))
        out.append((None, [path for t in p.terms for path in t.paths]))
    return out


@pytest.mark.parametrize("name,build,axes,options", CASES, ids=[c[0] for c in CASES])
def test_the_walk_equals_the_reference_walk(name, build, axes, options):
    model, args, kwargs = build()
    mesh = autopar.Mesh(axes, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = run_passes(model, mesh, args, kwargs, PlanOptions(progress=False, **options))
    choices = [p.choice] + [p.recipe_choices[k] for k in sorted(p.recipe_choices)]
    walked = 0
    for choice in choices:
        strategy_of = strategy_lookup(p.problem, p.folding, choice)
        for paths, keep in _variants(p):
            redo = recomputed_ops(p.graph, paths) if paths else frozenset()
            served = ({k: (d.source, d.placed) for k, d in kept_reads(p.graph, strategy_of, keep, mesh, redo).items()}
                      if keep else {})
            fast = step_peak(p.graph, strategy_of, mesh, p.precision, recomputed=redo, served=served)
            ref = reference_peak(p.graph, strategy_of, mesh, p.precision, recomputed=redo, served=served)
            assert fast == ref, (name, paths, keep)
            assert step_peak(p.graph, strategy_of, mesh, p.precision, recomputed=redo, served=served,
                             alike=p.folding) == ref, (name, paths, keep)
            walked += 1
    assert walked >= 2
