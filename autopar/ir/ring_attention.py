"""Ring attention: one device's share of ``autopar::attention`` (and its backward) when queries,
keys and values are all split on the sequence over one mesh axis of ``n`` devices.

Each device keeps its query block and passes its key/value block around the ring: at step ``i`` it
holds the block of the device ``i`` places before it, attends its queries to it with the fused
kernel, and merges the partial result into its running ``(out, lse)`` by log-sum-exp. The backward
runs the same ring with the forward's ``out`` and ``lse`` (which make each block's gradients exact
on their own: the softmax normaliser is the whole row's) and passes a key/value gradient
accumulator along with the blocks, which ends, after ``n`` passes, on the device that owns it.

Causal masks are decided per pair of sequence *chunks* (equal pieces, in sequence order): a query
chunk after the key chunk attends to all of it, the same chunk runs the kernel with ``is_causal``
(top-left aligned, exact for a diagonal chunk), a chunk before it is skipped. No mask is built.

Layouts: ``contiguous`` (``S(2)``: device ``r`` holds chunk ``r`` of ``n``) and ``balanced``
(``Z(2)``, ``ir.placement.Balanced``: ``2n`` chunks, device ``r`` holds chunks ``r`` and ``2n-1-r``,
so every device has the same causal work). The blocks arrive in their layout; the masks follow from
the chunk indices each device holds. The balanced ring also runs on contiguous blocks, reaching its
layout and back by two point-to-point permutations at the op's edges (``to_balanced`` /
``from_balanced``): the form the search weighs where the balanced split is not offered around the op.

The exchanges are ``permute(x, axis, dest)``: every device of the axis sends its ``x`` to device
``dest[rank]`` and returns what it received (a ``LocalCtx.permute``, which the program and the rule
proof provide). This module stays below the program layer: it only calls that function.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from autopar.ir.attention import attention, attention_backward

__all__ = ["Permute", "Ring", "from_balanced", "ring_backward", "ring_forward", "to_balanced"]

#: ``permute(x, axis, dest)``: send ``x`` to the axis's device ``dest[rank]``; returns what arrived
Permute = Callable[[torch.Tensor, int, Sequence[int]], torch.Tensor]


class Ring:
    """One device's place in a ring: the axis, its size and rank there, the layout and the exchange."""

    def __init__(self, permute: Optional[Permute], axis: int, n: int, rank: int, balanced: bool):
        if permute is None:
            raise RuntimeError("ring attention needs point-to-point exchanges: run it in a lowered program "
                               "(autopar.compile / autopar.simulate) or the rule proof, which provide them")
        self.permute, self.axis, self.n, self.rank, self.balanced = permute, axis, n, rank, balanced

    def chunks(self, owner: int) -> list[int]:
        """The global chunk indices device ``owner`` holds, in the order its block stores them."""
        return [owner, 2 * self.n - 1 - owner] if self.balanced else [owner]

    def shift(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` sent one device along the ring; returns the previous device's."""
        return self.permute(x.contiguous(), self.axis, [(r + 1) % self.n for r in range(self.n)])


def _pieces(x: torch.Tensor, k: int) -> list[torch.Tensor]:
    return [p.contiguous() for p in x.chunk(k, dim=2)] if k > 1 else [x.contiguous()]


def _relation(qc: int, kc: int) -> Optional[bool]:
    """For a causal mask: None (skip: every key after every query), True (diagonal chunk: is_causal)
    or False (every key before every query: no mask)."""
    return None if qc < kc else qc == kc


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: fp32, or the operands' own where wider."""
    return torch.promote_types(dtype, torch.float32)


def _merge(acc: Optional[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor, lse: torch.Tensor):
    """Two partial attentions over disjoint keys, merged by their log-sum-exp (at least fp32)."""
    out, lse = out.to(_acc(out.dtype)), lse.to(_acc(lse.dtype))
    if acc is None:
        return out, lse
    a_out, a_lse = acc
    new = torch.logaddexp(a_lse, lse)
    new_safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    wa = torch.exp(a_lse - new_safe).nan_to_num(0.0)[..., None]
    wb = torch.exp(lse - new_safe).nan_to_num(0.0)[..., None]
    return a_out * wa + out * wb, new


def ring_forward(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """This device's ``(out, lse)`` for its query block (in its layout) against every key block."""
    qs = _pieces(q, len(ring.chunks(0)))
    q_ids = ring.chunks(ring.rank)
    acc: list = [None] * len(qs)
    kv = torch.cat([k, v], dim=-1)  # one exchange per step (k and v share b, heads, sequence)
    d = k.shape[-1]
    for step in range(ring.n):
        owner = (ring.rank - step) % ring.n
        for kc, kv_piece in zip(ring.chunks(owner), _pieces(kv, len(qs))):
            kb, vb = kv_piece[..., :d], kv_piece[..., d:]
            for i, (qc, qb) in enumerate(zip(q_ids, qs)):
                rel = _relation(qc, kc) if causal else False
                if rel is None:
                    continue
                o, lse = attention(qb, kb.contiguous(), vb.contiguous(), 0.0, rel, scale=scale)
                acc[i] = _merge(acc[i], o, lse)
        if step + 1 < ring.n:
            kv = ring.shift(kv)
    out = torch.cat([a[0] for a in acc], dim=2).to(q.dtype)
    lse = torch.cat([a[1] for a in acc], dim=2)
    return out, lse


def ring_backward(ring: Ring, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: Optional[float]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This device's ``(dq, dk, dv)``: its query block's gradient, and the gradients of the key and
    value blocks it holds, summed over every device's queries as they pass around the ring."""
    k_parts = len(ring.chunks(0))
    qs, gs, outs, lses = (_pieces(t, k_parts) for t in (q, grad, out, lse.unsqueeze(-1)))
    q_ids = ring.chunks(ring.rank)
    d = k.shape[-1]
    kv = torch.cat([k, v], dim=-1)
    acc = _acc(kv.dtype)
    dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # travels with its block
    dq = [torch.zeros(x.shape, dtype=acc, device=x.device) for x in qs]
    for step in range(ring.n):
        owner = (ring.rank - step) % ring.n
        dk_parts, dv_parts = [], []
        for kc, kv_piece in zip(ring.chunks(owner), _pieces(kv, k_parts)):
            kb, vb = kv_piece[..., :d].contiguous(), kv_piece[..., d:].contiguous()
            dkb = torch.zeros(kb.shape, dtype=acc, device=kb.device)
            dvb = torch.zeros(vb.shape, dtype=acc, device=vb.device)
            for i, qc in enumerate(q_ids):
                rel = _relation(qc, kc) if causal else False
                if rel is None:
                    continue
                a, b, c = attention_backward(gs[i].contiguous(), qs[i].contiguous(), kb, vb, outs[i].contiguous(),
                                             lses[i].squeeze(-1).contiguous(), 0.0, rel, scale=scale)
                dq[i] += a
                dkb += b
                dvb += c
            dk_parts.append(dkb)
            dv_parts.append(dvb)
        dkv = dkv + torch.cat([torch.cat(dk_parts, dim=2), torch.cat(dv_parts, dim=2)], dim=-1)
        if step + 1 < ring.n:
            kv = ring.shift(kv)
        dkv = ring.shift(dkv)  # n passes in all: each accumulator ends on its block's owner
    dq_out = torch.cat(dq, dim=2).to(q.dtype)
    return dq_out, dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype)


# -- the balanced layout's edges ---------------------------------------------------------------

def _owner(chunk: int, n: int) -> int:
    """The device holding ``chunk`` (of ``2n``) in the balanced layout."""
    return chunk if chunk < n else 2 * n - 1 - chunk


def to_balanced(ring: Ring, x: torch.Tensor, dim: int) -> torch.Tensor:
    """This device's contiguous block of ``x`` along ``dim`` (chunks ``2r``, ``2r+1``) as its balanced
    block (chunks ``r``, ``2n-1-r``): two permutations, the even chunks and the odd ones."""
    n, r = ring.n, ring.rank
    even, odd = x.chunk(2, dim=dim)
    got_even = ring.permute(even.contiguous(), ring.axis, [_owner(2 * s, n) for s in range(n)])
    got_odd = ring.permute(odd.contiguous(), ring.axis, [_owner(2 * s + 1, n) for s in range(n)])
    # of the two chunks r and 2n-1-r (an odd sum), exactly one is even
    front, back = (got_even, got_odd) if r % 2 == 0 else (got_odd, got_even)
    return torch.cat([front, back], dim=dim)


def from_balanced(ring: Ring, x: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of ``to_balanced``: this device's balanced block back to its contiguous block."""
    n, r = ring.n, ring.rank
    front, back = x.chunk(2, dim=dim)
    even, odd = (front, back) if r % 2 == 0 else (back, front)

    def dest(s: int, parity: int) -> int:  # where device s's chunk of that parity belongs
        c = s if s % 2 == parity else 2 * n - 1 - s
        return c // 2

    got_even = ring.permute(even.contiguous(), ring.axis, [dest(s, 0) for s in range(n)])
    got_odd = ring.permute(odd.contiguous(), ring.axis, [dest(s, 1) for s in range(n)])
    return torch.cat([got_even, got_odd], dim=dim)
