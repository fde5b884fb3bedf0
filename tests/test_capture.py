"""Capture: model + example inputs -> IR Graph of the joint training step (or the forward)."""

from __future__ import annotations

import copy
import dataclasses
import re
import time
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.errors import AutoparError, CaptureError
from autopar.ir.capture import capture, normalize_mean_losses
from autopar.ir.graph import Phase, Ref, Role
from autopar.ir.placement import B, PlacementError, S

try:
    import autopar.models as zoo
except ImportError:  # written by another engineer; skip those cases until it exists
    zoo = None

try:
    import transformers
except ImportError:
    transformers = None

needs_zoo = pytest.mark.skipif(zoo is None, reason="autopar.models is not available")
needs_hf = pytest.mark.skipif(transformers is None, reason="transformers is not installed")

FUSED_ATTN = "autopar.attention.default"


# ---------------------------------------------------------------------------------------------
# Small models


class MLP(nn.Module):
    def __init__(self, d=8, hidden=16, n=2, classes=4, dtype=torch.float32):
        super().__init__()
        dims = [d] + [hidden] * n
        self.layers = nn.ModuleList(nn.Linear(a, b, dtype=dtype) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(hidden, classes, dtype=dtype)

    def forward(self, x, y):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return F.cross_entropy(self.head(x), y)


class Attention(nn.Module):
    def __init__(self, d, heads, dtype):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, dtype=dtype)
        self.proj = nn.Linear(d, d, dtype=dtype)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d, heads, dtype):
        super().__init__()
        self.ln = nn.LayerNorm(d, dtype=dtype)
        self.attn = Attention(d, heads, dtype)
        self.ln2 = nn.LayerNorm(d, dtype=dtype)
        self.fc = nn.Linear(d, 4 * d, dtype=dtype)
        self.out = nn.Linear(4 * d, d, dtype=dtype)

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-like: causal SDPA, tied embedding/head, mean cross-entropy."""

    def __init__(self, vocab=50, d=16, heads=2, n=2, dtype=torch.float32, hint=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, dtype=dtype)
        self.blocks = nn.ModuleList(Block(d, heads, dtype) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False, dtype=dtype)
        self.head.weight = self.emb.weight
        self.hint = hint

    def forward(self, idx, targets):
        x = self.emb(idx)
        if self.hint is not None:
            x = autopar.hint(x, self.hint)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def tokens(b=2, t=8, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


# ---------------------------------------------------------------------------------------------
# Executing the captured graph on real tensors


def run_graph(graph, model, args=(), kwargs=None):
    """Run ``graph.gm`` with the model's real tensors: returns (outputs, loss, grads by FQN)."""
    kwargs = kwargs or {}
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = {k: v.clone() for k, v in model.named_buffers(remove_duplicate=False)}
    fqn_of = {v: k for k, v in {**graph.params, **graph.buffers}.items()}
    key_of = {v: k for k, v in graph.inputs.items()}
    flat = []
    for n in graph.nodes:
        if not n.is_placeholder:
            continue
        role = n.roles[0]
        if role is Role.PARAMETER:
            flat.append(params[fqn_of[n.name]].detach())
        elif role is Role.BUFFER:
            flat.append(buffers[fqn_of[n.name]])
        elif role is Role.INPUT:
            key = key_of[n.name]
            flat.append(args[int(key.split(":")[1])] if key.startswith("input:") else kwargs[key])
        else:
            assert role is Role.TANGENT
            flat.append(torch.ones(n.out.shape, dtype=n.out.dtype))
    with torch.no_grad():
        outs = graph.gm(*flat)
    at = {r: outs[i] for i, r in enumerate(graph.outputs) if r is not None}
    loss = at[graph.loss] if graph.loss is not None else None
    return outs, loss, {fqn: at[r] for fqn, r in graph.grads.items()}


