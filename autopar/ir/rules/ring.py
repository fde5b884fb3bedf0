"""Ring attention as strategies of ``autopar::attention`` and its backward.

Besides the attention rule's own signatures (batch and head splits; the query sequence split with
whole keys and values), two special ones split queries, keys, values, the output and the
log-sum-exp (and, backward, the gradients) on the sequence, dim 2, over one mesh axis:

- ``ring``: device ``r`` holds the ``r``-th contiguous block; key/value blocks pass around the
  ring (``ir.ring_attention``). Under a causal mask the last device has the most work.
- ``ring:balanced``: every tensor of the op in the balanced layout ``Z(2)`` (``ir.placement.
  Balanced``: device ``r`` holds chunks ``r`` and ``2n-1-r`` of ``2n``), where every ring step costs
  every device the same causal work. The layout is a placement like any other: the ops around the
  attention take it as they take a split (``ir.rules.dimmap.balanced_signatures``), and the
  conversions from and to other placements are reshardings, priced and lowered as such. Where the
  search does not offer ``Z`` around the op (``offer_balanced``), it weighs the balanced ring on
  contiguous blocks instead (``edge_balanced``): the op permutes its blocks to the balanced layout
  at its edges and back, priced with the op, so the ops around it see plain splits.

A strategy may ring on one axis only, with no other axis splitting the sequence; the sequence must
divide into equal blocks (``2n`` chunks for the balanced layout). Ring runs without a mask tensor
and without dropout (those keep the other forms).

``forced_form`` pins an attention form for the search (tests, and the planner's hints): inside it,
every attention op that admits the form keeps only its strategies of that form.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterable, Iterator, Optional, Sequence

from autopar.ir.attention import ATTN_BWD, ATTN_FWD
from autopar.ir.placement import Balanced, Split
from autopar.ir.ring_attention import Ring, from_balanced, ring_backward, ring_forward, to_balanced
from autopar.ir.rules.special import _check_attention_blocks  # (and the attention rules this module extends)
from autopar.ir.rules.base import RULES, LocalCtx, OpCall
from autopar.ir.rules.dimmap import DimMap, Signature, Strategy
from autopar.ir.rules.shared_kv import TAG as KV_SHARED
from autopar.ir.rules.shared_kv import composes as kv_shared_composes

__all__ = ["FORMS", "RING", "RING_BALANCED", "asks_balanced", "balanced_lengths", "balanced_offered", "edge_balanced",
           "forced_form", "offer_balanced", "ring_axis"]

RING = "ring"
RING_BALANCED = "ring:balanced"
FORMS = (RING, RING_BALANCED)

_forced: list[Optional[str]] = [None]


@contextlib.contextmanager
def forced_form(form: Optional[str]) -> Iterator[None]:
    """While the block runs, attention ops that admit ``form`` (``"ring"`` or ``"ring:balanced"``)
    keep only strategies of that form; None forces nothing."""
    if form is not None and form not in FORMS:
        raise ValueError(f"unknown attention form {form!r}; expected one of {FORMS}")
    prev = _forced[0]
    _forced[0] = form
    try:
        yield
    finally:
        _forced[0] = prev


def ring_axis(strategy: Strategy) -> Optional[tuple[int, str]]:
    """``(axis, tag)`` of the strategy's ring signature, or None."""
    for axis, sig in enumerate(strategy):
        if sig.tag in FORMS:
            return axis, sig.tag
    return None


_offered: list[bool] = [False]


@contextlib.contextmanager
def offer_balanced(on: bool) -> Iterator[None]:
    """While the block runs, the search weighs the balanced split ``Z`` (``balanced_offered``); the
    lowering finds a plan's ``Z`` strategies either way."""
    prev = _offered[0]
    _offered[0] = on
    try:
        yield
    finally:
        _offered[0] = prev


def balanced_offered() -> bool:
    """Whether the search weighs ``Z`` now (``offer_balanced``)."""
    return _offered[0]


