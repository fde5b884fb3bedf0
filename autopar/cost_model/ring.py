"""The price of ring attention (``ir.rules.ring``): its steps, their transfers, its blocks in flight.

On a ring of ``n`` devices each device runs ``n`` steps; at each it attends its query block to the
key/value block it holds while the next block arrives from its neighbour. The ring is as slow as
its slowest device at each step, and a transfer hides under that step's compute where the link
allows, so the op takes

    sum over steps 0..n-2 of max(compute(step), transfer) + compute(n-1)

with ``transfer = latency + block bytes / bandwidth`` (one point-to-point hop on the axis's link).
The backward also sends the key/value gradient accumulator (fp32) with each block, and once more
after its last step, to its owner.

Causal work per step, in units of ``c`` (one query chunk against one key chunk, unmasked):

- contiguous (``ring``, one chunk per device = a block): step 0 is the diagonal block (half its
  work); at every later step some device (the last) attends a whole block, so each costs a whole
  block: ``(n - 1) + 1/2`` blocks, while the first device idles for most of them;
- balanced (``ring:balanced``, chunks ``r`` and ``2n-1-r``, a chunk = half a block): every device
  does the same work at every step, two chunk pairs = half a block (step 0: two diagonal chunks and
  one whole pair), ``n / 2`` blocks in all. Its tensors are laid out balanced (``Z``); converting
  to and from that layout is a resharding, priced where it happens (``cost_model.balanced``); on
  contiguous blocks (``ir.rules.ring.edge_balanced``) the op's two half-block permutations of each
  input and output at its edges are priced with it (not overlapped).

Without a mask every device attends a whole block at every step in either layout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from autopar.cost_model.compute import compute_time
from autopar.cost_model.hardware import Hardware, Link
from autopar.cost_model.precision import Precision, element_bytes
from autopar.ir.attention import ATTN_BWD, ATTN_FWD
from autopar.ir.rules.base import OpCall
from autopar.ir.rules.dimmap import Strategy
from autopar.ir.rules.ring import RING_BALANCED, edge_balanced, ring_axis

__all__ = ["causal_split_factor", "ring_inflight_bytes", "ring_time", "step_works"]

Shape = tuple[int, ...]


def _hop(nbytes: float, link: Link) -> float:
    """One point-to-point transfer of ``nbytes`` on ``link``."""
    return link.latency + nbytes / link.bandwidth


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for x in shape:
        out *= x
    return out


def _q_index(call: OpCall) -> int:
    return 1 if call.op == ATTN_BWD else 0


def _with_causal(call: OpCall, causal: bool) -> OpCall:
    pos = 7 if call.op == ATTN_BWD else 4
    args = list(call.args)
    if pos < len(args):
        args[pos] = causal
        return replace(call, args=tuple(args))
    return replace(call, kwargs=dict(call.kwargs, is_causal=causal))


def _chunked(ins: Sequence[Shape], parts: int) -> list[Shape]:
    """Every local input shape with its sequence dim (2) cut into ``parts`` chunks."""
    return [tuple(s[:2]) + (s[2] // parts,) + tuple(s[3:]) if len(s) >= 3 else tuple(s) for s in ins]


def causal_split_factor(call: Optional[OpCall], strategy: Strategy, mesh_shape: Sequence[int]) -> float:
    """The busiest device's work over the priced (average) work of a causal attention whose query
    sequence is split in ``N`` contiguous blocks against whole keys (the gather form, tag ``S:s``):
    the last block's queries see ``(2N - 1) / (2N)`` of the keys where the average sees half, so
    the op runs ``(2N - 1) / N`` times its averaged price; 1 for any other op or strategy."""
    if call is None or call.op not in (ATTN_FWD, ATTN_BWD) or ring_axis(strategy) is not None:
        return 1.0
    if not bool(call.arg(7 if call.op == ATTN_BWD else 4, "is_causal", False)):
        return 1.0
    n = 1
    for axis, sig in enumerate(strategy):
        if sig.tag == "S:s":
            n *= mesh_shape[axis]
    return (2 * n - 1) / n


def step_works(n: int, causal: bool, balanced: bool) -> list[tuple[int, int]]:
    """Per ring step, the slowest device's work as ``(whole chunk pairs, diagonal chunk pairs)``."""
    if not causal:
        return [(4, 0) if balanced else (1, 0)] * n
    if balanced:
        return [(1, 2)] + [(2, 0)] * (n - 1)
    return [(0, 1)] + [(1, 0)] * (n - 1)


def ring_time(call: OpCall, strategy: Strategy, ins: Sequence[Shape], outs: Sequence[Optional[Shape]],
              n: int, link: Link, hw: Hardware, precision: Precision) -> float:
    """Seconds of one ring attention op (forward or backward) on ``n`` devices of ``link``, from the
    local block shapes ``ins``/``outs`` a device holds (see the module's docstring)."""
    found = ring_axis(strategy)
    assert found is not None, "not a ring strategy"
    balanced = found[1] == RING_BALANCED
    causal = bool(call.arg(7 if call.op == ATTN_BWD else 4, "is_causal", False))
    parts = 2 if balanced else 1
    cins = _chunked(ins, parts)
    couts = [None if s is None else _chunked([s], parts)[0] for s in outs]
    whole = compute_time(_with_causal(call, False), cins, couts, hw, precision)
    diag = compute_time(_with_causal(call, True), cins, couts, hw, precision) if causal else 0.0
    qi = _q_index(call)
    eb = element_bytes(call.in_specs[qi + 1].dtype, "activation", precision)
    kv_numel = _numel(ins[qi + 1]) + _numel(ins[qi + 2])
    kv = _hop(kv_numel * eb, link)
    backward = call.op == ATTN_BWD
    if backward:  # the fp32 gradient accumulator travels with its block
        kv = _hop(kv_numel * (eb + 4), link)
    steps = [w * whole + d * diag for w, d in step_works(n, causal, balanced)]
    total = sum(max(c, kv) for c in steps[:-1]) + steps[-1]
    if backward:
        total += _hop(kv_numel * 4, link)  # the accumulators' last pass, home
    if edge_balanced(strategy):  # inputs in and outputs out, each as two half-block permutations
        moved = [(shape, spec.dtype) for shape, spec in zip(ins, call.in_specs)]
        moved += [(shape, spec.dtype) for shape, spec in zip(outs, call.out_specs) if shape is not None and spec]
        total += sum(2 * _hop(_numel(shape) * element_bytes(dt, "activation", precision) / 2, link)
                     for shape, dt in moved)
    return total


def ring_inflight_bytes(call: OpCall, ins: Sequence[Shape], precision: Precision) -> int:
    """Bytes a ring attention op holds besides its inputs and outputs while it runs: the key/value
    block it computes on and the one arriving, the fp32 running output (forward), and the fp32
    gradient accumulators with the one arriving and the query gradient (backward)."""
    qi = _q_index(call)
    eb = element_bytes(call.in_specs[qi + 1].dtype, "activation", precision)
    kv = _numel(ins[qi + 1]) + _numel(ins[qi + 2])
    q = _numel(ins[qi])
    if call.op == ATTN_BWD:
        return int(2 * kv * eb + 2 * kv * 4 + q * 4)
    return int(2 * kv * eb + q * 4)
