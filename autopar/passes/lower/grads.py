"""Lowering of bucketed gradient reductions: the gradients ``cost_model.buckets`` groups are reduced
together, one collective per resharding step for the whole bucket (as DDP and FSDP do), and cut
back out per parameter. Functions of the lowering's emitter (``emitter.Emitter``), kept apart so
``emitter.py`` holds the op-by-op emission."""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx as fx

from autopar.cost_model.buckets import grad_buckets, grad_steps
from autopar.ir.placement import B, chunk_range, local_shape
from autopar.passes.lower.reshard import wait_for
from autopar.passes.search.strategies import output_placement
from autopar.program import bucket
from autopar.program import collectives as C


def bucketed_grads(em) -> dict[str, fx.Node]:
    """Gradients reduced together, one collective per bucket (``cost_model.buckets``)."""
    g, res = em.g, em.res
    steps_of = {}
    for fqn, r in g.grads.items():
        src, dst = em.base[r][2], output_placement(res.strategies[g.params[fqn]], 0)
        steps_of[fqn] = (grad_steps(g, fqn, src, dst, res.mesh, res.precision), src, dst)
    members: dict[int, list[str]] = {}  # in the order the backward produces them
    for fqn, b in grad_buckets(g, {f: st[0] for f, st in steps_of.items()}, em.res.grad_stages).items():
        members.setdefault(b, []).append(fqn)
    out: dict[str, fx.Node] = {}
    for b in sorted(members):
        fqns = members[b]
        if len(fqns) < 2:
            continue  # a bucket of one is the plain resharding
        steps = steps_of[fqns[0]][0]
        mark = next(reversed(em.bg.nodes), None)  # the bucket's nodes come after it
        xs = [em.grad_source(f, steps_of[f][1]) for f in fqns]
        if all(st.kind == "all_reduce" for st in steps):
            results = bucket_all_reduce(em, xs, [g.grads[f] for f in fqns], steps)
        else:
            results = bucket_steps(em, xs, [g.grads[f] for f in fqns], [steps_of[f][1] for f in fqns],
                                         [steps_of[f][2] for f in fqns], steps, mark)
        for f, node in zip(fqns, results):
            out[f] = node
    return out


def bucket_all_reduce(em, xs, refs, steps) -> list[fx.Node]:
    """One all-reduce per step (mesh axis) of the whole bucket: the gradients packed one by one into
    a flat buffer (each as soon as it is made: ``pack_as_made``), reduced in place, and cut back
    into views of their shapes."""
    call = em.bg.call_function
    shapes = [list(em.local_shape_of(r)) for r in refs]
    name = em.fresh_name("grad_bucket")
    em.root.add_module(name, bucket.Bucket())  # its buffer is kept between steps
    total, offset, done = sum(math.prod(s) for s in shapes), 0, None
    for x, shape in zip(xs, shapes):
        done = em.bg.call_module(name, (done, x, offset, total))
        done.meta["autopar_bucket_put"] = True
        offset += math.prod(shape)
    for step in steps:  # one all-reduce of the whole bucket per mesh axis
        done = wait_for(call(C.all_reduce, (done, step.axis, step.reduce, True)), em.bg)  # a fresh buffer
    parts = call(bucket.unflatten, (done, shapes))
    return [call(operator.getitem, (parts, i)) for i in range(len(shapes))]


