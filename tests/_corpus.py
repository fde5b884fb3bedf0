"""A corpus of model code autopar did not write, for the coverage and parity tests (issue 14).

Every builder returns ``(model, args, kwargs)``: a model whose call on ``(*args, **kwargs)``
returns a loss (a scalar, or an output with a ``loss``), built with the library's default options
and small dims (hidden 64, 2 layers, vocab 256). Dropout is off unless ``dropout=True`` (then each
config keeps its own default rates). ``dtype`` converts the weights (float64 helps parity tolerances).

* ``titan_llama``: a Llama 3 **written here in the style of torchtitan's** (its package needs a GPU
  torch): complex RoPE (``torch.polar``, ``view_as_complex``, ``view_as_real``), a ``freqs_cis``
  buffer, ``TransformerBlock`` with ``attention`` / ``feed_forward``, blocks in a ``ModuleDict``.
  It is not torchtitan's code; it follows the same structure and the same computation.
* Hugging Face ``transformers`` models from their config classes: GPT-2 (learned positions),
  LLaMA (RoPE, GQA), BERT (encoder), T5 (encoder-decoder), ViT (vision), Mixtral (MoE), BART
  (encoder-decoder, learned positions).
* ``torch_encoder``: ``nn.TransformerEncoder`` under a token embedding and a head.
* ``llama_loop``: ``autopar.models.llama_loop``, the decoder written in the functional-loop style.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256
HIDDEN = 64
LAYERS = 2
BATCH = 4
SEQ = 16


# ---------------------------------------------------------------------------------------------
# A Llama 3 in torchtitan's style (written for these tests; not torchtitan's source).


@dataclass
class TitanArgs:
    """The model's dims, named as torchtitan's Llama 3 names them."""

    dim: int = HIDDEN
    n_layers: int = LAYERS
    n_heads: int = 4
    n_kv_heads: Optional[int] = 2
    vocab_size: int = VOCAB
    multiple_of: int = 32
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 64


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    """The rotation of every (position, frequency) pair as a unit complex number."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end, dtype=torch.float32), inv)
    return torch.polar(torch.ones_like(angles), angles)  # complex64


