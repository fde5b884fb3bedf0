"""The test model zoo: training steps, meta construction and sizes, dtypes, and MoE routing numerics."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from autopar import models
from autopar.models import make, num_params
from autopar.models.moe import MoEConfig, MoELayer, capacity

FAMILIES = sorted(models.MODELS)


def _train_step(model, inputs):
    loss = model(*inputs)
    loss.backward()
    return loss


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_train_step_gives_every_parameter_a_grad(family):
    torch.manual_seed(0)
    model, inputs = make(family, batch=3)
    loss = _train_step(model, inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("family", FAMILIES)
def test_init_is_deterministic_under_manual_seed(family):
    states = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        states.append(make(family)[0].state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert any(not torch.equal(states[0][k], states[2][k]) for k in states[0])
    inputs_a, inputs_b = make(family)[1], make(family)[1]
    assert all(torch.equal(a, b) for a, b in zip(inputs_a, inputs_b))


@pytest.mark.parametrize("family", FAMILIES)
def test_float64(family):
    torch.manual_seed(0)
    model64, inputs = make(family, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model64.parameters())
    loss = _train_step(model64, inputs)
    assert loss.dtype == torch.float64 and torch.isfinite(loss)
    assert all(p.grad.dtype == torch.float64 for p in model64.parameters())
    # The same weights in float32 give (nearly) the same loss.
    model32, inputs32 = make(family)
    model32.load_state_dict({k: v.float() for k, v in model64.state_dict().items()
                             if v.is_floating_point()}, strict=False)
    inputs32 = tuple(t.float() if t.is_floating_point() else t for t in inputs)
    assert model32(*inputs32).item() == pytest.approx(loss.item(), rel=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_preset_builds_on_meta_with_cpu_inputs(family):
    for size in models.PRESETS[family]:
        model, inputs = make(family, size=size, device="meta")
        assert all(t.is_meta for t in [*model.parameters(), *model.buffers()]), size
        assert all(t.device.type == "cpu" for t in inputs), size
    _, inputs = make(family, device="meta", input_device="meta")
    assert all(t.is_meta for t in inputs)


def _gpt_formula(L, d, V, block):
    return L * (12 * d * d + 13 * d) + V * d + block * d + 2 * d


@pytest.mark.parametrize("size, nominal", [
    ("125M", 125e6), ("350M", 350e6), ("1.3B", 1.3e9), ("2.7B", 2.7e9), ("6.7B", 6.7e9),
    ("13B", 13e9), ("30B", 30e9),
])
def test_gpt_preset_sizes(size, nominal):
    model, _ = make("gpt", size=size, device="meta")
    cfg = model.cfg
    n = num_params(model)
    assert n == _gpt_formula(cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.block_size)
    assert abs(n - nominal) / nominal < 0.03


@pytest.mark.parametrize("size, expected", [
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496),  # Meta's published counts
])
def test_llama_preset_sizes(size, expected):
    n = num_params(make("llama", size=size, device="meta")[0])
    assert abs(n - expected) / expected < 0.01
    assert n == expected


def test_resnet18_matches_torchvision_size():
    assert num_params(make("cnn", size="resnet18", device="meta")[0]) == 11_689_512


def test_unknown_names_and_overrides():
    with pytest.raises(KeyError):
        make("nope")
    with pytest.raises(KeyError):
        make("gpt", size="nope")
    model, (idx, _) = make("gpt", batch=5, seq=7, n_layer=3)
    assert len(model.blocks) == 3 and idx.shape == (5, 7)


def test_gpt_head_stays_tied_through_to_empty():
    model, _ = make("gpt", device="meta")
    assert model.lm_head.weight is model.wte.weight
    model = model.to_empty(device="cpu")
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_decoders_are_causal(family):
    torch.manual_seed(0)
    model, (idx, _) = make(family, seq=12)
    changed = idx.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 100
    with torch.no_grad():
        a, b = model.logits(idx), model.logits(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_llama_rope_is_relative_and_rebuilt_by_init_weights():
    from autopar.models.llama import apply_rope, rope_tables

    cfg = models.LlamaConfig(dtype=torch.float64)
    cos, sin = rope_tables(cfg)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 16, dtype=torch.float64, generator=g)
    rot = lambda x, m: apply_rope(x, cos[m:m + 1], sin[m:m + 1])  # noqa: E731
    # <rope(q, m), rope(k, n)> depends only on m - n, and rotations keep norms.
    dot = lambda m, n: (rot(q, m) * rot(k, n)).sum()  # noqa: E731
    torch.testing.assert_close(dot(5, 2), dot(13, 10))
    assert not torch.allclose(dot(5, 2), dot(5, 3))
    torch.testing.assert_close(rot(q, 7).norm(), q.norm())
    model, _ = make("llama", device="meta")
    model = model.to_empty(device="cpu")
    model.init_weights()
    torch.testing.assert_close(model.rope_cos, rope_tables(model.cfg)[0], rtol=0, atol=0)


def _moe_layer(**kw):
    torch.manual_seed(0)
    cfg = MoEConfig(dim=6, ffn_dim=5, n_experts=4, top_k=2, dtype=torch.float64, **kw)
    return MoELayer(cfg), torch.randn(2, 5, 6, dtype=torch.float64)


def _moe_reference(layer, x, C):
    """Per-token loop: top-k experts, slots handed out first-come in (rank, token) order."""
    cfg = layer.cfg
    x = x.reshape(-1, cfg.dim)
    probs = F.softmax(x @ layer.router.weight.T, dim=-1)
    load = [0] * cfg.n_experts
    out = torch.zeros_like(x)
    order = [sorted(range(cfg.n_experts), key=lambda e: -probs[t, e].item()) for t in range(len(x))]
    for rank in range(cfg.top_k):
        for t in range(len(x)):
            e = order[t][rank]
            top = probs[t, order[t][:cfg.top_k]]
            gate = probs[t, e] / top.sum() if cfg.normalize_gates else probs[t, e]
            if load[e] < C:
                load[e] += 1
                out[t] += gate * (F.gelu(x[t] @ layer.w1[e]) @ layer.w2[e])
    return out, load


def test_moe_without_drops_equals_dense_topk_mixture():
    layer, x = _moe_layer(capacity_factor=100.0)
    T = x.shape[0] * x.shape[1]
    assert capacity(layer.cfg, T) == T
    dispatch, _ = layer.routing(x.reshape(T, -1))
    assert dispatch.sum().item() == T * layer.cfg.top_k  # nothing dropped
    ref, _ = _moe_reference(layer, x, T)
    torch.testing.assert_close(layer(x).reshape(T, -1), ref)


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_capacity_drops_match_reference(normalize):
    layer, x = _moe_layer(capacity_factor=0.5, normalize_gates=normalize)
    T = x.shape[0] * x.shape[1]
    C = capacity(layer.cfg, T)
    assert C == math.ceil(0.5 * T * 2 / 4) == 3
    dispatch, combine = layer.routing(x.reshape(T, -1))
    ref, load = _moe_reference(layer, x, C)
    assert sum(load) < T * layer.cfg.top_k  # some assignments were dropped
    assert dispatch.sum(0).le(1).all()  # each (expert, slot) holds at most one token
    assert dispatch.sum((0, 2)).tolist() == load
    torch.testing.assert_close(layer(x).reshape(T, -1), ref)


def test_moe_gradients_match_finite_differences():
    layer, x = _moe_layer(capacity_factor=0.75)
    params = (x.requires_grad_(), layer.router.weight, layer.w1, layer.w2)
    f = lambda x, r, w1, w2: torch.func.functional_call(  # noqa: E731
        layer, {"router.weight": r, "w1": w1, "w2": w2}, (x,))
    assert torch.autograd.gradcheck(f, params)


def _train(model, inputs, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", sorted(models.MODELS))
def test_models_survive_deepcopy_and_train_again(family):
    """A trained model deep-copied trains on like the original: the same losses, step by step,
    falling, and the copy owns its parameters (training one leaves the other alone)."""
    torch.manual_seed(0)
    model, inputs = make(family)
    _train(model, inputs, 1)
    clone = copy.deepcopy(model)
    torch.testing.assert_close(model(*inputs), clone(*inputs))
    before = {n: p.detach().clone() for n, p in clone.named_parameters()}
    ran = _train(model, inputs, 4)
    assert all(torch.equal(p, before[n]) for n, p in clone.named_parameters())  # untouched
    again = _train(clone, inputs, 4)
    assert again == ran, (again, ran)  # bit for bit: the same weights and the same ops
    assert all(b < a for a, b in zip(ran, ran[1:])), ran
    for (n, p), (_, q) in zip(model.named_parameters(), clone.named_parameters()):
        assert p.data_ptr() != q.data_ptr() and torch.equal(p, q), n
