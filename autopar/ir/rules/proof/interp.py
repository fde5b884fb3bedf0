"""Single-process SPMD simulation: every device of a mesh, in lock step, in one process.

A tensor is *distributed* into one local block per device (``S`` slices, ``B`` copies, ``P`` random
addends) and *collected* back (concatenate, check identical, sum/max/min). ``run_op`` executes one
op's rule on every device's blocks; ``check_strategy`` compares the collected result with the op
on whole tensors, which is how every rule is proven.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from autopar.ir.placement import (Balanced, Partial, Placement, Split, balanced_as_split, check_blocks, chunk_range,
                                  expand_blocks, local_shape, zigzag)
from autopar.ir.rules.base import LocalCtx, OpCall, Strategy, as_list, run_local, substitute
from autopar.ir.rules.ring import ring_axis
from autopar.ir.rules.expert import TAG as EXPERTS
from autopar.ir.rules.proof.exchange import run_exchanging

#: Signature tags whose local code exchanges rows between devices (``LocalCtx.exchange``)
EXCHANGING = frozenset({EXPERTS})

Coords = tuple[int, ...]


def device_coords(mesh_shape: Sequence[int]) -> list[Coords]:
    """All device coordinates in row-major (rank) order."""
    return list(itertools.product(*[range(n) for n in mesh_shape]))


def _addends(t: torch.Tensor, n: int, reduce: str, gen: torch.Generator) -> list[torch.Tensor]:
    """``n`` tensors whose reduction is ``t``: random addends (not t/n, which lets nonlinear ops pass)."""
    if not (t.is_floating_point() or t.is_complex()):
        raise ValueError(f"cannot make partial addends of a {t.dtype} tensor")
    # Addends of the tensor's own magnitude: far larger ones would cancel away its low bits.
    scale = t.abs().mean().item() if t.numel() else 1.0
    scale = scale if scale > 0 else 1.0
    if reduce == "sum":
        parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) * scale for _ in range(n - 1)]
        rest = t - sum(parts) if parts else t.clone()
        return parts + [rest]
    # max/min: every device holds a value on the far side of t; one random device holds t itself.
    owner = torch.randint(0, n, t.shape, generator=gen)
    sign = -1.0 if reduce == "max" else 1.0
    out = []
    for i in range(n):
        off = (torch.rand(t.shape, generator=gen, dtype=t.dtype) + 0.1) * scale
        out.append(torch.where(owner == i, t, t + sign * off))
    return out


def _slice(t: torch.Tensor, dim: int, n: int, i: int) -> torch.Tensor:
    start, length = chunk_range(t.shape[dim], n, i)
    return t.narrow(dim, start, length).contiguous()  # a device holds its block densely


def distribute(
    t: torch.Tensor, placements: Sequence[Placement], mesh_shape: Sequence[int], gen: torch.Generator,
    blocks_of: Sequence[tuple[int, int]] = (),
) -> dict[Coords, torch.Tensor]:
    """One local block per device; nested in mesh-axis order (axis 0 first). ``blocks_of``
    (``TensorSpec.blocks``): dims split block by block; a balanced split (``Z``) is the split of the
    tensor with its chunks reordered."""
    if any(isinstance(p, Balanced) for p in placements):
        t, placements = balanced_as_split(t, placements, mesh_shape)
    if blocks_of:
        check_blocks(t.shape, placements, mesh_shape, blocks_of)
        shape, inner = expand_blocks(t.shape, placements, blocks_of)
        return {c: b.reshape(local_shape(t.shape, placements, mesh_shape, c))
                for c, b in distribute(t.reshape(shape), inner, mesh_shape, gen).items()}
    blocks: dict[Coords, torch.Tensor] = {(): t}
    for axis, p in enumerate(placements):
        n = mesh_shape[axis]
        nxt: dict[Coords, torch.Tensor] = {}
        for prefix, block in blocks.items():
            if isinstance(p, Split):
                pieces = [_slice(block, p.dim, n, i) for i in range(n)]
            elif isinstance(p, Partial):
                pieces = _addends(block, n, p.reduce, gen)
            else:
                pieces = [block] * n
            for i, piece in enumerate(pieces):
                nxt[prefix + (i,)] = piece
        blocks = nxt
    return blocks


#: Relative error allowed when comparing with the op on whole tensors, by dtype.
_TOLERANCE = {torch.float64: 1e-7, torch.complex128: 1e-7, torch.float32: 1e-4, torch.complex64: 1e-4}


class Mismatch(AssertionError):
    """Devices that should hold identical (``B``) blocks do not."""


def collect(
    blocks: dict[Coords, torch.Tensor],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    rtol: Optional[float] = None,
    blocks_of: Sequence[tuple[int, int]] = (),
    shape: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """The whole tensor from its blocks, undoing ``distribute`` from the last axis to the first.

    ``B`` blocks must agree to ``rtol`` relative to their largest value (they can differ in the
    last bits when each is a sum of different random addends). ``blocks_of`` (with the whole
    tensor's ``shape``): dims split block by block.
    """
    zs = [(p.dim, n) for p, n in zip(placements, mesh_shape) if isinstance(p, Balanced)]
    if zs:  # the split of the reordered tensor, reordered back
        plain = [Split(p.dim) if isinstance(p, Balanced) else p for p in placements]
        t = collect(blocks, plain, mesh_shape, rtol, blocks_of, shape)
        for d, n in zs:
            t = zigzag(t, d, n, inverse=True)
        return t
    if blocks_of:
        if shape is None:
            raise ValueError("collect: the whole shape is needed to undo a split by blocks")
        full, inner = expand_blocks(shape, placements, blocks_of)
        parts = {c: b.reshape(local_shape(full, inner, mesh_shape, c)) for c, b in blocks.items()}
        return collect(parts, inner, mesh_shape, rtol).reshape(tuple(shape))
    cur = dict(blocks)
    for axis in reversed(range(len(mesh_shape))):
        p = placements[axis]
        n = mesh_shape[axis]
        groups: dict[Coords, list[torch.Tensor]] = {}
        for coords in sorted(cur):
            groups.setdefault(coords[:axis], []).append(cur[coords])
        nxt = {}
        for prefix, parts in groups.items():
            assert len(parts) == n
            if isinstance(p, Split):
                nxt[prefix] = torch.cat(parts, dim=p.dim)
            elif isinstance(p, Partial):
                stacked = torch.stack(parts)
                nxt[prefix] = {"sum": stacked.sum, "max": stacked.amax, "min": stacked.amin}[p.reduce](0)
            else:
                first = parts[0]
                tol = rtol if rtol is not None else _TOLERANCE.get(first.dtype, 1e-2)
                atol = tol * (first.abs().max().item() if first.numel() and (first.is_floating_point() or first.is_complex()) else 0.0)
                for other in parts[1:]:
                    if other.shape != first.shape or not torch.allclose(other, first, rtol=tol, atol=atol, equal_nan=True):
                        raise Mismatch(f"B blocks differ between devices on mesh axis {axis}")
                nxt[prefix] = first
        cur = nxt
    return cur[()]


def run_op(
    call: OpCall,
    strategy: Strategy,
    mesh_shape: Sequence[int],
    local_inputs: dict[Coords, list[torch.Tensor]],
    offset_scale: int = 1,
) -> dict[Coords, list]:
    """Every device's outputs of one op under ``strategy`` (on a thread each, exchanging blocks or rows,
    where the strategy's local code moves them between devices)."""
    if ring_axis(strategy) is not None or any(sig.tag in EXCHANGING for sig in strategy):
        # blocks or rows pass between devices inside the op
        return run_exchanging(call, strategy, mesh_shape, local_inputs, device_coords(mesh_shape), offset_scale)
    out = {}
    for coords in device_coords(mesh_shape):
        ctx = LocalCtx(call, strategy, tuple(mesh_shape), coords, offset_scale)
        out[coords] = run_local(ctx, local_inputs[coords])
    return out


@dataclass
class CheckResult:
    """One strategy's proof: whether every device's reassembled result matched the op on whole
    tensors, and the mismatch if not."""

    ok: bool
    error: str = ""
    max_rel_err: float = 0.0


def reference(call: OpCall, inputs: Sequence[torch.Tensor]) -> list:
    """The op on whole tensors."""
    args, kwargs = substitute(call, inputs)
    return as_list(call.target(*args, **kwargs))


def check_strategy(
    call: OpCall,
    strategy: Strategy,
    mesh_shape: Sequence[int],
    inputs: Sequence[torch.Tensor],
    expected: Optional[Sequence] = None,
    seed: int = 0,
    offset_scale: int = 1,
    tol: Optional[float] = None,
) -> CheckResult:
    """Run ``strategy`` on every device's blocks of ``inputs`` and compare with the op on whole tensors.

    Integer outputs must match exactly; floating outputs to ``tol`` relative to their norm (by
    default 1e-7 in float64; random P addends cancel, so lower precisions get a looser default).
    """
    gen = torch.Generator().manual_seed(seed)
    if tol is None:  # the least precise float among inputs and outputs sets the bar
        dtypes = [t.dtype for t in inputs if t.is_floating_point() or t.is_complex()] + [
            s.dtype for s in call.out_specs if s is not None and s.is_float
        ]
        tol = max([_TOLERANCE.get(dt, 1e-2) for dt in dtypes], default=1e-7)
    if expected is None:
        expected = reference(call, inputs)
    per_input = []
    for i, t in enumerate(inputs):
        pl = tuple(sig.inputs[i] for sig in strategy)
        try:
            per_input.append(distribute(t, pl, mesh_shape, gen, call.in_specs[i].blocks))
        except (ValueError, IndexError, RuntimeError) as e:
            return CheckResult(False, f"input {i} cannot be placed {pl}: {e}")
    local_inputs = {c: [blocks[c] for blocks in per_input] for c in device_coords(mesh_shape)}
    try:
        outs = run_op(call, strategy, mesh_shape, local_inputs, offset_scale)
    except Exception as e:  # a local op that cannot run on its blocks is a wrong rule too
        return CheckResult(False, f"local op failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    worst = 0.0
    for j, exp in enumerate(expected):
        if not isinstance(exp, torch.Tensor) or call.out_specs[j] is None:
            continue
        pl = tuple(sig.outputs[j] for sig in strategy)
        try:
            spec = call.out_specs[j]
            got = collect({c: outs[c][j] for c in outs}, pl, mesh_shape, rtol=tol, blocks_of=spec.blocks,
                          shape=spec.shape)
        except Mismatch as e:
            return CheckResult(False, f"output {j}: {e}")
        except (RuntimeError, IndexError, ValueError) as e:
            return CheckResult(False, f"output {j}: blocks do not reassemble: {str(e).splitlines()[0][:200]}")
        if got.shape != exp.shape:
            return CheckResult(False, f"output {j}: shape {tuple(got.shape)} != {tuple(exp.shape)}")
        if exp.is_floating_point() or exp.is_complex():
            wide = torch.complex128 if exp.is_complex() else torch.float64  # .double() drops imaginary parts
            denom = exp.to(wide).norm().item()
            err = (got.to(wide) - exp.to(wide)).norm().item() / max(denom, 1e-30)
            if denom == 0.0:
                err = (got.to(wide) - exp.to(wide)).norm().item()
            if not err <= tol:  # also catches NaN
                return CheckResult(False, f"output {j}: relative error {err:.3g}", err)
            worst = max(worst, err)
        elif not torch.equal(got, exp):
            return CheckResult(False, f"output {j}: integer values differ")
    return CheckResult(True, "", worst)


__all__ = [
    "CheckResult",
    "Mismatch",
    "check_strategy",
    "collect",
    "device_coords",
    "distribute",
    "reference",
    "run_op",
]
