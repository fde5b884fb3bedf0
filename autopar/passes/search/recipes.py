"""Recipes as constraints: the placements each hand-written recipe fixes, for the search to complete.

``constraints`` gives a recipe's placements for the graph's parameters and inputs, ``pinned_axes``
the axes where weights stay where they lie (Megatron's tensor axis), and ``TensorRegions`` the
activation rule of Megatron TP. The recipes themselves are described in ``autopar.recipes``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from autopar.cost_model.mesh import Mesh
from autopar.errors import RecipeError
from autopar.ir.dimflow import spread
from autopar.ir.graph import Graph, Ref, TensorSpec
from autopar.ir.placement import B, Placements, Split, blocks_fit

NAMES = ("ddp", "fsdp", "megatron_tp", "megatron_sp", "fsdp_tp")


Allowed = dict[str, list[Placements]]  # placeholder node name -> allowed placements


def _axes(mesh: Mesh, tensor_axis, needs_tensor: bool) -> tuple[list[int], Optional[int]]:
    """The data axes and the tensor axis (None when the recipe has none)."""
    if not needs_tensor:
        return list(range(mesh.ndim)), None
    t = mesh.axis(tensor_axis)
    return [a for a in range(mesh.ndim) if a != t], t


def _batch_split(graph: Graph, mesh: Mesh, data_axes: Sequence[int], name: str) -> Allowed:
    """Every tensor input split on dim 0 (the batch) over the data axes."""
    out: Allowed = {}
    pieces = 1
    for a in data_axes:
        pieces *= mesh.shape[a]
    for key, node in graph.inputs.items():
        spec = graph.node(node).out
        if spec.ndim == 0:
            continue
        if spec.shape[0] < pieces:
            raise RecipeError(
                f"{name}: input {key!r} has batch {spec.shape[0]}, fewer than the {pieces} devices of the data "
                f"axes {[mesh.names[a] for a in data_axes]}; use a larger batch or another recipe"
            )
        out[node] = [tuple(Split(0) if a in data_axes else B for a in range(mesh.ndim))]
    return out


def _shard_dim(spec: TensorSpec, mesh: Mesh, data: Sequence[int]) -> Optional[int]:
    """The dim FSDP splits over the data axes: dim 0 when it is large enough, else the largest dim
    that is (a dim of equal blocks only where ``blocks_fit``)."""
    shape, pieces = spec.shape, math.prod(mesh.shape[a] for a in data)

    def ok(d: int) -> bool:
        pl = [Split(d) if a in data else B for a in range(mesh.ndim)]
        return shape[d] >= pieces and blocks_fit(shape, pl, mesh.shape, spec.blocks)

    if shape and ok(0):
        return 0
    fits = [d for d in range(len(shape)) if ok(d)]
    return max(fits, key=lambda d: (shape[d], -d)) if fits else None


def _constraints(graph: Graph, mesh: Mesh, name: str, tensor_axis=-1) -> Allowed:
    tp = name in ("megatron_tp", "megatron_sp", "fsdp_tp")
    if name == "fsdp_tp" and mesh.ndim < 2:
        raise RecipeError("fsdp_tp needs a mesh with a data axis and a tensor axis (two axes or more)")
    data, t = _axes(mesh, tensor_axis, tp)
    allowed: Allowed = {}
    if graph.inputs and data:
        allowed.update(_batch_split(graph, mesh, data, name))
    elif graph.inputs and t is not None:  # 1-D tensor parallel: every device sees the whole batch
        for node in graph.inputs.values():
            allowed[node] = [tuple(B for _ in mesh.shape)]
    sharded_any = False
    tables = _embedding_tables(graph)
    for fqn, node in graph.params.items():
        spec = graph.node(node).out
        shape = spec.shape
        base: list = [B] * mesh.ndim
        if name in ("fsdp", "fsdp_tp") and data:
            d = _shard_dim(spec, mesh, data)
            if d is not None:
                for a in data:
                    base[a] = Split(d)
        options = [tuple(base)]
        if tp and t is not None and len(shape) >= 2:
            options = []
            # an embedding table splits its vocabulary (Megatron's VocabParallelEmbedding): split
            # along the model dim, it would split the whole residual stream
            for d in ([0] if node in tables else range(len(shape))):
                if shape[d] >= mesh.shape[t] and all(not (isinstance(p, Split) and p.dim == d) for p in base):
                    pl = list(base)
                    pl[t] = Split(d)
                    if blocks_fit(shape, pl, mesh.shape, spec.blocks):
                        options.append(tuple(pl))
            if options:
                sharded_any = True
            else:
                options = [tuple(base)]
        allowed[node] = options
    if tp and not sharded_any:
        raise RecipeError(f"{name}: the model has no weight matrix that splits over the tensor axis "
                          f"{mesh.names[t]!r} (size {mesh.shape[t]})")
    if name == "megatron_sp" and t is not None:
        for key, node in graph.inputs.items():
            spec = graph.node(node).out
            if spec.ndim >= 2 and spec.shape[1] >= mesh.shape[t]:
                allowed[node] = [tuple(Split(1) if a == t else p for a, p in enumerate(pl)) for pl in allowed.get(node, [tuple(B for _ in mesh.shape)])]
    return allowed


def pinned_axes(mesh: Mesh, name: str, tensor_axis=-1) -> list[int]:
    """Mesh axes on which the recipe uses parameters where they lie: tensor parallelism computes
    with its weight shards and never gathers them (FSDP, by contrast, gathers before use)."""
    if name in ("megatron_tp", "megatron_sp", "fsdp_tp"):
        return [mesh.axis(tensor_axis)]
    return []


def _embedding_tables(graph: Graph) -> set[str]:
    """The parameter nodes read as an embedding's table."""
    return {n.inputs[0].node for n in graph.ops() if n.op == "aten.embedding.default" and n.inputs}