def _broadcastable(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``freqs_cis`` (seq, dim/2) viewed as (1, seq, 1, dim/2) against x (batch, seq, heads, dim/2)."""
    seq = x.shape[1]
    freqs_cis = freqs_cis[0:seq]
    return freqs_cis.view(1, seq, 1, x.shape[-1])


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key pairs by complex multiplication, computed in fp32."""
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    rot = _broadcastable(freqs_cis, q)
    q_out = torch.view_as_real(q * rot).flatten(3)
    k_out = torch.view_as_real(k * rot).flatten(3)
    return q_out.type_as(xq), k_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Each KV head repeated ``n_rep`` times (grouped-query attention)."""
    if n_rep == 1:
        return x
    bs, slen, n_kv, hd = x.shape
    return x[:, :, :, None, :].expand(bs, slen, n_kv, n_rep, hd).reshape(bs, slen, n_kv * n_rep, hd)


class Attention(nn.Module):
    """Causal GQA self-attention with complex RoPE and SDPA."""

    def __init__(self, a: TitanArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.n_kv_heads = a.n_kv_heads or a.n_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward, hidden width rounded as Llama 3 rounds it."""

    def __init__(self, dim: int, hidden_dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``attention`` and ``feed_forward`` with RMSNorm before each."""

    def __init__(self, layer_id: int, a: TitanArgs):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a.dim, 4 * a.dim, a.multiple_of, a.ffn_dim_multiplier)
        self.attention_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.layer_id = layer_id

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanTransformer(nn.Module):
    """Token embedding, blocks, final norm and output projection; returns logits like torchtitan's."""

    def __init__(self, a: TitanArgs):
        super().__init__()
        self.model_args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(a.dim // a.n_heads, a.max_seq_len * 2, a.rope_theta),
                             persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class WithLoss(nn.Module):
    """A logits model with the cross-entropy loss a training loop puts after it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _ids(seed: int = 0, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def titan_llama(dropout: bool = False, layers: int = LAYERS):
    """The torchtitan-style Llama 3 (it has no dropout) with a cross-entropy loss."""
    ids = _ids()
    return WithLoss(TitanTransformer(TitanArgs(n_layers=layers))), (ids, torch.roll(ids, -1, 1)), {}


# ---------------------------------------------------------------------------------------------
# nn.TransformerEncoder


class TorchEncoder(nn.Module):
    """``nn.TransformerEncoder`` with its default layer options, under an embedding and a head."""

    def __init__(self, dropout: bool, layers: int = LAYERS):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        kw = {} if dropout else {"dropout": 0.0}
        layer = nn.TransformerEncoderLayer(HIDDEN, nhead=4, dim_feedforward=4 * HIDDEN, batch_first=True, **kw)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens))
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten(0, 1))


def torch_encoder(dropout: bool = False, layers: int = LAYERS):
    """``nn.TransformerEncoder`` (2 layers, 4 heads) trained as a token classifier."""
    ids = _ids()
    return TorchEncoder(dropout, layers), (ids, torch.roll(ids, -1, 1)), {}


# ---------------------------------------------------------------------------------------------
# Hugging Face transformers, from their config classes


#: The rate a dropout the config leaves at 0 by default gets under ``dropout=True``.
DROPOUT = 0.1


def _config(cls, dropout: bool, **dims):
    """``cls(**dims)`` with every dropout rate of the config set to 0, or under ``dropout`` its
    default, and ``DROPOUT`` where that default is 0 (LLaMA's, ViT's and Mixtral's), so that every
    dropout the architecture has is drawn."""
    cfg = cls(**dims)
    for key, value in list(cfg.to_dict().items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            if not dropout:
                setattr(cfg, key, 0.0)
            elif value == 0.0:
                setattr(cfg, key, DROPOUT)
    return cfg


def _hf(model):
    import transformers

    transformers.logging.set_verbosity_error()
    model.config._attn_implementation = "sdpa"
    if hasattr(model.config, "_experts_implementation"):
        # the default picks ``_grouped_mm``, whose fake-tensor kernel on torch 2.13 accepts bf16
        # only (capture fails in fp32 and float64, which the parity tests here use: that path is
        # ``hf_mixtral_grouped``), and "eager" loops over ``nonzero``: the batched one
        model.config._experts_implementation = "batched_mm"
    return model


def hf_gpt2(dropout: bool = False, layers: int = LAYERS):
    """GPT-2: learned positions, ``Conv1D`` weights, tied head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = _config(GPT2Config, dropout, n_embd=HIDDEN, n_layer=layers, n_head=4, vocab_size=VOCAB, n_positions=64,
                  bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)  # the default 50256 is outside the vocabulary
    ids = _ids()
    return _hf(GPT2LMHeadModel(cfg)), (), {"input_ids": ids, "labels": ids}


def hf_llama(dropout: bool = False, layers: int = LAYERS):
    """LLaMA: RoPE, grouped-query attention (4 heads, 2 KV heads), SwiGLU, RMSNorm."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = _config(LlamaConfig, dropout, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    ids = _ids()
    return _hf(LlamaForCausalLM(cfg)), (), {"input_ids": ids, "labels": ids}


def hf_bert(dropout: bool = False, layers: int = LAYERS):
    """BERT: a post-norm encoder with token-type and position embeddings, masked-LM head."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = _config(BertConfig, dropout, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
                  intermediate_size=2 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=64)
    ids = _ids()
    return _hf(BertForMaskedLM(cfg)), (), {"input_ids": ids, "labels": _ids(1)}


def hf_t5(dropout: bool = False, layers: int = LAYERS):
    """T5: encoder-decoder with relative position buckets and cross-attention."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = _config(T5Config, dropout, d_model=HIDDEN, d_kv=16, d_ff=2 * HIDDEN, num_layers=layers,
                  num_decoder_layers=layers, num_heads=4, vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0)
    return _hf(T5ForConditionalGeneration(cfg)), (), {"input_ids": _ids(), "labels": _ids(1, seq=SEQ // 2)}


def hf_bart(dropout: bool = False, layers: int = LAYERS):
    """BART: encoder-decoder with learned positions and cross-attention."""
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = _config(BartConfig, dropout, d_model=HIDDEN, encoder_layers=layers, decoder_layers=layers,
                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * HIDDEN,
                  decoder_ffn_dim=2 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=64)
    return _hf(BartForConditionalGeneration(cfg)), (), {"input_ids": _ids(), "labels": _ids(1, seq=SEQ // 2)}


def hf_vit(dropout: bool = False, layers: int = LAYERS):
    """ViT: patch-embedding convolution, class token, encoder, classification head."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = _config(ViTConfig, dropout, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
                  intermediate_size=2 * HIDDEN, image_size=32, patch_size=8, num_labels=10)
    pixels = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(1))
    return _hf(ViTForImageClassification(cfg)), (), {"pixel_values": pixels, "labels": labels}


def hf_mixtral(dropout: bool = False, layers: int = LAYERS):
    """Mixtral: sparse mixture of experts (8 experts, top 2) under LLaMA-style attention."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = _config(MixtralConfig, dropout, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    ids = _ids()
    return _hf(MixtralForCausalLM(cfg)), (), {"input_ids": ids, "labels": ids}


def hf_mixtral_grouped(dropout: bool = False, layers: int = LAYERS):
    """Mixtral as Hugging Face runs it by default: ``grouped_mm`` experts (``aten._grouped_mm``, the
    tokens sorted by expert, ``histc`` counts) in bf16, the only dtype that kernel's fake
    implementation takes on torch 2.13 (its CPU kernel also runs fp32). Not in ``CORPUS`` (whose
    parity tests run in float64): ``tests/test_corpus_grouped.py`` checks it."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = _config(MixtralConfig, dropout, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    import transformers

    transformers.logging.set_verbosity_error()
    model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    ids = _ids()
    return model, (), {"input_ids": ids, "labels": ids}


# ---------------------------------------------------------------------------------------------
# The functional-loop decoder


def llama_loop(dropout: bool = False, layers: int = LAYERS):
    """``autopar.models.llama_loop``: LLaMA with its layers' code (RoPE, SDPA, residual adds) in the
    parent's ``forward``, as user code often is (it has no dropout)."""
    from autopar.models import make

    return (*make("llama_loop", "tiny", batch=BATCH, seq=SEQ, n_layers=layers), {})


#: Every corpus model by name.
CORPUS: dict[str, Callable] = {
    "titan_llama": titan_llama,
    "torch_encoder": torch_encoder,
    "hf_gpt2": hf_gpt2,
    "hf_llama": hf_llama,
    "hf_bert": hf_bert,
    "hf_t5": hf_t5,
    "hf_vit": hf_vit,
    "hf_mixtral": hf_mixtral,
    "hf_bart": hf_bart,
    "llama_loop": llama_loop,
}


#: Models that compute parts in fp32 whatever their dtype, so a float64 build holds to fp32
#: roundoff only: torchtitan's RoPE (``xq.float()``), Hugging Face's causal-LM loss (logits
#: ``.float()``), LLaMA's and T5's RMSNorm (variance in fp32).
FP32_INSIDE = {"titan_llama", "hf_gpt2", "hf_llama", "hf_t5", "hf_mixtral"}


def build(name: str, dropout: bool = False, dtype: Optional[torch.dtype] = None, seed: int = 0,
          layers: int = LAYERS):
    """``(model, args, kwargs)`` of corpus model ``name`` with ``layers`` blocks (per stack), seeded;
    floating inputs follow ``dtype``."""
    torch.manual_seed(seed)
    model, args, kwargs = CORPUS[name](dropout=dropout, layers=layers)
    if dtype is not None:
        # Module.to(real dtype) would drop the imaginary part of complex buffers (freqs_cis): keep
        # them complex, at the matching precision
        complex_buffers = {n: b for n, b in model.named_buffers() if b.is_complex()}
        for fqn in complex_buffers:
            owner, _, leaf = fqn.rpartition(".")
            del model.get_submodule(owner)._buffers[leaf]
        model = model.to(dtype)
        want = torch.complex128 if dtype == torch.float64 else torch.complex64
        for fqn, b in complex_buffers.items():
            owner, _, leaf = fqn.rpartition(".")
            model.get_submodule(owner).register_buffer(leaf, b.to(want), persistent=False)
        args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
        kwargs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in kwargs.items()}
    return model, args, kwargs