def eager_loss(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[1]
    return out["loss"] if isinstance(out, dict) else out.loss


def assert_matches_eager(graph, model, args=(), kwargs=None, tol=1e-10):
    _, loss, grads = run_graph(graph, model, args, kwargs)
    model.zero_grad(set_to_none=True)
    ref = eager_loss(model(*args, **(kwargs or {})))
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), atol=tol, rtol=tol)
    for fqn, p in model.named_parameters():
        if not p.requires_grad:
            continue
        assert fqn in grads, f"no gradient for {fqn}"
        torch.testing.assert_close(grads[fqn], p.grad, atol=tol, rtol=tol, msg=f"gradient of {fqn}")
    model.zero_grad(set_to_none=True)


def check_complete(graph, model):
    """Every trainable parameter has a gradient of its own shape, output role GRADIENT."""
    for fqn, p in model.named_parameters():
        assert fqn in graph.params, fqn
        if not p.requires_grad:
            continue
        assert fqn in graph.grads, fqn
        r = graph.grads[fqn]
        assert graph.spec(r).shape == tuple(p.shape)
        assert graph.role(r) is Role.GRADIENT
        assert graph.node(graph.params[fqn]).roles == [Role.PARAMETER]


# ---------------------------------------------------------------------------------------------
# (1) joint graph structure


def test_mlp_joint_graph_structure():
    model = MLP()
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    g = capture(model, (x, y))
    assert g.training
    check_complete(g, model)
    assert set(g.inputs) == {"input:0", "input:1"}
    assert g.constants == {}
    assert g.loss is not None and g.role(g.loss) is Role.LOSS and g.spec(g.loss).shape == ()
    assert g.loss in g.outputs
    phases = [n.phase for n in g.ops()]
    assert Phase.FORWARD in phases and Phase.BACKWARD in phases
    # the forward comes first: no forward op after the first backward op
    first_bwd = phases.index(Phase.BACKWARD)
    assert Phase.FORWARD not in phases[first_bwd:]
    for r in g.grads.values():
        assert g.node(r.node).phase is Phase.BACKWARD
    paths = {n.module_path for n in g.ops()}
    assert {"layers.0", "layers.1", "head"} <= paths
    mms = [n for n in g.ops() if n.op in ("aten.addmm.default", "aten.mm.default")]
    assert {n.module_path for n in mms} == {"layers.0", "layers.1", "head"}
    # parameters carry their module's path, inputs the root
    assert g.node(g.params["layers.1.weight"]).module_path == "layers.1"
    assert g.node(g.inputs["input:0"]).module_path == ""
    tangents = [n for n in g.nodes if n.is_placeholder and n.roles[0] is Role.TANGENT]
    assert len(tangents) == 1 and tangents[0].out.shape == ()
    # getitems are folded into Refs: no getitem ops, and every input Ref resolves to a tensor
    assert not any("getitem" in n.op for n in g.nodes)
    for n in g.ops():
        for r in n.inputs:
            assert isinstance(r, Ref) and g.spec(r) is not None


def test_user_names_never_show_internal_node_names():
    """``Graph.user_name``, which every message naming a tensor uses: parameter and buffer FQNs,
    ``input:N`` and keyword names, gradients, the loss, and ``module path: op`` for ops."""
    model = KwModel("tensor")
    model.lin.bias.requires_grad_(False)
    x, labels = torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 4, (4,))
    g = capture(model, (x, 3.0), dict(labels=labels, use_bias=False, mode="b", extra=None))
    assert g.user_name(g.params["lin.weight"]) == "lin.weight"
    assert g.user_name(g.node(g.inputs["input:0"])) == "input:0"
    assert g.user_name(Ref(g.inputs["labels"])) == "labels"
    assert g.user_name(g.grads["lin.weight"]) == "the gradient of lin.weight"
    assert g.user_name(g.loss) == "the loss"
    tangent = next(n for n in g.nodes if n.is_placeholder and n.roles[0] is Role.TANGENT)
    assert g.user_name(tangent) == "the loss's incoming gradient"
    mm = next(n for n in g.ops() if n.op == "aten.mm.default" and n.phase is Phase.FORWARD)
    assert g.user_name(mm) == "<root>: mm" == mm.where()  # x @ lin.weight.t() is written in the root's forward
    mlp = capture(MLP(), (torch.randn(4, 8), torch.randint(0, 4, (4,))))
    addmm = next(n for n in mlp.ops() if n.op == "aten.addmm.default" and n.module_path == "layers.1")
    assert mlp.user_name(addmm) == "layers.1: addmm" and mlp.user_name(mlp.params["head.bias"]) == "head.bias"
    back = next(n for n in mlp.ops() if n.phase is Phase.BACKWARD and n.module_path == "layers.1")
    assert mlp.user_name(back).startswith("layers.1: ") and mlp.user_name(back).endswith(" (backward)")
    for graph in (g, mlp):  # no internal node name (primals_3, mm_7, getitem_2) appears in any of them
        for n in graph.nodes:
            for i in range(len(n.outputs)):
                name = graph.user_name(Ref(n.name, i))
                assert not re.search(r"[a-z]_\d+\b", name), (n.name, name)


