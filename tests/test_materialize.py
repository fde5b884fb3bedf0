"""Models built on ``meta`` get their values from their own initialisation (``runtime/materialize.py``):
Hugging Face's ``_init_weights``, a model-level ``init_weights()``, ``reset_parameters()``; the same
values on every rank (seeded per module path), following the model's distribution; and a tensor
nothing can rebuild is named before planning. Compiling and training such models on gloo is in
``tests/test_dcp.py``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from autopar.errors import MaterializeError
from autopar.runtime.materialize import Materializer, check_materializable, full_value

try:
    import transformers
except ImportError:  # pragma: no cover - a test dependency
    transformers = None

needs_hf = pytest.mark.skipif(transformers is None, reason="transformers is not installed")


def hf_model(name: str, device=None, dropout: float = 0.0):
    """Tiny Hugging Face GPT-2 / LLaMA with their default options, as in test_capture, and
    ``dropout`` as every dropout rate of the config (off by default)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    with torch.device(device) if device else torch.device("cpu"):
        if name == "gpt2":
            return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                              attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout,
                                              bos_token_id=0, eos_token_id=0))
        return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                            attention_dropout=dropout, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def _values(model) -> dict[str, torch.Tensor]:
    mat = check_materializable(model)
    return {fqn: mat.value(fqn) for fqn in mat.meta}


@needs_hf
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_meta_models_follow_their_init_weights(name):
    meta, real = hf_model(name, "meta"), hf_model(name)
    got = _values(meta)
    state = dict(real.named_parameters(remove_duplicate=False)) | dict(real.named_buffers(remove_duplicate=False))
    assert set(got) == set(state), set(state) ^ set(got)
    std = meta.config.initializer_range
    for fqn, v in got.items():
        assert v.shape == state[fqn].shape and v.dtype == state[fqn].dtype and not v.is_meta, fqn
        if "norm" in fqn or ".ln_" in fqn:  # LayerNorm / RMSNorm: ones and zeros
            assert torch.equal(v, torch.ones_like(v) if fqn.endswith("weight") else torch.zeros_like(v)), fqn
        elif fqn.endswith("bias"):
            assert torch.equal(v, torch.zeros_like(v)), fqn
        elif "rotary_emb" in fqn:  # computed, not random: equal to the CPU build's
            assert torch.equal(v, state[fqn]), fqn
        else:  # N(0, std); GPT-2 scales its residual projections by 1/sqrt(2 n_layer) (its _init_weights)
            want = std / math.sqrt(2 * meta.config.n_layer) if name == "gpt2" and "c_proj" in fqn else std
            assert abs(v.std().item() / want - 1) < 0.15 and abs(v.mean().item()) < want / 5, (fqn, v.std(), want)
    if name == "gpt2":
        assert torch.equal(got["lm_head.weight"], got["transformer.wte.weight"]), "tied names get one value"
    again = _values(meta)
    assert all(torch.equal(again[k], got[k]) for k in got), "every rank must rebuild the same values"
    assert all(p.is_meta for p in meta.parameters()), "materializing must leave the model alone"


def test_model_level_init_weights_comes_first():
    """The zoo's GPT re-initialises its linears N(0, 0.02) in ``GPT.init_weights``: a meta build gets
    that, not ``nn.Linear.reset_parameters``' uniform; the root's own buffers come from it too."""
    from autopar.models import make

    meta, _ = make("gpt", "tiny", batch=2, device="meta")
    mat = Materializer(meta)
    fqn = next(n for n, m in meta.named_modules() if isinstance(m, nn.Linear) and n != "lm_head") + ".weight"
    assert mat.plan()[fqn] == ("init_weights", "")
    w = mat.value(fqn)
    assert abs(w.std().item() / 0.02 - 1) < 0.15, w.std()
    assert torch.equal(w, full_value(meta, fqn, meta.get_parameter(fqn))), "full_value alone rebuilds the same"


class _Scale(nn.Module):
    """A user's module whose parameter is set in ``__init__`` only: nothing can rebuild it."""

    def __init__(self, dim: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.gain


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(8, 8), _Scale(8), nn.Linear(8, 8))

    def forward(self, x, y):
        return ((self.blocks(x) - y) ** 2).mean()


def test_unmaterializable_module_is_named_before_planning(monkeypatch):
    import autopar.api

    def no_planning(*a, **k):
        raise AssertionError("planning started before the meta check")

    monkeypatch.setattr(autopar.api, "plan", no_planning)
    with torch.device("meta"):
        model = _Net()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(MaterializeError) as e:
        autopar.compile(model, autopar.Mesh({"dp": 2}, device="cpu"), (x, y))
    msg = str(e.value)
    assert "'blocks.1.gain'" in msg and "'blocks.1' (_Scale)" in msg and "reset_parameters" in msg, msg
    assert "blocks.0" not in msg and "blocks.2" not in msg, "nn.Linear rebuilds itself"


def test_initialiser_that_writes_part_of_a_tensor_is_refused():
    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))

        def reset_parameters(self):
            with torch.no_grad():
                self.w[:2].zero_()  # rows 2 and 3 are never written

    with torch.device("meta"):
        m = nn.Sequential(Half())
    mat = check_materializable(m)
    with pytest.raises(MaterializeError, match="not fully initialised"):
        mat.value("0.w")
