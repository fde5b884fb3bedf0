"""All-to-all (Ulysses) attention: sequence-split activations become head-split for the attention
and back, forced per mesh axis by ``attention=`` (``ir/attention_forms.py``), priced as all-to-alls
(``cost_model/comm.py``), with grouped-query attention whose kv heads are fewer than the axis
(``ir/rules/shared_kv.py``), named by ``plan.explain``. Parity: the simulator's loss and every
gradient against the single-device model, for autopar's GPT and LLaMA, Hugging Face's
LlamaForCausalLM and a native grouped-query model (``enable_gqa``), causal and not."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.cost_model.comm import reshard_steps
from autopar.errors import ArgumentError, HintError
from autopar.ir.attention import ATTN_BWD, ATTN_FWD
from autopar.ir.placement import Split
from autopar.models import make

from _parity import simulated_errors

TOL = 1e-5  # float64 throughout: only reassociation differs


class GroupedAttention(nn.Module):
    """One attention layer calling SDPA with ``enable_gqa``: 8 query heads share 2 kv heads, so a
    head split over 4 devices cannot split the kv heads with them."""

    def __init__(self, causal: bool, vocab: int = 64, dim: int = 64, heads: int = 8, kv_heads: int = 2):
        super().__init__()
        self.causal, self.heads, self.kv_heads, self.hd = causal, heads, kv_heads, dim // heads
        self.embed = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd)
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2 * self.kv_heads, self.hd).transpose(1, 2).chunk(2, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)
        y = y.transpose(1, 2).reshape(b, s, -1) + x
        return F.cross_entropy(self.out(y).flatten(0, 1), target.flatten())


def _seq_hints(axes: dict, names: list[str], seq_axes: tuple[str, ...]) -> dict:
    """Inputs ``[batch, seq]`` split on the sequence over ``seq_axes`` and on the batch elsewhere."""
    text = ", ".join(f"{a}={'S(1)' if a in seq_axes else 'S(0)'}" for a in axes)
    return {n: text for n in names}


def _attention_reads(plan) -> list[tuple[str, list]]:
    """(op, per-axis strategy tag) of every attention op, forward and backward."""
    return [(n["op"], n["tags"]) for n in plan.nodes if n["op"] in (ATTN_FWD, ATTN_BWD)]


def _all_to_alls_into_attention(plan, axis=None) -> int:
    """All-to-alls (over ``axis``, any when None) of the reshardings into the attention ops."""
    names = {n["name"] for n in plan.nodes if n["op"] == ATTN_FWD}
    return sum(1 for r in plan.reshardings if r["consumer"] in names
               for s in r["steps"] if s["kind"] == "all_to_all" and axis in (None, s["axis"]))


def _check(model, args, kwargs, plan):
    loss, grads = autopar.simulate(model, plan, args, kwargs)
    out = model(*args, **kwargs)
    ref = out if isinstance(out, torch.Tensor) else out.loss
    ref.backward()
    loss = loss if isinstance(loss, torch.Tensor) else loss.loss
    assert abs(loss.item() - ref.item()) <= TOL * max(1.0, abs(ref.item()))
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        err = (grads[name] - p.grad).norm().item() / max(p.grad.norm().item(), 1e-12)
        assert err <= TOL, (name, err)


@functools.lru_cache(maxsize=None)
def _forced(family: str, axes: tuple, seq_axes: tuple):
    """``(model, args, plan)``: ``family`` in float64 with its inputs split on the sequence over
    ``seq_axes`` (the batch elsewhere) and its attention forced to Ulysses there; cached."""
    torch.manual_seed(0)
    model, args = make(family, "tiny", batch=2, seq=32)
    model = model.double()
    axes = dict(axes)
    hints = _seq_hints(axes, ["input:0", "input:1"], seq_axes)
    plan = autopar.plan(model, autopar.Mesh(axes, device="cpu"), args, hints=hints, precision="fp64",
                        attention={a: "ulysses" for a in seq_axes}, deterministic_time=0.5, progress=False)
    return model, args, plan


MESHES = [({"sp": 4}, ("sp",)), ({"dp": 2, "sp": 2}, ("sp",)), ({"a": 2, "b": 2}, ("a", "b"))]
CASES = [("gpt", *MESHES[0]), ("gpt", *MESHES[2]), ("llama", *MESHES[0]), ("llama", *MESHES[1]),
         ("llama", *MESHES[2])]


@pytest.mark.parametrize("family,axes,seq_axes", CASES,
                         ids=["gpt-4", "gpt-2x2", "llama-4", "llama-dp2xsp2", "llama-2x2"])
def test_ulysses_forced_matches_one_device(family, axes, seq_axes):
    model, args, plan = _forced(family, tuple(axes.items()), seq_axes)
    for _, tags in _attention_reads(plan):  # every attention op splits its heads on the sequence axes
        assert all(tags[list(axes).index(a)] == "S:h" for a in seq_axes), tags
    # q, k and v arrive by one all-to-all each: over the axis, or over both axes' combined group
    # (sequence split on both -> heads split on both: ``cost_model.comm.joint_step``)
    assert _all_to_alls_into_attention(plan, "+".join(seq_axes)) >= 3
    _check(model, args, {}, plan)


@pytest.mark.parametrize("axes,seq_axes", MESHES[:2], ids=["4", "dp2xsp2"])
def test_ulysses_on_hugging_face_llama(axes, seq_axes):
    pytest.importorskip("transformers")
    from _corpus import build

    model, args, kwargs = build("hf_llama", dtype=torch.float64)
    model.config.use_cache = False  # training: no key/value cache (its concatenation pins the sequence)
    hints = _seq_hints(axes, ["input_ids", "labels"], seq_axes)
    plan = autopar.plan(model, autopar.Mesh(axes, device="cpu"), args, kwargs, hints=hints, precision="fp64",
                        attention={"sp": "ulysses"}, deterministic_time=0.5, progress=False)
    assert _all_to_alls_into_attention(plan) >= 3
    _check(model, args, kwargs, plan)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("axes,seq_axes", MESHES[:2], ids=["4", "dp2xsp2"])
def test_grouped_query_heads_fewer_than_the_axis(causal, axes, seq_axes):
    torch.manual_seed(0)
    model = GroupedAttention(causal).double()
    ids = torch.randint(0, 64, (2, 16))
    args = (ids, torch.roll(ids, -1, 1))
    hints = _seq_hints(axes, ["input:0", "input:1"], seq_axes)
    plan = autopar.plan(model, autopar.Mesh(axes, device="cpu"), args, hints=hints, precision="fp64",
                        attention={"sp": "ulysses"}, deterministic_time=0.5, progress=False)
    sp = list(axes).index("sp")
    # 2 kv heads cannot split over the sequence axis's devices with the 8 query heads: the query
    # heads split alone, k and v whole (all-gathered from the sequence split), their gradients partial
    assert all(tags[sp] == "kv-shared" for _, tags in _attention_reads(plan)) or axes["sp"] == 2
    _check(model, args, {}, plan)


@pytest.mark.parametrize("causal", [True, False])
def test_every_grouped_query_strategy_on_two_axes_holds(causal):
    """Every composed strategy of a grouped-query attention (4 query heads, 2 kv heads) on (2, 2),
    kv-shared ones among them, reassembles to the op on whole tensors: no composition leaves a query
    head's kv head on another device."""
    from autopar.ir.rules import strategies
    from autopar.ir.rules.proof.interp import check_strategy
    from autopar.ir.rules.shared_kv import TAG

    from test_ring_attention import _calls

    kv_shared = 0
    for call, ins in _calls(causal, 2):
        for st in strategies(call, (2, 2)):
            res = check_strategy(call, st, (2, 2), ins)
            assert res.ok, f"{call.op} {[s.tag for s in st]}: {res.error}"
            kv_shared += any(s.tag == TAG for s in st)
    assert kv_shared