def test_mean_loss_is_rewritten_as_sum_over_total_weight():
    model = MLP()
    g = capture(model, (torch.randn(4, 8), torch.randint(0, 4, (4,))))
    nll = [n for n in g.ops() if n.op == "aten.nll_loss_forward.default"]
    assert len(nll) == 1 and nll[0].args[3] == 2  # reduction=sum
    loss = g.node(g.loss.node)
    assert loss.op == "aten.div.Tensor"
    # the sum and the total weight are stacked (one all-reduce when both are partial) and unbound
    parts = g.node(loss.inputs[0].node)
    assert parts.op == "aten.unbind.int" and loss.inputs == [Ref(parts.name, 0), Ref(parts.name, 1)]
    both = g.node(parts.inputs[0].node)
    assert both.op == "aten.stack.default" and both.inputs == [Ref(nll[0].name, 0), Ref(nll[0].name, 1)]
    bwd = [n for n in g.ops() if n.op == "aten.nll_loss_backward.default"]
    assert bwd[0].args[4] == 1 and Ref(parts.name, 1) in bwd[0].inputs  # mean backward, total_weight
    # log_softmax is decomposed into reductions
    assert "aten._log_softmax.default" not in g.op_names()
    assert {"aten.amax.default", "aten.exp.default", "aten.log.default"} <= set(g.op_names())
    assert normalize_mean_losses(g.gm) == 0  # idempotent


# ---------------------------------------------------------------------------------------------
# (2) numerical equivalence with eager, float64


def test_numerics_mlp():
    torch.manual_seed(0)
    model = MLP(dtype=torch.float64)
    args = (torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 4, (4,)))
    assert_matches_eager(capture(model, args), model, args)


def test_numerics_gpt_sdpa_cross_entropy_tied():
    torch.manual_seed(0)
    model = TinyGPT(dtype=torch.float64)
    idx, tgt = tokens()
    g = capture(model, (idx, tgt))
    assert FUSED_ATTN in g.op_names()
    assert FUSED_ATTN.replace(".default", "_backward.default") in g.op_names()
    # tied weights: one placeholder, the alias recorded, the gradient summed over both uses
    assert g.aliases == {"head.weight": "emb.weight"}
    assert "head.weight" not in g.params and len(g.grads) == len(list(model.parameters()))
    assert_matches_eager(g, model, (idx, tgt))


def test_numerics_ignore_index_and_label_smoothing():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 5, dtype=torch.float64)

        def forward(self, x, y):
            logits = self.lin(x)
            return F.cross_entropy(logits, y, ignore_index=-100) + 0.5 * F.cross_entropy(logits, y.clamp(min=0))

    torch.manual_seed(0)
    model = M()
    y = torch.tensor([0, 3, -100, 4, -100, 1])
    args = (torch.randn(6, 8, dtype=torch.float64), y)
    g = capture(model, args)
    assert sum(n.op == "aten.div.Tensor" for n in g.ops()) >= 2
    assert_matches_eager(g, model, args)


