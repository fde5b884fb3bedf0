"""Lowering of reshardings: one placement to another, as the collectives and local steps
``cost_model.comm.reshard_steps`` chose. Functions of the lowering's emitter (``emitter.Emitter``),
kept apart so ``emitter.py`` holds the op-by-op emission. A tensor with dims of equal blocks
(``TensorSpec.blocks``) is resharded as its expanded view, where those dims are plain."""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autopar.cost_model.casting import transfer_bytes
from autopar.cost_model.comm import reshard_steps
from autopar.ir.graph import Ref, Role
from autopar.cost_model.balanced import has_balanced, lowering_steps, permute_dest
from autopar.ir.placement import B, Balanced, Partial, Placements, Split, chunk_range, expand_blocks, local_shape, zigzag
from autopar.program import collectives as C


def wait_for(n: fx.Node, where: fx.Graph) -> fx.Node:
    """A ``wait`` on collective ``n``'s result, in program ``where`` (the schedule moves it to first use)."""
    return where.call_function(C.wait, (n,))


def identity(reduce: str) -> float:
    """The reduction's identity: what a device that holds no addend holds."""
    return {"sum": 0.0, "max": -math.inf, "min": math.inf}[reduce]


def reshard(em, x: fx.Node, ref: Ref, src: Placements, dst: Placements, where: fx.Graph) -> fx.Node:
    """``x`` (``ref``'s value placed ``src``) placed ``dst``: the resharding's steps, one collective
    or local step each, waited at once (``schedule`` moves the waits later)."""
    if tuple(src) == tuple(dst):
        return x
    spec = em.g.spec(ref)
    role = "gather" if ref.node in em.params else ("grad" if em.g.role(ref) == Role.GRADIENT else "activation")
    eb = transfer_bytes(em.g, ref, role, em.res.precision, em.priced)
    if has_balanced(src, dst):
        return reshard_balanced(em, x, spec, src, dst, eb, where)
    steps = reshard_steps(spec.shape, src, dst, em.res.mesh, eb)
    shape, final = spec.shape, dst
    if spec.blocks:  # dims of equal blocks: reshard the expanded tensor, where they are plain dims
        shape, src_x = expand_blocks(spec.shape, src, spec.blocks)
        x = where.call_method("reshape", (x, list(local_shape(shape, src_x, em.mesh_shape, em.coords))))
        src, dst = src_x, expand_blocks(spec.shape, dst, spec.blocks)[1]
    cur = list(src)
    for step in steps:
        if step.axes:  # one all-to-all over several axes' combined group
            x = _joint_step(em, x, shape, cur, step.axes, dst, where)
            continue
        a = step.axis
        new = B if step.kind == "all_gather" else dst[a]
        x = _step(em, x, shape, cur, a, new, step.kind, step.reduce, where)
        cur[a] = new
    assert tuple(cur) == tuple(dst), (cur, dst)
    if spec.blocks:  # back to the tensor's own dims (blocks cut evenly: the plain split's local shape)
        x = where.call_method("reshape", (x, list(local_shape(spec.shape, final, em.mesh_shape, em.coords))))
    return x


def _step(em, x, shape, cur, a, new, kind, reduce, where: fx.Graph) -> fx.Node:
    """One step on mesh axis ``a``: ``cur[a]`` becomes ``new`` (``shape``: the whole tensor's)."""
    m, c = em.mesh_shape, em.coords
    seen = list(cur)
    seen[a] = B
    group_block = local_shape(shape, seen, m, c)  # the tensor as axis a's group sees it
    after = list(cur)
    after[a] = new
    mine = local_shape(shape, after, m, c)
    call = where.call_function
    if kind == "all_gather":
        d = cur[a].dim
        return wait_for(call(C.all_gather, (x, a, d, group_block[d])), where)
    if kind == "reduce_scatter":
        d = new.dim
        return wait_for(call(C.reduce_scatter, (x, a, d, reduce, mine[d])), where)
    if kind == "all_reduce":
        out = wait_for(call(C.all_reduce, (x, a, reduce)), where)
        if isinstance(new, Partial) and c[a] != 0:  # P(x) -> P(y): keep one addend
            return fill_like(out, new, where)
        return out
    if kind == "all_to_all":
        i, j = cur[a].dim, new.dim
        return wait_for(call(C.all_to_all, (x, a, i, j, group_block[i], mine[j])), where)
    if kind == "slice":
        d = new.dim
        start, length = chunk_range(group_block[d], m[a], c[a])
        piece = call(torch.ops.aten.slice.Tensor, (x, d, start, start + length))
        return where.call_method("contiguous", (piece,))  # a device holds its block densely
    if kind == "zero":  # B -> P: one device keeps the value, the others hold the reduction's identity
        if c[a] == 0 or new.reduce in ("max", "min"):
            return x
        return fill_like(x, new, where)
    if kind == "pad":  # S(d) -> P: each device's block in place, the reduction's identity elsewhere
        d = cur[a].dim
        start, length = chunk_range(group_block[d], m[a], c[a])
        full = call(torch.ops.aten.new_full.default, (x, list(group_block), identity(new.reduce)))
        return call(torch.ops.aten.slice_scatter.default, (full, x, d, start, start + length))
    from autopar.errors import LoweringError

    raise LoweringError(f"no lowering for reshard step {kind!r}")