class TensorRegions:
    """Megatron tensor parallelism splits activations on its tensor axis only between a
    column-split weight and the row-split one after it: along the dims that hold a factor of some
    weight's split dim (heads, the MLP's hidden dim, the vocabulary), never the batch, the sequence
    or the model dim of the residual stream. Left free, a completion splits the residual stream
    (a reduce-scatter and an all-gather where Megatron all-reduces: ``megatron_sp``'s shape).

    ``allowed(splits)`` (parameter node -> its split dim) gives ``{node: {output: dims}}``, the dims
    each tensor may be split along there; the spread from each weight dim is computed once."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._spread: dict[tuple[str, int], list] = {}

    def _reach(self, node: str, d: int) -> list:
        if (node, d) not in self._spread:
            marks, _ = spread(self.graph, {(Ref(node, 0), d): True}, whole=False)
            self._spread[(node, d)] = sorted(marks, key=lambda k: (k[0].node, k[0].index, k[1]))
        return self._spread[(node, d)]

    def allowed(self, splits: dict[str, int]) -> dict[str, dict[int, set[int]]]:
        """The dims activations may be split along on the tensor axis, given the weights' splits."""
        out: dict[str, dict[int, set[int]]] = {}
        for node, d in sorted(splits.items()):
            for ref, dim in self._reach(node, d):
                out.setdefault(ref.node, {}).setdefault(ref.index, set()).add(dim)
        return out

    def pairs(self) -> dict[str, int]:
        """Megatron's pairing, from the dataflow: where a dim of one weight matrix reaches a dim of
        another (``qkv``'s output features reach ``proj``'s input features through attention),
        the first one used is split along its dim (column-parallel) and the second along the
        dim reached (row-parallel), with no collective between them. ``{parameter node: dim}``
        for the weights that pair one way only; embedding tables excluded."""
        g = self.graph
        tables = _embedding_tables(g)
        mats = sorted(v for v in g.params.values() if g.node(v).out.ndim == 2 and v not in tables)
        order = {n.name: i for i, n in enumerate(g.nodes)}
        first = {}
        for n in g.ops():
            for r in n.inputs:
                first.setdefault(r.node, order[n.name])
        # the residual stream's model dim reaches every weight: a chain that touches an input or
        # an embedding table is not a pair
        outside = tables | set(g.inputs.values())
        found: dict[str, set[int]] = {}
        for p in mats:
            for d in range(2):
                reach = self._reach(p, d)
                if any(ref.node in outside for ref, _ in reach):
                    continue
                for ref, e in reach:
                    if ref.node == p or ref.node not in mats or ref.index:
                        continue
                    (a, da), (b, db) = sorted([(p, d), (ref.node, e)], key=lambda x: first.get(x[0], 0))
                    found.setdefault(a, set()).add(da)
                    found.setdefault(b, set()).add(db)
        return {p: ds.pop() for p, ds in sorted(found.items()) if len(ds) == 1}


def tensor_regions(graph: Graph, name: str) -> Optional[TensorRegions]:
    """The activation rule of recipe ``name`` on its tensor axis (Megatron TP's; None: free)."""
    return TensorRegions(graph) if name in ("megatron_tp", "fsdp_tp") else None


def constraints(graph: Graph, mesh: Mesh, name: str, tensor_axis=-1) -> Allowed:
    """The placements recipe ``name`` prescribes for the graph's parameters and inputs."""
    if name not in NAMES:
        raise RecipeError(f"unknown recipe {name!r}; recipes are {', '.join(NAMES)}")
    if not graph.params:
        raise RecipeError(f"{name}: the model has no parameters")
    return _constraints(graph, mesh, name, tensor_axis)


__all__ = ["NAMES", "TensorRegions", "constraints", "pinned_axes", "tensor_regions"]