@needs_zoo
@pytest.mark.parametrize("family", ["mlp", "gpt", "llama", "cnn", "moe"])
def test_numerics_zoo(family):
    torch.manual_seed(0)
    model, inputs = zoo.make(family, size="tiny", batch=2, dtype=torch.float64)
    g = capture(model, inputs)
    check_complete(g, model)
    if family in ("gpt", "llama"):
        assert FUSED_ATTN in g.op_names()
    if family == "cnn" and any(True for _ in model.buffers()):
        assert g.mutations and set(g.mutations) <= set(g.buffers) | set(g.aliases)
    assert_matches_eager(g, model, inputs, tol=1e-9)


# ---------------------------------------------------------------------------------------------
# (3) meta models: nothing allocated, every gradient present


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class BigMeta(nn.Module):
    """About 1.1B parameters of Linear layers and an embedding (4.4 GB if it were allocated)."""

    def __init__(self, vocab=32000, d=4096, ffn=11008, n=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(up=nn.Linear(d, ffn, bias=False), down=nn.Linear(ffn, d, bias=False),
                               norm=nn.LayerNorm(d)))
            for _ in range(n)
        )
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for b in self.blocks:
            x = x + b["down"](F.silu(b["up"](b["norm"](x))))
        return F.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


def test_meta_model_captures_without_allocating():
    with torch.device("meta"):
        model = BigMeta()
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params > 1e9
    idx, tgt = tokens(b=2, t=16, vocab=32000)
    rss0 = _rss_mib()
    t0 = time.perf_counter()
    g = capture(model, (idx, tgt))
    elapsed = time.perf_counter() - t0
    assert _rss_mib() - rss0 < 1024, "capture of a meta model allocated real memory"
    assert elapsed < 20
    check_complete(g, model)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_meta_inputs_and_meta_attention_stays_fused():
    with torch.device("meta"):
        model = TinyGPT()
    idx, tgt = (t.to("meta") for t in tokens())
    g = capture(model, (idx, tgt))
    check_complete(g, model)
    assert FUSED_ATTN in g.op_names()
    assert g.node(g.inputs["input:0"]).out.shape == (2, 8)


# ---------------------------------------------------------------------------------------------
# (4) the user's model is untouched


def test_user_model_untouched():
    model = TinyGPT()
    model.blocks[0].attn.qkv.weight.requires_grad_(False)  # one frozen parameter
    calls = []
    model.register_forward_hook(lambda m, a, o: calls.append(1))
    model.eval()
    before = {k: (v, v.detach().clone(), v.device, v.requires_grad) for k, v in model.named_parameters()}
    hooks_before = {k: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for k, m in model.named_modules()}
    idx, tgt = tokens()
    g = capture(model, (idx, tgt))
    assert "blocks.0.attn.qkv.weight" in g.params and "blocks.0.attn.qkv.weight" not in g.grads
    assert calls  # the user's hook is part of the model: it ran, on the copy's fake tensors
    assert not model.training
    for k, v in model.named_parameters():
        obj, data, device, rg = before[k]
        assert v is obj and v.device == device and v.requires_grad == rg and v.grad is None
        assert torch.equal(v.detach(), data)
        assert type(v) is nn.Parameter
    assert model.head.weight is model.emb.weight
    assert {k: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for k, m in model.named_modules()} == hooks_before
    assert "forward" not in model.__dict__


# ---------------------------------------------------------------------------------------------
# (5) inputs and outputs of real models


@dataclasses.dataclass
class Out:
    loss: torch.Tensor
    logits: torch.Tensor


class KwModel(nn.Module):
    def __init__(self, kind="tensor"):
        super().__init__()
        self.lin = nn.Linear(8, 4, dtype=torch.float64)
        self.kind = kind

    def forward(self, x, scale: float = 1.0, *, labels=None, use_bias: bool = True, mode: str = "a", extra=None):
        logits = self.lin(x) if use_bias else x @ self.lin.weight.t()
        logits = logits * scale
        if mode == "b":
            logits = logits * 2
        loss = F.cross_entropy(logits, labels)
        if self.kind == "dict":
            return {"logits": logits, "loss": loss}
        if self.kind == "dataclass":
            return Out(loss=loss, logits=logits)
        if self.kind == "tuple":
            return logits, loss
        return loss