def asks_balanced(hints: object, attention: object) -> bool:
    """Whether the user asks for the balanced layout: a hint placing something ``Z``, ``attention=``
    naming ``ring:balanced``, or ``forced_form(ring:balanced)``."""
    def names(value: object, what: str) -> bool:
        if isinstance(value, str):
            return what in value
        if isinstance(value, dict):
            return any(names(v, what) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(names(v, what) for v in value)
        return what in str(value)

    return _forced[0] == RING_BALANCED or names(hints or {}, "Z(") or names(attention or {}, RING_BALANCED)


def balanced_lengths(calls: Iterable[OpCall]) -> tuple[int, ...]:
    """The sequence lengths of the causal attentions among ``calls`` that a balanced ring can split:
    the ops of the graph offer the balanced split ``Z`` only on dims of these lengths (the dims that
    can carry the attention's sequence), which keeps the strategy count of every other graph, and
    of every other dim, as it is."""
    out = set()
    for call in calls:
        if call.op == ATTN_FWD and _admits(call) and bool(call.arg(4, "is_causal", False)):
            seq = call.in_specs[0].shape[2]
            if seq % 4 == 0:  # 2n equal chunks on some axis of n >= 2
                out.add(seq)
    return tuple(sorted(out))


def _layout(call: OpCall) -> tuple[int, int, int]:
    """(index of q among the tensor inputs, position of is_causal, position of dropout_p)."""
    return (1, 7, 6) if call.op == ATTN_BWD else (0, 4, 3)


def _admits(call: OpCall) -> bool:
    q_index, _, drop_pos = _layout(call)
    n_tensors = 6 if call.op == ATTN_BWD else 3
    if len(call.in_specs) != n_tensors or call.arg(drop_pos, "dropout_p", 0.0):
        return False  # an explicit mask, or dropout: the other forms
    q, k = call.in_specs[q_index], call.in_specs[q_index + 1]
    return q.ndim == 4 and q.shape[2] == k.shape[2] and q.shape[2] >= 2


def _ring_extra(call: OpCall, dm: DimMap) -> list[Signature]:
    if not _admits(call):
        return []
    n_out = len(call.out_specs)
    out = []
    # ring:balanced twice: laid out balanced (Z), and on contiguous blocks permuting at its edges
    # (``edge_balanced``), which the search weighs where it does not offer Z around the op
    for tag, place in ((RING, Split(2)), (RING_BALANCED, Balanced(2)), (RING_BALANCED, Split(2))):
        out.append(Signature(tuple(place for _ in call.in_specs), tuple(place for _ in range(n_out)), tag))
    return out


def edge_balanced(strategy: Strategy) -> bool:
    """Whether ``strategy`` runs the balanced ring on contiguous sequence blocks (``S(2)``), reaching
    the balanced layout and back by permutations inside the op, priced with it."""
    found = ring_axis(strategy)
    if found is None or found[1] != RING_BALANCED:
        return False
    sig = strategy[found[0]]
    return not any(isinstance(p, Balanced) for p in sig.inputs)


def _compose(call: OpCall, strats: list, mesh_shape: Sequence[int]) -> list:
    seq = call.in_specs[_layout(call)[0]].shape[2] if _admits(call) else 0
    out = []
    for st in strats:
        rings = [(a, s.tag) for a, s in enumerate(st) if s.tag in FORMS]
        if not rings:
            out.append(st)
            continue
        (axis, tag), n = rings[0], mesh_shape[rings[0][0]]
        pieces = 2 * n if tag == RING_BALANCED else n
        # no other axis splits the sequence, nor selects shared kv heads (the ring's blocks are the
        # op's own k/v; kv-shared picks heads inside the plain local code the ring replaces)
        others_ok = all(s.tag not in ("S:s", "S:t", KV_SHARED) for a, s in enumerate(st) if a != axis)
        if len(rings) == 1 and n > 1 and seq % pieces == 0 and others_ok:
            out.append(st)
    form = _forced[0]
    if form is not None and any(s.tag == form for st in out for s in st):
        out = [st for st in out if any(s.tag == form for s in st)]
    return out


def _ring_of(ctx: LocalCtx) -> Optional[Ring]:
    found = ring_axis(ctx.strategy)
    if found is None:
        return None
    axis, tag = found
    return Ring(ctx.permute, axis, ctx.mesh_shape[axis], ctx.coords[axis], tag == RING_BALANCED)


def _check_ring_blocks(xs: list, q_index: int, backward: bool, chunks: int) -> None:
    """The CPU kernel dies (SIGFPE) on inconsistent or empty blocks: ring blocks must be the
    attention's own blocks, non-empty, queries and keys equally long, in equal chunks."""
    _check_attention_blocks(xs, q_index, backward)
    q, k = xs[q_index], xs[q_index + 1]
    if q.numel() == 0 or k.numel() == 0 or q.shape[2] != k.shape[2] or q.shape[2] % chunks:
        shapes = ", ".join(str(tuple(x.shape)) for x in xs)
        raise RuntimeError(f"ring attention blocks must be equal, non-empty sequence blocks: {shapes}")


def _wrap(op: str) -> None:
    """Add the ring signatures and their local implementation to ``op``'s attention rule."""
    rule = RULES[op]
    plain, before = rule.local, rule.extra  # the attention rule's own extra signatures (kv-shared) stay
    assert plain is not None and rule.compose is None

    def local(ctx: LocalCtx, xs: list):
        ring = _ring_of(ctx)
        if ring is None:
            return plain(ctx, xs)
        call = ctx.call
        q_index, causal_pos, _ = _layout(call)
        _check_ring_blocks(xs, q_index, op == ATTN_BWD, 2 if ring.balanced else 1)
        causal, scale = bool(call.arg(causal_pos, "is_causal", False)), call.kwargs.get("scale")
        edges = edge_balanced(ctx.strategy)
        if edges:
            xs = [to_balanced(ring, x, 2) for x in xs]
        res = (ring_backward(ring, *xs, causal, scale) if op == ATTN_BWD
               else ring_forward(ring, *xs, causal, scale))
        return tuple(from_balanced(ring, x, 2) for x in res) if edges else res

    def extra(call: OpCall, dm: DimMap) -> list[Signature]:
        return (before(call, dm) if before is not None else []) + _ring_extra(call, dm)

    def compose(call: OpCall, strats: list, mesh_shape: Sequence[int]) -> list:
        return _compose(call, [st for st in strats if kv_shared_composes(st, 1 if op == ATTN_BWD else 0)], mesh_shape)

    RULES[op] = replace(rule, extra=extra, local=local, compose=compose)


for _op in (ATTN_FWD, ATTN_BWD):
    _wrap(_op)
