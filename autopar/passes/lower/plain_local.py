"""Rank-aware local ops that are, on this device, one plain op: found once, emitted as that op.

A rule's ``local`` implementation (vocab-split embedding, attention split on the query sequence,
loss-parallel ``nll_loss``, ...) needs this device's offsets only under some strategies; under
the others it runs the op itself (an embedding whose vocabulary is whole, attention split on the
batch). Run through a ``LocalOp`` module it still pays, every step, the module call and the rule's
checks (block shapes, offsets, causal-mask decisions): on CPU about 50 us per fused attention
call, and about 1 ms of a small GPT's ~20 ms DDP step.

``plain_call`` decides at lowering time, by running the local implementation once on fake tensors
of this device's block shapes and recording what it dispatches: when that is exactly one op whose
tensor arguments are the op's inputs themselves and whose outputs are what it returns, the program
calls that op directly, with the arguments the local implementation chose (offsets and sizes are
constants of the device). Anything else — more ops, a derived tensor, a factory op, a device
argument, a failure on fake tensors — keeps the ``LocalOp``: the probe can only make a program
call the same op with the same arguments, never a different computation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from autopar._torch_compat import FakeTensorMode, record_dispatch, tree_flatten, tree_map
from autopar.ir.rules.base import LocalCtx, run_local


@dataclass(frozen=True)
class PlainCall:
    """The op a local implementation runs on this device, with ``Input(k)`` where it reads input k."""

    target: Any
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class Input:
    """A placeholder for the op node's ``k``-th tensor input in a ``PlainCall``."""

    k: int


def plain_call(ctx: LocalCtx, shapes: Sequence[Sequence[int]]) -> Optional[PlainCall]:
    """The single op ``run_local(ctx, ...)`` runs on inputs of ``shapes`` (this device's blocks, in
    ``ctx.call.in_specs``' dtypes), or None when it does anything else."""
    calls: list[tuple[Any, tuple, dict, Any]] = []
    try:
        with FakeTensorMode(), torch.no_grad():
            probes = [torch.empty(tuple(s), dtype=spec.dtype) for s, spec in zip(shapes, ctx.call.in_specs)]
            with record_dispatch(lambda *call: calls.append(call)):
                result = run_local(ctx, probes)
    except Exception:  # noqa: BLE001 - whatever fails on fake tensors stays a LocalOp
        return None
    if len(calls) != 1:
        return None
    func, args, kwargs, out = calls[0]
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if len(result) != len(outs) or any(r is not o for r, o in zip(result, outs)):
        return None  # returns something other than the op's own outputs
    index = {id(p): k for k, p in enumerate(probes)}
    leaves, _ = tree_flatten((args, kwargs))
    for leaf in leaves:
        if isinstance(leaf, torch.device) or (isinstance(leaf, torch.Tensor) and id(leaf) not in index):
            return None  # a device baked from the fake probe, or a tensor the implementation made
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return None  # a factory op: keep the rule's own device handling
    swap = (lambda x: Input(index[id(x)]) if isinstance(x, torch.Tensor) else x)
    return PlainCall(func, tuple(tree_map(swap, list(args))), dict(tree_map(swap, dict(kwargs))))


__all__ = ["Input", "PlainCall", "plain_call"]