@pytest.mark.parametrize("kind", ["tensor", "dict", "dataclass", "tuple"])
def test_keyword_inputs_constants_and_output_kinds(kind):
    torch.manual_seed(0)
    model = KwModel(kind)
    x, labels = torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 4, (4,))
    kwargs = dict(labels=labels, use_bias=False, mode="b", extra=None)
    with pytest.raises(CaptureError, match=r"no gradient for parameter\(s\) lin\.bias"):
        capture(model, (x, 3.0), kwargs)  # the bias is unused when use_bias=False
    model.lin.bias.requires_grad_(False)
    g = capture(model, (x, 3.0), kwargs)
    assert g.inputs == {"input:0": g.inputs["input:0"], "labels": g.inputs["labels"]}
    assert g.constants == {"input:1": 3.0, "use_bias": False, "mode": "b", "extra": None}
    assert g.node(g.inputs["labels"]).out.dtype == torch.int64
    assert "lin.bias" in g.params and "lin.bias" not in g.grads
    assert_matches_eager(g, model, (x, 3.0), kwargs)


def test_nested_tensor_inputs():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, pair, cfg):
            return (self.lin(pair[0]) * pair[1] + cfg["bias"]).sum()

    g = capture(M(), ((torch.randn(2, 4), torch.randn(2, 4), None), {"bias": torch.randn(4)}))
    assert set(g.inputs) == {"input:0[0]", "input:0[1]", "input:1['bias']"}
    assert g.constants == {"input:0[2]": None}


# ---------------------------------------------------------------------------------------------
# (6) Hugging Face models from small configs (nothing downloaded)


def _hf_models():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, attn_pdrop=0.0,
                      resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    llama = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=100, attention_dropout=0.0, bos_token_id=0,
                        eos_token_id=0, pad_token_id=0)
    return {
        "gpt2": lambda: GPT2LMHeadModel(gpt2).to(torch.float64),
        "llama": lambda: LlamaForCausalLM(llama).to(torch.float64),
    }


@needs_hf
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_models(name):
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    model = _hf_models()[name]()
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    kwargs = dict(input_ids=ids, labels=ids)
    g = capture(model, (), kwargs)
    check_complete(g, model)
    assert set(g.inputs) == {"input_ids", "labels"}
    assert FUSED_ATTN in g.op_names()
    assert sum(n.op == FUSED_ATTN for n in g.ops()) == 2
    assert any(p.startswith("model.layers.1.self_attn") or p.startswith("transformer.h.1.attn")
               for p in {n.module_path for n in g.ops()})
    if name == "gpt2":
        assert g.aliases == {"lm_head.weight": "transformer.wte.weight"}
    # HF's loss casts the logits to float32 (``logits.float()``) and our graph decomposes log_softmax,
    # so the loss and the gradients agree to float32 rounding only
    assert_matches_eager(g, model, (), kwargs, tol=1e-6)


# ---------------------------------------------------------------------------------------------
# (7) errors


