"""In-place ops on intermediates (``h += x``, ``x.mul_(s)``, ``F.relu(x, inplace=True)``) are made
functional on the one-pass joint trace (``_torch_compat/inplace.py``); only mutations that need
AOTAutograd's functionalization (inputs, parameters, buffers, memory an earlier view still reads)
fall back to its export. Either way the graph computes what the eager model computes."""

from __future__ import annotations

import importlib.util
import pathlib
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar import _torch_compat as tc
from autopar.ir.capture import capture
from autopar.ir.graph import Phase
from test_capture import assert_matches_eager, run_graph, tokens

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "capture.py"


def _bench():
    """``benchmarks/capture.py``, where the user-style decoder the benchmark times is defined."""
    spec = importlib.util.spec_from_file_location("_capture_bench", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def user_decoder(act="silu", batch=2, seq=16, dtype=torch.float64):
    torch.manual_seed(0)
    model = _bench().UserDecoder(act=act).to(dtype)
    return model, tokens(batch, seq, vocab=256)


def _path(model, args):
    """(graph, "fast" or "aot"): which joint trace captured ``model``."""
    before = dict(tc.JOINT_PATHS)
    g = capture(model, args)
    return g, "fast" if tc.JOINT_PATHS["fast"] > before["fast"] else "aot"


def _aot(model, args):
    saved = tc.FAST_JOINT
    tc.FAST_JOINT = False
    try:
        return capture(model, args)
    finally:
        tc.FAST_JOINT = saved


def _mutating(g) -> list[str]:
    return sorted({n.op for n in g.ops() if n.op.count(".") >= 2 and n.op.split(".")[1].endswith("_")})


class _Ops(nn.Module):
    """One in-place op of each common kind on intermediates, some through dead-base views."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 16)

    def forward(self, x):
        h = self.a(x)
        g = self.b(h)
        u = self.c(h).view(4, 2, 8)               # a view of the linear's output, whose base is dead
        u.mul_(2.0).add_(1.0)                     # mul_, add_ on the view (autograd writes back: CopySlices)
        u = u.view(4, 16)[:, :8]
        g += u                                    # add_.Tensor
        g.masked_fill_(x > 1.5, 0.0)              # masked_fill_
        g = F.relu(g, inplace=True)               # relu_
        z = torch.zeros(4, 8, dtype=x.dtype)
        z.copy_(g).clamp_(max=3.0)                # copy_ into a fresh tensor, clamp_
        return (z * h).sum()


class _Bf16Residual(nn.Module):
    """``h += attn(norm(h))`` in bf16, where the norm upcasts (a copy), so eager autograd allows it;
    the fp32 add is rounded back to bf16 in place."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16, dtype=torch.bfloat16)
        self.f = nn.ModuleList(nn.Linear(16, 16, dtype=torch.bfloat16) for _ in range(2))
        self.w = nn.Parameter(torch.ones(16))  # fp32 gain: norm(h) is fp32

    def forward(self, tokens, targets):
        h = self.emb(tokens)
        for f in self.f:
            x = h.float()
            n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.w
            h += f(n.to(torch.bfloat16)).float()  # bf16 += fp32: stays bf16
        return F.cross_entropy(h.float().view(-1, 16), targets.view(-1) % 16)


class _ReadsOldView(nn.Module):
    """A view taken before a mutation and read after it: eager reads the new values through it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        v = h.view(2, 16)
        h.mul_(3.0)
        return (v.sum(0) ** 2).sum() + h.sum()


class _SliceWrite(nn.Module):
    """Writes through a slice and a select of tensors read whole afterwards: ``slice_scatter`` and
    ``select_scatter`` of the new values (autograd's write-back in the backward is one too)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h[:, :4].mul_(2.0)
        shifted = torch.zeros_like(x)  # Hugging Face's T5 shifts its labels right this way
        shifted[:, 1:] = x[:, :-1]
        shifted[:, 0] = 1.0
        return (h * h * shifted).sum()


class _TransposeWrite(nn.Module):
    """A write through a transpose of a tensor read whole afterwards: left to AOTAutograd."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h.t()[:4].mul_(2.0)
        return (h * h).sum()


class _BufferUpdate(nn.Module):
    """A genuine mutation of a buffer (a running sum): AOTAutograd's export returns it as an output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x):
        h = self.a(x)
        self.seen.add_(h.detach().sum(0))
        return h.sum()


@pytest.mark.parametrize("act", ["silu", "relu"])
def test_user_decoder_takes_the_one_pass_trace(act):
    model, args = user_decoder(act)
    g, path = _path(model, args)
    assert path == "fast"
    assert not _mutating(g), _mutating(g)
    assert_matches_eager(g, model, args, tol=1e-10)
    # the op mix of AOTAutograd's functionalized export, less the views it replays on mutated bases
    ours, theirs = Counter(n.op for n in g.ops()), Counter(n.op for n in _aot(model, args).ops())
    assert ours - theirs == Counter()
    assert set(theirs - ours) <= {"aten._unsafe_view.default"}, theirs - ours


def test_each_kind_of_in_place_op_is_made_functional():
    torch.manual_seed(0)
    model, x = _Ops().double(), (torch.randn(4, 8, dtype=torch.float64) * 2,)
    g, path = _path(model, x)
    assert path == "fast"
    ops = set(g.op_names())
    assert {"aten.relu.default", "aten.masked_fill.Scalar", "aten.clamp.default", "aten.copy.default",
            "aten.mul.Tensor", "aten.add.Tensor"} <= ops, ops
    assert not _mutating(g), _mutating(g)
    assert_matches_eager(g, model, x, tol=1e-12)


def test_in_place_add_keeps_the_mutated_dtype():
    torch.manual_seed(0)
    model, args = _Bf16Residual(), tokens(2, 8)
    g, path = _path(model, args)
    assert path == "fast"
    casts = [n for n in g.ops() if n.op == "aten._to_copy.default" and n.kwargs.get("dtype") == torch.bfloat16
             and n.phase is Phase.FORWARD and any(g.node(r.node).op == "aten.add.Tensor" for r in n.inputs)]
    assert len(casts) == 2, "each bf16 += fp32 is an fp32 add rounded to bf16"
    _, loss, grads = run_graph(g, model, args)
    _, aloss, agrads = run_graph(_aot(model, args), model, args)
    torch.testing.assert_close(loss, aloss, atol=0, rtol=0)
    for k in agrads:
        torch.testing.assert_close(grads[k], agrads[k], atol=0, rtol=0, msg=k)
    assert_matches_eager(g, model, args, tol=1e-2)  # bf16 rounding against eager's own kernels


def test_writes_through_slices_become_scatters():
    torch.manual_seed(0)
    model, x = _SliceWrite().double(), (torch.randn(4, 8, dtype=torch.float64),)
    g, path = _path(model, x)
    assert path == "fast"
    assert {"aten.slice_scatter.default", "aten.select_scatter.default"} <= set(g.op_names())
    assert not _mutating(g), _mutating(g)
    assert_matches_eager(g, model, x, tol=1e-12)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_hugging_face_t5_takes_the_one_pass_trace():
    """T5 shifts its labels right by writing into slices of a fresh tensor (``_shift_right``)."""
    import transformers
    from transformers import T5Config, T5ForConditionalGeneration

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
                                                vocab_size=100, dropout_rate=0.0, decoder_start_token_id=0))
    model = model.double()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    kwargs = dict(input_ids=ids, labels=ids)
    before = dict(tc.JOINT_PATHS)
    g = capture(model, (), kwargs)
    assert tc.JOINT_PATHS["fast"] == before["fast"] + 1
    assert "aten.slice_scatter.default" in g.op_names()
    assert_matches_eager(g, model, (), kwargs, tol=1e-6)  # T5's loss is computed in float32


