"""Ulysses over two mesh axes: a tensor split on one dim by both axes (the sequence) turned into a
split on another dim by both (the heads) is one all-to-all over the two axes' combined group
(``cost_model.comm.joint_step``), run by the simulator and by gloo process groups over axis pairs
(``runtime.collectives``), priced on both axes' links. The collective is checked against the
nested splits it must produce; the USP/LoongTrain mix (ring on one axis, Ulysses on the other)
against the single-device model."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.cost_model.comm import joint_time, reshard_steps, ring_time, step_axes
from autopar.cost_model.hardware import Link
from autopar.errors import PlanError
from autopar.ir.placement import B, Split, local_block
from autopar.models import make
from autopar.program import collectives as C
from autopar.runtime.threads import run_threads

from test_ulysses import GroupedAttention, _all_to_alls_into_attention, _attention_reads, _check, _seq_hints


@pytest.mark.parametrize("mesh_shape,axes,others", [
    ((2, 3), (0, 1), (B, B)),
    ((3, 2), (0, 1), (B, B)),
    ((2, 2, 2), (0, 2), (B, Split(0), B)),  # a third axis between them splits another dim
    ((2, 2, 2), (1, 2), (Split(2), B, B)),  # an outer axis splits the sequence too
])
def test_joint_all_to_all_gives_the_nested_splits(mesh_shape, axes, others):
    """Every device ends with exactly the block the nested head split gives it (``local_block``),
    from the block the nested sequence split gave it: the combined group numbers its ranks the way
    nested splits of one dim order their blocks."""
    whole = torch.arange(2 * 12 * 24 * 2, dtype=torch.float64).reshape(2, 12, 24, 2)
    src, dst = list(others), list(others)
    for a in axes:
        src[a], dst[a] = Split(2), Split(1)
    seen = list(src)
    for a in axes:
        seen[a] = B

    def rank(coords):
        x = local_block(whole, src, mesh_shape, coords)
        group = local_block(whole, seen, mesh_shape, coords).shape
        mine = local_block(whole, dst, mesh_shape, coords)
        got = C.wait(C.all_to_all(x.contiguous(), tuple(axes), 2, 1, group[2], mine.shape[1]))
        return torch.equal(got, mine)

    results, executed = run_threads(rank, mesh_shape, [f"x{i}" for i in range(len(mesh_shape))])
    assert all(results.values()), results
    label = "+".join(f"x{a}" for a in axes)
    assert all([e.kind for e in ran] == ["all_to_all"] and ran[0].axis == label for ran in executed.values())


def test_sequence_to_heads_on_two_axes_is_one_all_to_all():
    """Priced as one all-to-all over the 8 devices, not the gathers the one-axis steps would need
    (whichever axis went second would find the other's pieces interleaved)."""
    mesh = autopar.Mesh({"cp": 2, "tp": 4}, device="h100")
    shape, eb = (1, 32, 131072, 128), 2
    seq, heads = (Split(2), Split(2)), (Split(1), Split(1))
    for src, dst in ((seq, heads), (heads, seq)):
        steps = reshard_steps(shape, src, dst, mesh, eb)
        assert [(s.kind, step_axes(s)) for s in steps] == [("all_to_all", (0, 1))]
        whole = 32 * 131072 * 128 * eb
        assert steps[0].bytes == whole  # the buffer as the group of all 8 sees it
        # one node: equal links, so it costs what one axis of 8 devices would
        assert steps[0].time == pytest.approx(ring_time("all_to_all", whole, 8, mesh.links[0]))
    # uneven heads (6 over 8 devices): nested splits are not the flat ones, so no joint step
    steps = reshard_steps((1, 6, 64, 8), seq, heads, mesh, eb)
    assert all(not s.axes for s in steps) and "all_gather" in [s.kind for s in steps]


def test_joint_price_charges_the_slower_link_for_pieces_that_cross_it():
    fast, slow = Link(1e-6, 400e9), Link(5e-6, 50e9)
    nbytes = 8 * 2 ** 30
    t = joint_time(nbytes, (2, 8), (slow, fast))  # 2 nodes of 8
    block = nbytes / 16
    assert t == pytest.approx(16 * 5e-6 + 1 / 2 * block / 50e9 + 7 / 16 * block / 400e9)
    # the same pieces whichever axis comes first; dearer than over the fast link alone
    assert joint_time(nbytes, (8, 2), (fast, slow)) == pytest.approx(t)
    assert t > ring_time("all_to_all", nbytes, 16, fast)


@pytest.mark.parametrize("forms", [{"a": "ring", "b": "ulysses"}, {"a": "ulysses", "b": "ring"}],
                         ids=["ring-outer", "ring-inner"])
@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_ring_and_ulysses_compose_on_two_axes(family, forms):
    """USP/LoongTrain's 2-D attention: ring over one axis, heads over the other, one plan; with the
    ring outer, q, k and v (sequence split on both) reach it by one all-to-all on the inner axis."""
    torch.manual_seed(0)
    model, args = make(family, "tiny", batch=2, seq=32)
    model = model.double()
    axes = {"a": 2, "b": 2}
    plan = autopar.plan(model, autopar.Mesh(axes, device="cpu"), args, precision="fp64", attention=forms,
                        hints=_seq_hints(axes, ["input:0", "input:1"], ("a", "b")), deterministic_time=0.5,
                        progress=False)
    want = tuple("S:h" if forms[a] == "ulysses" else "ring" for a in axes)
    assert {tuple(tags) for _, tags in _attention_reads(plan)} == {want}
    if forms["a"] == "ring":
        assert _all_to_alls_into_attention(plan, "b") >= 3
    _check(model, args, {}, plan)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_grouped_query_ulysses_on_two_axes(causal):
    """8 query heads, 2 kv heads, Ulysses on both axes of (2, 2): the queries arrive by the joint
    all-to-all; the kv heads, fewer than the 4 devices, are shared where they cannot split."""
    torch.manual_seed(0)
    model = GroupedAttention(causal).double()
    ids = torch.randint(0, 64, (2, 16))
    args = (ids, torch.roll(ids, -1, 1))
    axes = {"a": 2, "b": 2}
    plan = autopar.plan(model, autopar.Mesh(axes, device="cpu"), args, precision="fp64",
                        hints=_seq_hints(axes, ["input:0", "input:1"], ("a", "b")),
                        attention={"a": "ulysses", "b": "ulysses"}, deterministic_time=0.5, progress=False)
    assert _all_to_alls_into_attention(plan, "a+b") >= 1
    _check(model, args, {}, plan)


@pytest.fixture(scope="module")
def pool(gloo_pool4):
    return gloo_pool4()


def test_ulysses_on_two_axes_trains_on_gloo(pool):
    """LLaMA with Ulysses over both axes of (cp 2, tp 2) on 4 gloo ranks: AdamW steps next to the
    single-device model; the joint all-to-alls run on process groups over both axes, and every
    collective the plan predicts (those among them) is the one that ran."""
    from _parity import build, train_on_rank

    model, args = build("llama")
    axes = (("cp", 2), ("tp", 2))
    plan = autopar.plan(model, autopar.Mesh(dict(axes), device="cpu"), args,
                        hints=_seq_hints(dict(axes), ["input:0", "input:1"], ("cp", "tp")),
                        attention={"cp": "ulysses", "tp": "ulysses"}, deterministic_time=0.5, progress=False)
    assert _all_to_alls_into_attention(plan, "cp+tp") >= 3
    for out in pool.run(train_on_rank, "llama", axes, plan.to_json()):
        assert out["loss"] <= 1e-5 and out["grad"] <= 1e-4 and out["param"] <= 1e-4, out
        assert out["differences"] == [], out


def test_search_picks_ulysses_over_both_axes_at_long_context():
    """LLaMA-3-8B dims (2 layers), one sequence of 131,072 tokens on (cp 2, tp 4) H100s: unforced,
    the search runs every attention op as Ulysses on both axes, its q, k and v (and the output and
    gradients back) moved by all-to-alls over all 8 devices, the other forms priced dearer."""
    model, args = make("llama", size="llama3-8b", batch=1, seq=131072, device="meta", n_layers=2,
                       max_seq_len=131072)
    plan = autopar.plan(model, autopar.Mesh({"cp": 2, "tp": 4}, device="h100"), args, precision="bf16-mixed",
                        progress=False)
    forms = [a for m in plan.modules for a in m.get("attention") or []]
    assert forms and {(a["axis"], a["form"]) for a in forms} == {("cp", "ulysses"), ("tp", "ulysses")}
    assert all(a["alternatives"] and min(x["delta"] for x in a["alternatives"]) > 0 for a in forms)
    assert _all_to_alls_into_attention(plan, "cp+tp") >= 3 * 2
    # the plan file names the combined group "cp+tp"; a group over an axis the mesh lacks is refused
    d = json.loads(plan.to_json())
    assert autopar.Plan.from_dict(d).to_json() == plan.to_json()
    step = next(s for r in d["reshardings"] for s in r["steps"] if s["axis"] == "cp+tp")
    step["axis"] = "cp+sp"
    with pytest.raises(PlanError, match="'cp\\+sp' is not one of the mesh's axes"):
        autopar.Plan.from_dict(d)