def bucket_steps(em, xs, refs, srcs, dsts, steps, mark: Optional[fx.Node] = None) -> list[fx.Node]:
    """One collective per step for the whole bucket (reduce-scatters, all-gathers and
    all-reduces, in the steps' order). For a reduce-scatter or an all-gather, each gradient's
    changing dim is moved first and padded to equal pieces, laid out as ``[n, piece]`` rows
    (reduce-scatter) or one ``[1, piece]`` row (all-gather); the rows of every gradient side by
    side run as one collective on dim 0, and each gradient is cut back out. The nodes after
    ``mark`` that make the first step's buffer are tagged for ``pack_when_ready``."""
    call, m, c = em.bg.call_function, em.mesh_shape, em.coords
    curs = [list(s) for s in srcs]
    specs = [em.g.spec(r).shape for r in refs]
    for k, step in enumerate(steps):
        a, n = step.axis, m[step.axis]
        haves = [list(local_shape(shape, cur, m, c)) for shape, cur in zip(specs, curs)]
        if step.kind == "all_reduce":
            buf = call(torch.ops.aten.cat.default, ([em.bg.call_method("reshape", (x, [-1])) for x in xs],))
            if k == 0:
                _tag_pack(em.bg, mark, buf)
            done = wait_for(call(C.all_reduce, (buf, a, step.reduce, True)), em.bg)  # a fresh buffer
            parts = call(torch.ops.aten.split_with_sizes.default, (done, [math.prod(h) for h in haves]))
            xs = [em.bg.call_method("reshape", (call(operator.getitem, (parts, i)), h)) for i, h in enumerate(haves)]
        else:
            gather = step.kind == "all_gather"
            rows, metas = [], []
            for x, shape, have, cur, dst in zip(xs, specs, haves, curs, dsts):
                d = (cur[a] if gather else dst[a]).dim
                seen = list(cur)
                seen[a] = B
                size = local_shape(shape, seen, m, c)[d] if gather else have[d]
                piece = -(-size // n)
                t = em.bg.call_method("movedim", (x, d, 0))
                target = piece if gather else piece * n
                if have[d] != target:
                    pad = [0, 0] * (len(have) - 1) + [0, target - have[d]]
                    t = call(torch.ops.aten.constant_pad_nd.default, (t, pad, 0.0))
                rest = [have[i] for i in range(len(have)) if i != d]
                rows.append(em.bg.call_method("reshape", (t, [1 if gather else n, -1])))
                keep = size if gather else chunk_range(size, n, c[a])[1]
                metas.append((d, piece, rest, keep))
            buf = call(torch.ops.aten.cat.default, (rows, 1))
            if k == 0:
                _tag_pack(em.bg, mark, buf)
            if gather:
                done = wait_for(call(C.all_gather, (buf, a, 0, n)), em.bg)
            else:
                done = wait_for(call(C.reduce_scatter, (buf, a, 0, step.reduce, 1)), em.bg)
            parts = call(torch.ops.aten.split_with_sizes.default,
                         (done, [piece * math.prod(rest) for _, piece, rest, _ in metas], 1))
            xs = []
            for i, (d, piece, rest, keep) in enumerate(metas):
                block = em.bg.call_method("reshape", (call(operator.getitem, (parts, i)),
                                                        [piece * n if gather else piece] + rest))
                if keep != (piece * n if gather else piece):
                    block = call(torch.ops.aten.slice.Tensor, (block, 0, 0, keep))
                xs.append(em.bg.call_method("contiguous", (em.bg.call_method("movedim", (block, 0, d)),)))
        for cur, dst in zip(curs, dsts):
            cur[a] = B if step.kind == "all_gather" else dst[a]
    assert all(tuple(cur) == tuple(dst) for cur, dst in zip(curs, dsts)), (curs, dsts)
    return xs


def _tag_pack(graph: fx.Graph, mark: Optional[fx.Node], buf: fx.Node) -> None:
    """Tag the nodes after ``mark`` up to ``buf`` (a bucket's first buffer and what makes it)."""
    node = mark.next if mark is not None else next(iter(graph.nodes))
    while True:
        node.meta["autopar_bucket_pack"] = buf.name
        if node is buf:
            return
        node = node.next


def pack_when_ready(graph: fx.Graph) -> None:
    """Move each bucket's first buffer, with the nodes that make it (casts, padding, the rows'
    concatenation), to just after its last gradient is made: its collective (``schedule`` issues
    it once its buffer exists) then runs under the rest of the backward, as the cost model prices
    it, and not after the backward's last op."""
    chains: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        tag = node.meta.get("autopar_bucket_pack")
        if tag is not None:
            chains.setdefault(tag, []).append(node)
    last_input = max((n for n in graph.nodes if n.op == "placeholder"), default=None)
    for chain in chains.values():
        inside = set(chain)
        sources = [a for n in chain for a in n.all_input_nodes if a not in inside]
        after = max(sources, default=last_input)  # fx nodes compare by their place in the graph
        if after.op == "placeholder":
            after = last_input
        for node in chain:  # in program order: each reads a source or an earlier one of the chain
            if after.next is not node:
                after.append(node)
            after = node


def pack_as_made(graph: fx.Graph) -> None:
    """Move each gradient's copy into its bucket (``bucket_all_reduce``) to just after the gradient
    is made (and after the bucket's previous copy), so the gradient's own memory is freed there."""
    last_input = max((n for n in graph.nodes if n.op == "placeholder"), default=None)
    for node in [n for n in graph.nodes if n.meta.get("autopar_bucket_put")]:
        sources = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        after = max(sources)  # fx nodes compare by their place in the graph
        if after.op == "placeholder":
            after = last_input
        if after.next is not node:
            after.append(node)