@pytest.mark.parametrize("cls", [_ReadsOldView, _TransposeWrite, _BufferUpdate])
def test_mutations_functionalization_must_see_fall_back(cls):
    torch.manual_seed(0)
    model, x = cls().double(), (torch.randn(4, 8, dtype=torch.float64),)
    seen = dict(model.named_buffers())
    g, path = _path(model, x)
    assert path == "aot"
    if seen:
        assert g.mutations, "the buffer update is an output of the graph"
    else:
        assert_matches_eager(g, model, x, tol=1e-12)


@pytest.mark.parametrize("how", ["search", "fsdp_tp"])
def test_user_decoder_simulates_on_a_2x2_mesh(how):
    """The searched plan, and torchtitan's layout (every weight split on both axes), compute what the
    model computes."""
    model, args = user_decoder(batch=8)
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="cpu")
    if how == "search":
        plan = autopar.plan(model, mesh, args, precision="fp64", deterministic_time=0.5, progress=False)
    else:
        plan = autopar.recipes.fsdp_tp(model, mesh, args, precision="fp64", progress=False)
        split = [k for k, v in plan.placements.items() if k.startswith("layers.") and v.count("S(") == 2]
        assert len(split) == 2 * 7, plan.placements  # the seven linears of each layer
    loss, grads = autopar.simulate(model, plan, args)
    ref = model(*args)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), atol=1e-10, rtol=1e-10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-10, rtol=1e-10, msg=name)