def test_all_to_all_moves_what_each_rank_sends():
    """S(seq) -> S(heads) is one all-to-all whose time is each rank sending (n-1)/n of its shard."""
    mesh = autopar.Mesh({"sp": 4}, device="h100")
    shape, n, eb = (1, 32, 4096, 128), 4, 2
    steps = reshard_steps(shape, (Split(2),), (Split(1),), mesh, eb)
    assert [s.kind for s in steps] == ["all_to_all"]
    link = mesh.links[0]
    shard = shape[0] * shape[1] * shape[2] * shape[3] * eb / n
    sent = (n - 1) / n * shard
    assert steps[0].time == pytest.approx(n * link.latency + sent / link.bandwidth)


def test_explain_names_the_form_and_prices_the_others():
    _, _, plan = _forced("gpt", (("sp", 4),), ("sp",))
    text = plan.explain("blocks.0.attn")
    line = next(x for x in text.splitlines() if x.startswith("attention "))
    assert " on sp: ulysses (all-to-all" in line and "gather +" in line
    # the forms are in the plan file: a loaded plan explains them alike
    loaded = autopar.Plan.from_dict(json.loads(plan.to_json())).explain("blocks.0.attn")
    assert [x for x in loaded.splitlines() if x.startswith("attention ")] == [line]
    # a version 8 file (before the forms were recorded) loads without them and explains the rest
    d = json.loads(plan.to_json())
    d["schema_version"] = 8
    for m in d["modules"]:
        m.pop("attention", None)
    old = autopar.Plan.from_dict(d).explain("blocks.0.attn")
    assert not any(x.startswith("attention ") for x in old.splitlines()) and "blocks.0.attn" in old
    model, args = make("gpt", "tiny", batch=2, seq=32, n_layer=1)
    forced = autopar.plan(model, autopar.Mesh({"sp": 4}, device="cpu"), args, hints={"input:0": "S(1)"},
                          attention={"blocks.*.attn": {"sp": "gather"}}, deterministic_time=0.5, progress=False)
    line = next(x for x in forced.explain("blocks.0.attn").splitlines() if x.startswith("attention "))
    # the other forms priced with q, k and v arriving as they do under this plan
    assert " on sp: gather (" in line and ("heads +" in line or "ulysses +" in line)


