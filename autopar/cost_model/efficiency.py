"""Achieved throughput as a function of shape: what fraction of a device's peak an op reaches.

One constant cannot follow how kernels behave: a matmul with few output tiles leaves streaming
multiprocessors idle, a short reduction dimension pays its prologue and epilogue on little work,
flash attention at short sequences or small head dims runs far below its long-sequence rate, and a
small copy never reaches the memory's bandwidth. ``Efficiency`` holds a few parameters per device
(fitted to published kernel-level measurements for the GPU presets, measured by ``autopar
calibrate`` on this machine) and these functions turn them into a fraction for one op's shape:

    matmul(M, N, K)      = mm_max * MN / (MN + mm_half_mn) * K / (K + mm_half_k)
    attention(s, d, c)   = attn_max[phase] * s' / (s' + attn_half_seq) * head(d)
                           s' = keys per query: s for full attention, s/2 causal (a causal
                           query row has on average half the keys, so its tiles fill like a
                           full row of half the length);
                           head(d) = d / pad(d) * (pad(d) / (pad(d) + attn_half_head_dim))
                                     / (128 / (128 + attn_half_head_dim)):
                           1 at head dim 128; a head dim the kernel pads (112 -> 128) pays the
                           padding; smaller head dims do less work per byte of a tile.
    memory(B)            = mem_max * B / (B + mem_half_bytes)

Each is a saturating function: the half-constant is the size at which the shape costs half of the
best rate. MN counts every output element of the call (a batched matmul's batch included): the
work that can run in parallel. The roofline (``autopar.cost_model.compute``) divides FLOPs by
``peak * matmul(...)`` (or ``attention(...)``) and bytes by ``hbm_bandwidth * memory(B)`` and
takes the larger. ``Efficiency.flat`` is a constant (no shape dependence): what plans of schema
version 4 and older, which stored one ``matmul_efficiency`` and one ``memory_efficiency``, were
priced with.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

#: head dims flash attention kernels are compiled for; others run padded to the next one
_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class Efficiency:
    """Parameters of the achieved-throughput curves of one device (see the module docstring).

    ``mm_max``: fraction of peak FLOP/s the best-shaped large matmul reaches. ``mm_half_mn``:
    output elements at which too little parallel work halves it. ``mm_half_k``: reduction length
    at which per-tile overhead halves it. ``attn_fwd``/``attn_bwd``: fraction of peak fused (flash)
    attention's forward/backward reaches at long sequence, head dim 128. ``attn_half_seq``: keys
    per query at which it is half that. ``attn_half_head_dim``: head dim at which the per-tile
    work halves it. ``mem_max``: fraction of memory bandwidth large memory-bound ops reach;
    ``mem_half_bytes``: bytes moved at which a kernel reaches half of it.
    """

    mm_max: float
    mm_half_mn: float
    mm_half_k: float
    attn_fwd: float
    attn_bwd: float
    attn_half_seq: float
    attn_half_head_dim: float
    mem_max: float
    mem_half_bytes: float

    @staticmethod
    def flat(matmul: float, memory: float) -> "Efficiency":
        """A constant efficiency: ``matmul`` for every FLOP (attention included), ``memory`` for
        every byte, whatever the shape (how plans of schema version 4 and older were priced)."""
        return Efficiency(mm_max=matmul, mm_half_mn=0.0, mm_half_k=0.0, attn_fwd=matmul, attn_bwd=matmul,
                          attn_half_seq=0.0, attn_half_head_dim=0.0, mem_max=memory, mem_half_bytes=0.0)

    def to_dict(self) -> dict:
        """JSON-able; ``Efficiency.from_dict(e.to_dict()) == e``."""
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @staticmethod
    def from_dict(d: Any) -> "Efficiency":
        """From ``to_dict``'s form (or an Efficiency); a ValueError names missing or unknown keys."""
        if isinstance(d, Efficiency):
            return d
        names = [f.name for f in dataclasses.fields(Efficiency)]
        if not isinstance(d, dict) or set(d) != set(names):
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"an efficiency needs exactly the keys {names}, got {got}")
        e = Efficiency(**{k: float(d[k]) for k in names})
        e.validate()
        return e

    def validate(self) -> None:
        """Raise ValueError naming the first parameter that cannot be right."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or math.isinf(v):
                raise ValueError(f"efficiency {f.name} must be a finite number, got {v!r}")
            top = f.name in ("mm_max", "attn_fwd", "attn_bwd", "mem_max")
            if (top and not 0 < v <= 2) or (not top and v < 0):
                raise ValueError(f"efficiency {f.name} must be {'in (0, 2]' if top else '>= 0'}, got {v!r}")


def _sat(x: float, half: float) -> float:
    """x / (x + half): 1 for a flat curve (half 0), else how far along the saturating curve x is."""
    if half <= 0:
        return 1.0
    return x / (x + half) if x > 0 else 0.0


def matmul(eff: Efficiency, mn: float, k: float) -> float:
    """Fraction of peak of a matmul with ``mn`` output elements (all batches) and reduction ``k``."""
    return eff.mm_max * _sat(mn, eff.mm_half_mn) * _sat(k, eff.mm_half_k)


def _padded(d: int) -> int:
    return next((p for p in _HEAD_DIMS if p >= d), d)


def head_factor(eff: Efficiency, head_dim: int) -> float:
    """Head-dim factor of attention: 1 at 128 (see the module docstring)."""
    h = eff.attn_half_head_dim
    if h <= 0 or head_dim <= 0:
        return 1.0
    p = _padded(int(head_dim))
    return (head_dim / p) * _sat(p, h) / _sat(128, h)


def attention(eff: Efficiency, phase: str, keys: float, head_dim: int, causal: bool) -> float:
    """Fraction of peak of fused attention's ``phase`` ("fwd" or "bwd") with ``keys`` keys per
    query row (the key sequence), ``head_dim``, ``causal`` masking."""
    top = eff.attn_fwd if phase == "fwd" else eff.attn_bwd
    s = keys / 2 if causal else keys
    return top * _sat(s, eff.attn_half_seq) * head_factor(eff, head_dim)


def memory(eff: Efficiency, nbytes: float) -> float:
    """Fraction of memory bandwidth a memory-bound kernel moving ``nbytes`` reaches."""
    return eff.mem_max * _sat(nbytes, eff.mem_half_bytes)


__all__ = ["Efficiency", "attention", "head_factor", "matmul", "memory"]
