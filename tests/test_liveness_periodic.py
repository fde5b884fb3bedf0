"""A repeated layer stack walked once (``cost_model.liveness_periodic``): on stacks deep enough for a
window (8 layers of the built-in LLaMA, GPT and MoE, of Hugging Face's LLaMA and of torchtitan's Llama 3),
the walk of the short program, expanded, equals the plain op-by-op reference walk
(``tests/_liveness_reference.py``) peak for peak (bytes, parts, phase, op, and the most temporaries
at once), on every choice the planner prices, with and without recomputation and kept gathers, and
the window is taken (no fallback). Where instances differ (recomputed every other one, no folding,
an instance keeping its gathers alone) there is no window, and the walk still equals the reference."""

from __future__ import annotations

import warnings

import pytest
import torch
from _corpus import build as corpus_build
from _liveness_reference import reference_peak

import autopar
from autopar.cost_model import liveness
from autopar.cost_model import liveness_periodic as periodic
from autopar.cost_model.liveness import step_peak
from autopar.cost_model.liveness_program import program
from autopar.ir.recompute import recomputed_ops
from autopar.models import make
from autopar.passes.search.checkpoint import checkpointed_paths, levels
from autopar.passes.search.fold import no_folding
from autopar.passes.search.kept import kept_reads
from autopar.passes.search.peak import strategy_lookup
from autopar.planner.intra import run_passes
from autopar.planner.options import PlanOptions

DEPTH = 8


def _llama():
    torch.manual_seed(0)
    model, args = make("llama", "tiny", batch=4, seq=32, n_layers=DEPTH)
    return model, args, None


def _gpt():
    torch.manual_seed(0)
    model, args = make("gpt", "tiny", batch=8, seq=32, n_embd=64, n_layer=DEPTH, block_size=32)
    return model, args, None


def _moe():
    torch.manual_seed(0)
    model, args = make("moe", "tiny", batch=8, n_layers=DEPTH)
    return model, args, None


def _corpus(name):
    return lambda: corpus_build(name, layers=DEPTH)


CASES = [
    ("llama", _llama, {"dp": 2, "tp": 2}, {}),
    ("gpt-inference", _gpt, {"dp": 2, "tp": 2}, {"training": False}),
    ("hf_llama", _corpus("hf_llama"), {"dp": 4}, {}),
    ("titan", _corpus("titan_llama"), {"dp": 2, "tp": 2}, {}),
    ("moe", _moe, {"dp": 2, "ep": 2}, {}),
]

_PLANNED: dict = {}