class Routed(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.gate = nn.Linear(4, 4)
        self.mode = mode

    def forward(self, x):
        y = self.gate(x)
        if self.mode == "nonzero":
            return y[torch.nonzero(y > 0)[:, 0]]
        if self.mode == "mask":
            return y[y > 0]
        if self.mode == "item":
            return y * y.sum().item()
        if self.mode == "raise":
            raise ValueError("unsupported routing")
        return y


class Outer(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.blocks = nn.ModuleList([Routed(""), Routed(mode)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum()


@pytest.mark.parametrize("mode,op", [("nonzero", "nonzero"), ("mask", "nonzero"), ("item", "_local_scalar_dense")])
def test_error_data_dependent(mode, op):
    with pytest.raises(CaptureError, match=rf"module 'blocks\.1' \(Routed\): op aten\.{op}.*static-shape"):
        capture(Outer(mode), (torch.randn(3, 4),))


def test_error_untraceable_names_module():
    with pytest.raises(CaptureError, match=r"capture failed in module 'blocks\.1' \(Routed\): ValueError: unsupported"):
        capture(Outer("raise"), (torch.randn(3, 4),))
    # the failure left fx's annotation state clean: the next capture works and is annotated
    g = capture(Outer(""), (torch.randn(3, 4),))
    assert "blocks.1.gate" in {n.module_path for n in g.ops()}


def test_exception_caught_by_the_model_keeps_module_paths_right():
    class Fragile(nn.Module):
        def forward(self, x):
            raise NotImplementedError("fast path")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fast = Fragile()
            self.slow = nn.Linear(4, 4)

        def forward(self, x):
            try:
                return self.fast(x)
            except NotImplementedError:
                return self.slow(x).sum()

    g = capture(Net(), (torch.randn(2, 4),))
    assert {n.module_path for n in g.ops() if n.op == "aten.addmm.default"} == {"slow"}
    assert "fast" not in {n.module_path for n in g.ops()}


def test_error_plain_tensor_attribute_on_meta():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = torch.ones(4)

        def forward(self, x):
            return (self.lin(x) * self.scale).sum()

    assert capture(M(), (torch.randn(2, 4),)).grads  # a real CPU attribute is a constant of the graph
    with torch.device("meta"):
        model = M()
    with pytest.raises(CaptureError, match=r"tensor attribute\(s\) scale \(meta\).*register_buffer"):
        capture(model, (torch.randn(2, 4),))


def test_error_missing_gradient():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x).sum()

    with pytest.raises(CaptureError, match=r"no gradient for parameter\(s\) unused\.weight, unused\.bias"):
        capture(Unused(), (torch.randn(2, 4),))


def test_error_no_parameters_and_nothing_trainable():
    class NoParams(nn.Module):
        def forward(self, x):
            return x.sum()

    with pytest.raises(CaptureError, match="NoParams has no parameters"):
        capture(NoParams(), (torch.randn(2),))
    frozen = MLP().requires_grad_(False)
    with pytest.raises(CaptureError, match="no parameter of MLP requires grad"):
        capture(frozen, (torch.randn(2, 8), torch.tensor([0, 1])))
    assert not capture(frozen, (torch.randn(2, 8), torch.tensor([0, 1])), training=False).grads


def test_error_unsupported_inputs():
    import numpy as np

    model = MLP()
    with pytest.raises(CaptureError, match=r"'input:1' is a list holding a str"):
        capture(model, (torch.randn(2, 8), ["a", "b"]))
    with pytest.raises(CaptureError, match=r"'input:0' has type numpy\.ndarray.*torch\.from_numpy"):
        capture(model, (np.zeros((2, 8)), torch.tensor([0, 1])))
    with pytest.raises(CaptureError, match=r"'y' has type builtins\.object.*supported inputs are tensors"):
        capture(model, (torch.randn(2, 8),), {"y": object()})


def test_error_no_loss():
    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return {"logits": self.lin(x), "aux": self.lin(x).mean(-1)}

    with pytest.raises(CaptureError, match=r"needs a loss, but the model returned a dict with keys \['logits', 'aux'\]"):
        capture(NoLoss(), (torch.randn(2, 4),))
    assert issubclass(CaptureError, AutoparError)


def test_warning_attention_dropout():
    """SDPA with dropout stays one fused op (its dropout_p kept: ``ir.rules.random_attention``);
    attention written as softmax + dropout by hand is named, with the fused alternative."""

    class DropAttn(nn.Module):
        def __init__(self, by_hand):
            super().__init__()
            self.qkv = nn.Linear(8, 8)
            self.by_hand = by_hand

        def forward(self, x):
            q = self.qkv(x).view(2, 4, 2, 4).transpose(1, 2)
            if self.by_hand:
                w = F.dropout(torch.softmax(q @ q.transpose(-1, -2) * 0.5, -1), 0.1, training=True)
                return (w @ q).sum()
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1).sum()

    class Net(nn.Module):
        def __init__(self, by_hand=False):
            super().__init__()
            self.attn = DropAttn(by_hand)

        def forward(self, x):
            return self.attn(x)

    with pytest.warns(UserWarning, match=r"attention in module\(s\) 'attn' computes softmax \+ dropout unfused.*"
                      r"scaled_dot_product_attention") as rec:
        g = capture(Net(by_hand=True), (torch.randn(2, 4, 8),))
    assert len([w for w in rec if "dropout" in str(w.message)]) == 1
    assert FUSED_ATTN not in g.op_names()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = capture(Net(), (torch.randn(2, 4, 8),))  # fused, with its dropout: no warning
        capture(TinyGPT(), tokens())  # no dropout: no warning
    assert [n.args[3] for n in g.ops() if n.op == FUSED_ATTN] == [0.1]


# ---------------------------------------------------------------------------------------------
# (8) inference


def test_inference_capture_is_forward_only():
    torch.manual_seed(0)
    model = TinyGPT(dtype=torch.float64)
    idx, tgt = tokens()
    g = capture(model, (idx, tgt), training=False)
    assert not g.training and g.loss is None and g.grads == {}
    assert all(n.phase is Phase.FORWARD for n in g.nodes)
    assert not any(n.roles[0] is Role.TANGENT for n in g.nodes if n.is_placeholder)
    assert not any("backward" in n.op for n in g.ops())
    assert FUSED_ATTN in g.op_names()
    outs, _, _ = run_graph(g, model, (idx, tgt))
    torch.testing.assert_close(outs[0], model(idx, tgt).detach())

    class Multi(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            y = self.lin(x)
            return {"y": y, "n": 3, "pair": (y.sum(), y.relu())}

    g = capture(Multi(), (torch.randn(2, 4),), training=False)
    assert [g.spec(r).shape for r in g.outputs] == [(2, 3), (), (2, 3)]


# ---------------------------------------------------------------------------------------------
# (9) hints


def test_hint_is_captured():
    model = TinyGPT(hint="dp=S(0)")
    g = capture(model, tokens())
    assert len(g.hints) == 1
    h = g.hints[0]
    assert h.placements == "dp=S(0)" and h.module_path == ""
    node = g.node(h.ref.node)
    assert node.op == "autopar.hint.default" and node.args[1] == "dp=S(0)"
    assert g.node(node.inputs[0].node).op == "aten.embedding.default"
    assert node.phase is Phase.FORWARD
    check_complete(g, model)


def test_hint_eager_identity_and_normalisation():
    x = torch.randn(3, 4, requires_grad=True)
    y = autopar.hint(x, "S(0),B")
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    (y * torch.arange(4.0)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(4.0).expand(3, 4))
    from autopar.ir.hint import canonical_placements

    assert canonical_placements("S(0),B") == "S(0), B"
    assert canonical_placements(" dp = S(0) ,tp=P(max)") == "dp=S(0), tp=P(max)"
    assert canonical_placements([S(1), B]) == "S(1), B"
    from torch.distributed.tensor import Replicate, Shard

    assert canonical_placements((Shard(0), Replicate())) == "S(0), B"
    for bad in ["S(x)", "", "dp=Q", "S(0), dp=B", "dp=B, dp=S(0)"]:
        with pytest.raises(PlacementError):
            autopar.hint(x, bad)
    with pytest.raises(PlacementError):
        capture(TinyGPT(hint="S(0"), tokens())


# ---------------------------------------------------------------------------------------------
# (10) determinism


def test_determinism():
    model = TinyGPT()
    a = capture(model, tokens())
    b = capture(copy.deepcopy(model), tokens(seed=1))
    assert [(n.name, n.op, n.module_path, n.phase, tuple(n.inputs)) for n in a.nodes] == [
        (n.name, n.op, n.module_path, n.phase, tuple(n.inputs)) for n in b.nodes
    ]
    assert a.outputs == b.outputs and a.grads == b.grads and a.params == b.params


def test_summary_and_ops_are_printable():
    g = capture(MLP(), (torch.randn(2, 8), torch.tensor([0, 1])))
    text = g.summary()
    assert "aten.addmm.default" in text and "[layers.0]" in text
    assert g.gm.code  # the rewritten GraphModule recompiles
