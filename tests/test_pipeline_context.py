"""Pipelined plans with sequence-split attention (``pp`` x ``cp``): ring, load-balanced ring and Ulysses
forced by ``attention=`` on the stage mesh, inputs split on the sequence by ``hints=``. A stage
boundary's gradient crosses as its activation is placed (``ir.stages.boundary_carriers``: resharded by
the stage that makes it, as torch's stages send a stage's input gradients in its inputs' shapes), so
the simulated step's loss and every gradient equal the single-device model's (float64), and every
resharding and transfer each device ran is the plan's (the ring's exchanges inside the op
besides). Dropout inside attention under Ulysses or the
gather form keeps the one-device program's random stream in a pipeline; ring attention, which runs no
dropout, is refused by name."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import autopar
from autopar.errors import ArgumentError, HintError
from autopar.ir.attention import ATTN_BWD, ATTN_FWD
from autopar.ir.capture import capture
from autopar.ir.graph import Phase
from autopar.ir.placement import P, Split
from autopar.ir.stages import boundary_carriers, stage_rule
from autopar.models import make
from autopar.runtime.accounting import compare

from _parity import rel

MESH = {"pp": 2, "cp": 2}
SEQ = {"input:0": "cp=S(1)", "input:1": "cp=S(1)"}
TOL = 1e-9  # float64: only reassociation differs
#: what each forced form's attention ops carry on cp (Ulysses: a head split of sequence-split operands)
TAGS = {"ring": "ring", "ring:balanced": "ring:balanced", "ulysses": "S:h", "gather": "S:s"}


def _plan(model, args, form: str, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, autopar.Mesh(MESH, device="cpu"), args, hints=SEQ, precision="fp64",
                            attention={"cp": form}, pipeline={"microbatches": 2},
                            progress=False, **kw)


def _llama():
    torch.manual_seed(0)
    model, args = make("llama", "tiny", batch=2, seq=32, n_layers=2)
    return model.double(), args


@functools.lru_cache(maxsize=None)
def _llama_plan(form: str):
    model, args = _llama()
    return _plan(model, args, form)


@pytest.mark.parametrize("form", ["ring", "ring:balanced", "ulysses"])
def test_sequence_split_pipeline_matches_one_device(form):
    model, args = _llama()
    plan = _llama_plan(form)
    cp = plan.axis_names.index("cp")
    assert {n["tags"][cp] for n in plan.nodes if n["op"] in (ATTN_FWD, ATTN_BWD)} == {TAGS[form]}
    assert plan.nodes and any("S(1)" in p for p in plan.placements.values())
    trace, predicted = {}, {}
    loss, grads = autopar.simulate(model, plan, args, trace=trace, predicted=predicted)
    ref = model(*args)
    ref.backward()
    assert rel(loss, ref.detach()) <= TOL
    assert max(rel(grads[name], p.grad) for name, p in model.named_parameters()) <= TOL
    for c in trace:  # every resharding and transfer as the plan predicts; the ring's own exchanges besides
        assert [d for d in compare(predicted[c], trace[c]) if not d.startswith("permute on cp")] == []
        assert any(r.kind == "permute" for r in trace[c]) == form.startswith("ring")


def test_a_boundary_gradient_placed_otherwise_is_sent_as_its_activation():
    """Under Ulysses the residual stream's gradient is made partial on cp while its activation is
    sequence-split: the stage that makes it reduce-scatters it to the activation's placement (an
    entry whose consumer is its maker) before it is sent back."""
    plan = _llama_plan("ulysses")
    model, args = _llama()
    graph = capture(model, tuple(a[:1] for a in args))
    stage_of, users = stage_rule(graph, plan.pipeline.stages), graph.users()
    phase = {n["name"]: n["phase"] for n in plan.nodes}
    carried = [r for r in plan.reshardings if r["consumer"] == r["tensor"] and phase[r["consumer"]] == "backward"]
    assert carried, "no boundary gradient was resharded by its maker"
    for r in carried:
        assert [s["kind"] for s in r["steps"]] == ["reduce_scatter"] and r["to"] == "S(1)", r
        assert stage_of(r["consumer"]) == 1
        assert any(stage_of(u) == 0 for u in users[r["tensor"]])  # read by the stage before


def test_boundary_carriers_pair_each_gradient_sent_back_with_an_activation():
    """On LLaMA's captured step cut in two stages, with every forward value sequence-split and every
    backward one partial: the one gradient sent back (the residual stream's) is carried as its
    activation is placed; placed alike, it needs no carrier."""
    model, args = _llama()
    graph = capture(model, tuple(a[:1] for a in args))
    stage_of = stage_rule(graph, [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]])
    phase = {n.name: n.phase for n in graph.nodes}
    split = lambda r: (Split(1),) if phase[r.node] == Phase.FORWARD else (P,)  # noqa: E731
    carried = boundary_carriers(graph, stage_of, split)
    assert list(carried.values()) == [(Split(1),)]
    (ref,) = carried
    assert phase[ref.node] == Phase.BACKWARD and stage_of(ref.node) == 1
    assert graph.spec(ref).shape == (1, 32, model.tok_embeddings.embedding_dim)
    assert boundary_carriers(graph, stage_of, lambda r: (Split(1),)) == {}


def _gpt():
    torch.manual_seed(0)
    return make("gpt", "tiny", batch=4, seq=16, dtype=torch.float64, dropout=0.3, n_layer=2)


def _simulate(model, plan, args, seed=5):
    torch.manual_seed(seed)  # simulate draws the run's seed from torch's default generator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.simulate(model, plan, args)


@pytest.fixture(scope="module")
def one_device():
    model, args = _gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, autopar.Mesh({"a": 1}, device="cpu"), args, progress=False)
    return plan, _simulate(model, plan, args)


@pytest.mark.parametrize("form", ["ulysses", "gather"])
def test_dropout_inside_sequence_split_attention_keeps_the_stream(one_device, form):
    """GPT (tied head) with dropout 0.3 in attention and around it: the pipelined step on pp2 x cp2 draws
    the one-device program's masks, with the attention op split on the sequence (gather) or on heads
    after an all-to-all (Ulysses)."""
    model, args = _gpt()
    plan = _plan(model, args, form)
    cp = plan.axis_names.index("cp")
    attn = [n for n in plan.nodes if n["op"] == ATTN_FWD]
    assert attn and {n["tags"][cp] for n in attn} == {TAGS[form]}
    loss, grads = _simulate(model, plan, args)
    ref_loss, ref_grads = one_device[1]
    assert rel(loss, ref_loss) <= TOL
    assert max(rel(grads[k], g) for k, g in ref_grads.items()) <= TOL
    # the draw matters: another seed is another loss
    assert abs(_simulate(model, one_device[0], args, seed=6)[0].item() - ref_loss.item()) > 1e-6


def test_ring_on_dropout_attention_and_the_pipeline_axis_are_refused_by_name():
    model, args = _gpt()
    with pytest.raises(HintError, match="draws dropout, p=0.3, which ring attention does not run"):
        _plan(model, args, "ring")
    mesh = autopar.Mesh(MESH, device="cpu")
    with pytest.raises(ArgumentError, match="names the pipeline axis 'pp'"):
        autopar.plan(model, mesh, args, attention={"pp": "ulysses"}, progress=False)
    with pytest.raises(ArgumentError, match=r"hints\['input:0'\].*name those axes, e.g. 'cp=S\(1\)'"):
        autopar.plan(model, mesh, args, hints={"input:0": "S(0), S(1)"}, progress=False)
    with pytest.raises(ArgumentError, match="stage mesh"):
        autopar.plan(model, mesh, args, hints={"input:0": "pp=S(0), cp=S(1)"}, progress=False)


@pytest.mark.gloo
@pytest.mark.slow
def test_gloo_pp_cp_ring_and_ulysses_match_one_device():
    """pp2 x cp2 on 4 gloo ranks (``autopar.compile``, torch's pipeline stages sending the boundary
    gradients in their activations' slots; Ulysses's carried by the stage that makes it), ring and
    Ulysses in one launch: 3 AdamW steps equal the single-device model's, and every rank runs the
    collectives and transfers the plan predicts for it (the ring's exchanges inside the op besides)."""
    from _pipeline_mesh_helpers import build, train_cases

    cases = []
    for form in ("ring", "ulysses"):
        model, args = build("llama", 2, 2, 32)
        plan = autopar.plan(model, autopar.Mesh(MESH, device="cpu"), args, hints=SEQ, attention={"cp": form},
                            pipeline={"schedule": "1F1B", "microbatches": 2}, progress=False)
        if form == "ulysses":  # (in fp32 the residual's gradient is partial where its activation is whole)
            assert any(r["consumer"] == r["tensor"] and r["kind"] == "activation" for r in plan.reshardings)
        cases.append(("llama", 2, 2, tuple(MESH.items()), plan.to_json(), 32))
    for form, results in zip(("ring", "ulysses"), zip(*autopar.launch(train_cases, 4, cases, timeout=360))):
        for rank, out in enumerate(results):
            assert out["loss"] <= 1e-4 and out["grad"] <= 1e-4 and out["param"] <= 1e-4, (form, rank, out)
            assert all(d.startswith("permute on cp") for d in out["differences"]), (form, rank, out["differences"])