def _joint_step(em, x, shape, cur, axes: tuple[int, ...], dst, where: fx.Graph) -> fx.Node:
    """``cur[a] = S(i)`` on every axis of ``axes`` becomes ``dst[a] = S(j)`` by one all-to-all over
    their combined group (``cost_model.comm.joint_step`` checked it is exact); updates ``cur``."""
    m, c = em.mesh_shape, em.coords
    seen, after = list(cur), list(cur)
    for a in axes:
        seen[a], after[a] = B, dst[a]
    group_block = local_shape(shape, seen, m, c)  # the tensor as the combined group sees it
    mine = local_shape(shape, after, m, c)
    i, j = cur[axes[0]].dim, dst[axes[0]].dim
    n = math.prod(m[a] for a in axes)
    if group_block[i] % n or group_block[j] % n:  # a dim of equal blocks, cut unevenly once expanded
        from autopar.errors import LoweringError

        raise LoweringError(f"an all-to-all over mesh axes {axes} would cut dims {i} and {j} of a {list(group_block)} "
                            f"block unevenly over {n} devices, where nested splits and the group's pieces differ")
    for a in axes:
        cur[a] = dst[a]
    return wait_for(where.call_function(C.all_to_all, (x, tuple(axes), i, j, group_block[i], mine[j])), where)


def fill_like(x: fx.Node, p: Partial, where: fx.Graph) -> fx.Node:
    """A program node holding a tensor shaped like ``x`` filled with ``value`` (a reduction's identity)."""
    return where.call_function(torch.ops.aten.full_like.default, (x, identity(p.reduce)))


# -- the balanced split ``Z`` (``cost_model.balanced`` chose the steps) ------------------------


def reshard_balanced(em, x: fx.Node, spec, src: Placements, dst: Placements, eb: int, where: fx.Graph) -> fx.Node:
    """``x`` resharded where either side lays an axis out balanced (``Z``): the ordinary steps on the
    tensor as ``S`` sees it, and the balanced conversions (permutes, local reorders and slices)."""
    shape, final = spec.shape, dst
    if spec.blocks:  # dims of equal blocks (never the balanced one): the expanded tensor, where they are plain
        shape, src = expand_blocks(spec.shape, src, spec.blocks)
        x = where.call_method("reshape", (x, list(local_shape(shape, plain(src), em.mesh_shape, em.coords))))
        dst = expand_blocks(spec.shape, dst, spec.blocks)[1]
    cur = tuple(src)
    for step, after in lowering_steps(shape, src, dst, em.res.mesh, eb):
        a, n, r = step.axis, em.mesh_shape[step.axis], em.coords[step.axis]
        if step.kind == "permute":
            if after[a] != cur[a]:  # a conversion's last step: its permutes run here, together
                x = _convert(where, x, cur[a].dim, a, n, r, type(after[a]) is Balanced)
        elif step.kind == "zigzag_slice":
            d, size = after[a].dim, local_shape(shape, plain(cur), em.mesh_shape, em.coords)[after[a].dim]
            c = size // (2 * n)
            front = where.call_function(torch.ops.aten.slice.Tensor, (x, d, r * c, (r + 1) * c))
            back = where.call_function(torch.ops.aten.slice.Tensor, (x, d, (2 * n - 1 - r) * c, (2 * n - r) * c))
            x = where.call_function(torch.cat, ([front, back], d))
        elif step.kind == "unorder":  # gathered in the balanced order: back to the tensor's
            x = where.call_function(zigzag, (x, cur[a].dim, n, True))
        elif step.kind == "reorder":  # addends reordered, so that the reduce-scatter after lands balanced
            x = where.call_function(zigzag, (x, dst[a].dim, n))
        else:
            new = B if step.kind == "all_gather" else plain(after)[a]
            x = _step(em, x, shape, plain(cur), a, new, step.kind, step.reduce, where)
        cur = after
    if spec.blocks:
        x = where.call_method("reshape", (x, list(local_shape(spec.shape, plain(final), em.mesh_shape, em.coords))))
    return x


def plain(placements) -> list:
    """``placements`` with ``S`` for ``Z``: the geometry of the reordered tensor the ordinary steps see."""
    return [Split(p.dim) if type(p) is Balanced else p for p in placements]


def _convert(where: fx.Graph, x: fx.Node, d: int, a: int, n: int, r: int, to_balanced: bool) -> fx.Node:
    """This device's block along ``d`` from ``S`` to ``Z`` (``to_balanced``) or back on axis ``a``:
    its two chunks sent by parity, each to the rank that holds it in the other layout."""
    pieces = where.call_method("chunk", (x, 2, d))
    front = where.call_function(operator.getitem, (pieces, 0))
    back = where.call_function(operator.getitem, (pieces, 1))
    if to_balanced:  # rank r holds chunks 2r (even) and 2r+1 (odd); it gets r and 2n-1-r
        even, odd = front, back
    else:  # rank r holds chunks r and 2n-1-r: one even, one odd
        even, odd = (front, back) if r % 2 == 0 else (back, front)
    got = [where.call_function(C.permute, (where.call_method("contiguous", (part,)), a, permute_dest(to_balanced, n, p)))
           for p, part in ((0, even), (1, odd))]
    if to_balanced:
        parts = got if r % 2 == 0 else got[::-1]
    else:
        parts = got  # chunks 2r, 2r+1
    return where.call_function(torch.cat, (parts, d))
