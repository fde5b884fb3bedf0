"""Dims made of equal blocks: where a fused projection's output is cut into q, k and v.

A fused ``qkv`` linear layer computes one ``(.., 3E)`` tensor that ``split`` cuts into three
``(.., E)`` tensors (and the backward ``cat``\\ s their gradients back). Split plainly over ``n``
devices, a device holds a run of ``3E / n`` columns that straddles q, k and v, and no device holds
whole heads of any of them: the split must be resharded. Split *block by block* (each device the
same piece of q, of k and of v, as Megatron-LM lays out its fused weights), ``split`` is local.

``mark_blocks`` finds these dims and records them in ``TensorSpec.blocks``: the seeds are the
input of a ``split`` into equal chunks and the output of a ``cat`` of equal pieces; the marking
spreads to every tensor dim that holds the same single factor in some op's ``DimMap`` (the
``addmm`` that makes the ``qkv`` output, the transpose of the weight, the weight itself, the bias,
their gradients). Every split of a marked dim is then a split block by block: the rules
(``dimmap.split_signature``) accept a split only where all tensors agree on the blocks of the
split factor, and lowering, simulation and DTensor placements cut such dims block by block.
"""

from __future__ import annotations

import dataclasses

from autopar.ir.dimflow import spread
from autopar.ir.graph import Graph, Ref

_SPLITS = ("aten.split.Tensor", "aten.split_with_sizes.default")


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _seeds(graph: Graph) -> dict[tuple[Ref, int], int]:
    """``{(tensor, dim): blocks}`` at equal splits' inputs and equal cats' outputs."""
    out: dict[tuple[Ref, int], int] = {}
    for n in graph.ops():
        if n.op in _SPLITS and n.inputs:
            spec = graph.spec(n.inputs[0])
            dim = _norm(n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0), spec.ndim)
            size = spec.shape[dim]
            if n.op == "aten.split.Tensor":
                chunk = n.args[1]
                count = size // chunk if chunk and size % chunk == 0 else 0
            else:
                sizes = list(n.args[1])
                count = len(sizes) if len(set(sizes)) == 1 else 0
            if count >= 2:
                out[(n.inputs[0], dim)] = count
        elif n.op == "aten.cat.default" and len(n.inputs) >= 2 and n.outputs[0] is not None:
            specs = [graph.spec(r) for r in n.inputs]
            dim = _norm(n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0), n.out.ndim)
            if len({s.shape for s in specs}) == 1 and specs[0].ndim == n.out.ndim:
                out[(Ref(n.name, 0), dim)] = len(specs)
    return out


def mark_blocks(graph: Graph) -> None:
    """Set ``TensorSpec.blocks`` on every tensor dim that is cut into equal blocks (see above).

    A dim reached with two different block counts is left plain (then no op can split it block by
    block, which is merely the plain behaviour); so is a parameter whose gradient disagrees."""
    seeds = _seeds(graph)
    if not seeds:
        return
    # a parameter and its gradient (a buffer and its new value) are laid out alike
    partners: dict[Ref, list[Ref]] = {}
    for fqn, r in list(graph.grads.items()) + list(graph.mutations.items()):
        holder = graph.params.get(fqn) or graph.buffers.get(fqn)
        if holder is not None:
            partners.setdefault(Ref(holder, 0), []).append(r)
            partners.setdefault(r, []).append(Ref(holder, 0))
    marks, conflict = spread(graph, seeds, whole=True, partners=partners)
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    for (ref, d), c in sorted(marks.items(), key=lambda kv: (order[kv[0][0].node], kv[0][0].index, kv[0][1])):
        node = graph.node(ref.node)
        spec = node.outputs[ref.index]
        if (ref, d) in conflict or spec is None or spec.shape[d] % c:
            continue
        node.outputs[ref.index] = dataclasses.replace(spec, blocks=tuple(sorted(spec.blocks + ((d, c),))))
    for a, others in partners.items():  # a conflict on one side only: both plain there
        for b in others:
            sa, sb = graph.spec(a), graph.spec(b)
            if sa.blocks != sb.blocks:
                common = tuple(x for x in sa.blocks if x in sb.blocks)
                for r in (a, b):
                    node = graph.node(r.node)
                    node.outputs[r.index] = dataclasses.replace(node.outputs[r.index], blocks=common)