@pytest.mark.parametrize("form", ["ring", "ring:balanced"])
def test_ring_forms_are_forced_by_the_keyword(form):
    """Ring attention's strategies (``ir/rules/ring.py``) are forms of the same table: forced by
    ``attention=``, named by explain, and the forced plan matches one device."""
    torch.manual_seed(0)
    model, args = make("llama", "tiny", batch=2, seq=32)
    model = model.double()
    plan = autopar.plan(model, autopar.Mesh({"sp": 4}, device="cpu"), args,
                        hints=_seq_hints({"sp": 4}, ["input:0", "input:1"], ("sp",)), precision="fp64",
                        attention={"sp": form}, deterministic_time=0.5, progress=False)
    assert {tags[0] for _, tags in _attention_reads(plan)} == {form}
    line = next(x for x in plan.explain("layers.0.attention").splitlines() if x.startswith("attention "))
    assert f" on sp: {form} (" in line, line
    _check(model, args, {}, plan)


def test_bad_attention_forms_are_refused():
    model, args = make("gpt", "tiny", batch=2, seq=32)
    mesh = autopar.Mesh({"sp": 4}, device="cpu")
    with pytest.raises(ArgumentError, match="form 'rings' for axis 'sp' is unknown"):
        autopar.plan(model, mesh, args, attention={"sp": "rings"}, progress=False)
    with pytest.raises(ArgumentError, match="'tp' is not an axis of the mesh"):
        autopar.plan(model, mesh, args, attention={"tp": "ulysses"}, progress=False)
    with pytest.raises(HintError, match="no strategy in that form"):  # 4 heads over 8 devices
        autopar.plan(model, autopar.Mesh({"sp": 8}, device="cpu"), args, attention={"sp": "ulysses"},
                     progress=False)


def test_factorization_considers_a_sequence_axis():
    """One long sequence on 8 devices: dp cannot take them (a batch of 1), so cp does; a 4k-token
    batch that fills dp gets no cp shapes (the factorization unchanged)."""
    from autopar.planner.factorize import shape_candidates

    long = shape_candidates(8, 8, batch=1, n_layers=32, seq=131072)
    assert {"pp": 1, "dp": 1, "cp": 2, "tp": 4} in long and {"pp": 1, "dp": 1, "tp": 8} in long
    assert {"pp": 1, "dp": 1, "cp": 8, "tp": 1} not in long  # the tp8 mesh renamed
    assert all(s.get("dp", 1) <= 1 for s in long)
    # across nodes a batch of one has no shape without cp (tp stays in a node)
    nodes = shape_candidates(16, 8, batch=1, n_layers=32, seq=262144)
    assert nodes and all("cp" in s for s in nodes) and {"pp": 1, "dp": 1, "cp": 2, "tp": 8} in nodes
    assert shape_candidates(8, 8, batch=8, n_layers=32, seq=4096) == shape_candidates(8, 8, batch=8, n_layers=32)
    assert any("cp" in s for s in shape_candidates(8, 8, batch=8, n_layers=32, seq=32768))


def test_mesh_devices_plans_a_sequence_axis_for_one_sequence():
    torch.manual_seed(0)
    model, args = make("gpt", "tiny", batch=1, seq=32, n_layer=2)
    plan = autopar.plan(model, autopar.Mesh.devices(2, device="cpu", node_size=1), args, progress=False,
                        deterministic_time=0.5)
    # a batch of one cannot use dp=2: the only shape is the sequence axis, and it is planned
    assert [r["shape"] for r in plan.mesh_search["compared"]] == [{"pp": 1, "dp": 1, "cp": 2, "tp": 1}]
    assert plan.fits and tuple(plan.axis_names) == ("cp",)


def test_searched_plan_on_a_sequence_split_mesh():
    """Unforced, the search picks each attention op's form by price (on this tiny model the keys
    and values are cheap to gather whole) and the plan still matches one device."""
    torch.manual_seed(0)
    model, args = make("gpt", "tiny", batch=1, seq=1024, block_size=1024)
    model = model.double()
    plan = autopar.plan(model, autopar.Mesh({"sp": 4}, device="h100"), args, precision="fp64",
                        hints={"input:0": "S(1)", "input:1": "S(1)"}, deterministic_time=0.5, progress=False)
    forms = [a for m in plan.modules for a in m.get("attention") or []]
    assert forms and all(a["axis"] == "sp" and a["form"] in ("gather", "ulysses", "heads") for a in forms)
    assert all(a["alternatives"] for a in forms)  # each priced against another form
    _check(model, args, {}, plan)