def _planned(name, build, axes, options):
    if name not in _PLANNED:
        model, args, kwargs = build()
        mesh = autopar.Mesh(axes, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _PLANNED[name] = (run_passes(model, mesh, args, kwargs, PlanOptions(progress=False, **options)), mesh)
    return _PLANNED[name]


def _served(p, mesh, strategy_of, keep, redo):
    return ({k: (d.source, d.placed) for k, d in kept_reads(p.graph, strategy_of, keep, mesh, redo).items()}
            if keep else {})


def _variants(p):
    """(recomputed paths, kept paths): none; every instance but the last recomputed (each mode);
    every instance keeping its gathers; both."""
    out = [(None, [])]
    if p.terms and p.graph.training:
        for mode in ("full", "selective"):
            rc = levels(p.terms, mode, max(t.count for t in p.terms) - 1)
            out.append((checkpointed_paths(p.terms, rc) if rc.any else None, []))
        keep = [path for t in p.terms for path in t.paths]
        out.append((None, keep))
        out.append((out[1][0], keep))
    return out


def _storages(monkeypatch, walk) -> list:
    """Every storage ``walk()`` sweeps, as sorted ``(first moment, last moment, bytes, kind)``."""
    seen = []
    sweep = liveness._sweep

    def spy(start, last, size, kinds, saved_from, base, extra=None):
        for k, t0 in start.items():
            crossing = t0 < saved_from <= last[k]
            seen.append((t0, last[k], size[k], kinds.get(k, "activations" if crossing else "temporaries")))
        if extra is not None:
            names = ("activations", "temporaries")
            seen.extend((int(a), int(b), int(c), names[int(d)]) for a, b, c, d in zip(*extra))
        return sweep(start, last, size, kinds, saved_from, base, extra)

    monkeypatch.setattr(liveness, "_sweep", spy)
    walk()
    monkeypatch.setattr(liveness, "_sweep", sweep)
    return sorted(seen)


def _same(fast, ref, full) -> bool:
    """``fast`` equals the reference walk ``ref``, and the walk of every op ``full`` in the most
    temporaries at once (which the reference does not find)."""
    return fast == ref and fast.between == full.between


@pytest.mark.parametrize("name,build,axes,options", CASES, ids=[c[0] for c in CASES])
def test_the_window_walk_equals_the_reference_walk(name, build, axes, options, monkeypatch):
    p, mesh = _planned(name, build, axes, options)
    prog = program(p.graph)
    choices = [p.choice] + [p.recipe_choices[k] for k in sorted(p.recipe_choices)]
    walked, kept_seen = 0, False
    for choice in choices:
        strategy_of = strategy_lookup(p.problem, p.folding, choice)
        for paths, keep in _variants(p):
            redo = recomputed_ops(p.graph, paths) if paths else frozenset()
            served = _served(p, mesh, strategy_of, keep, redo)
            kept_seen = kept_seen or bool(served)
            win = periodic.window(p.graph, prog, p.folding, redo, served)
            assert win is not None and win.hi - win.tau >= periodic.MIN_WINDOW, (name, paths, keep)
            # the window's walk itself (``step_peak`` would fall back on ``Aperiodic``)
            fast = liveness._walk(p.graph, prog, strategy_of, mesh, p.precision, redo, served, None, win)
            ref = reference_peak(p.graph, strategy_of, mesh, p.precision, recomputed=redo, served=served)
            full = step_peak(p.graph, strategy_of, mesh, p.precision, recomputed=redo, served=served)
            assert _same(fast, ref, full), (name, paths, keep, fast, ref)
            # not the peak alone: every storage, its moments, bytes and kind
            assert _storages(monkeypatch, lambda: liveness._walk(p.graph, prog, strategy_of, mesh, p.precision, redo,
                                                                 served, None, win)) == \
                _storages(monkeypatch, lambda: liveness._walk(p.graph, prog, strategy_of, mesh, p.precision, redo,
                                                              served, None, None)), (name, paths, keep)
            assert _same(step_peak(p.graph, strategy_of, mesh, p.precision, recomputed=redo, served=served,
                                   alike=p.folding), ref, full)
            walked += 1
    assert walked >= 2
    if p.graph.training and name != "hf_llama":
        assert kept_seen, name  # (some choice gathers parameters the backward reads again)


def test_no_window_where_instances_differ():
    p, mesh = _planned(*CASES[0])
    prog = program(p.graph)
    strategy_of = strategy_lookup(p.problem, p.folding, p.choice)
    terms = p.terms
    paths = [path for t in terms for path in t.paths]
    every_other = {path: "full" for path in paths[::2]}
    cases = [
        ("recomputed every other instance", recomputed_ops(p.graph, every_other), [], p.folding),
        ("no folding", frozenset(), [], no_folding()),
    ]
    fsdp = [p.recipe_choices[k] for k in sorted(p.recipe_choices)]
    for choice in [p.choice] + fsdp:  # an instance in the middle keeping its gathers alone
        so = strategy_lookup(p.problem, p.folding, choice)
        if _served(p, mesh, so, [paths[len(paths) // 2]], frozenset()):
            strategy_of = so
            cases.append(("one instance keeps", frozenset(), [paths[len(paths) // 2]], p.folding))
            break
    assert len(cases) == 3
    for what, redo, keep, alike in cases:
        served = _served(p, mesh, strategy_of, keep, redo)
        win = periodic.window(p.graph, prog, alike, redo, served)
        assert win is None, what
        ref = reference_peak(p.graph, strategy_of, mesh, p.precision, recomputed=redo, served=served)
        full = step_peak(p.graph, strategy_of, mesh, p.precision, recomputed=redo, served=served)
        assert _same(step_peak(p.graph, strategy_of, mesh, p.precision, recomputed=redo, served=served, alike=alike),
                     ref, full), what


def test_the_stack_is_found_once_per_graph():
    p, _ = _planned(*CASES[0])
    st = periodic.stack(p.graph, program(p.graph))
    assert st is not None and len(st.inst) == DEPTH
    assert st.P > 0 and st.Q > 0
    assert st.touched >= {0, DEPTH - 1}  # the embedding's and the final norm's neighbours
    assert all(st.ok[1:DEPTH - 2])
    assert periodic.stack(p.graph, program(p.graph)) is st


def test_a_storage_outside_the_proof_falls_back_to_every_op(monkeypatch):
    p, mesh = _planned(*CASES[0])
    strategy_of = strategy_lookup(p.problem, p.folding, p.choice)
    full = step_peak(p.graph, strategy_of, mesh, p.precision)
    assert periodic.window(p.graph, program(p.graph), p.folding, frozenset(), {}) is not None
    walks = []

    def refuse(*args, **kwargs):
        walks.append(args[0])
        raise periodic.Aperiodic("refused")

    monkeypatch.setattr(periodic, "expand", refuse)
    prog = program(p.graph)
    win = periodic.window(p.graph, prog, p.folding, frozenset(), {})
    got = step_peak(p.graph, strategy_of, mesh, p.precision, alike=p.folding)
    assert walks and got == full and got.between == full.between
    try:  # not tried again: the window is forgotten
        assert periodic.window(p.graph, prog, p.folding, frozenset(), {}) is None
        assert step_peak(p.graph, strategy_of, mesh, p.precision, alike=p.folding) == full and len(walks) == 1
    finally:  # (the other tests share this graph)
        del prog.periodic[("short", win.tau, win.hi)]


def test_served_as_any_iterable_and_short_programs_held_few(monkeypatch):
    p, mesh = _planned(*CASES[0])
    prog = program(p.graph)
    paths = [path for t in p.terms for path in t.paths]
    strategy_of, kept = None, {}
    for choice in [p.choice] + [p.recipe_choices[k] for k in sorted(p.recipe_choices)]:
        strategy_of = strategy_lookup(p.problem, p.folding, choice)
        kept = _served(p, mesh, strategy_of, paths, frozenset())
        if kept:
            break
    assert kept
    # a one-shot iterable of (ref, placements), each serving itself, read by the window and the walk alike
    listed = reference_peak(p.graph, strategy_of, mesh, p.precision, served=list(kept))
    assert step_peak(p.graph, strategy_of, mesh, p.precision, served=iter(list(kept)), alike=p.folding) == listed
    # windows moved by recomputing the first or last k instances: few short programs held (here one),
    # every walk exact
    monkeypatch.setattr(periodic, "SHORTS_KEPT", 1)
    made = set()
    for k in range(1, len(paths) - 2):
        for redo in (recomputed_ops(p.graph, {path: "full" for path in paths[:k]}),
                     recomputed_ops(p.graph, {path: "full" for path in paths[-k:]})):
            win = periodic.window(p.graph, prog, p.folding, redo, {})
            made |= {(win.tau, win.hi)} if win is not None else set()
            full = step_peak(p.graph, strategy_of, mesh, p.precision, recomputed=redo)
            assert step_peak(p.graph, strategy_of, mesh, p.precision, recomputed=redo, alike=p.folding) == full, k
    held = [key for key, v in prog.periodic.items() if isinstance(key, tuple) and key[0] == "short" and v is not None]
    assert len(made) > periodic.SHORTS_KEPT and 1 <= len(held) <= periodic.SHORTS_KEPT, (made, held)
