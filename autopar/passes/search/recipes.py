"""Recipes as constraints: the placements each hand-written recipe fixes, for the search to complete.

``constraints`` gives a recipe's placements for the graph's parameters and inputs, ``pinned_axes``
the axes where weights stay where they lie (Megatron's tensor axis), and ``TensorRegions`` the
activation rule of Megatron TP. The recipes themselves are described in ``autopar.recipes``.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional, Sequence

from autopar.cost_model.mesh import Mesh
from autopar.errors import RecipeError
from autopar.ir.dimflow import linked_dims
from autopar.ir.graph import Graph, Ref, TensorSpec
from autopar.ir.placement import B, Placements, Split, blocks_fit
from autopar.passes.search.strategies import unit_replicated
from autopar.validate import RECIPE_NAMES

NAMES = RECIPE_NAMES


Allowed = dict[str, list[Placements]]  # placeholder node name -> allowed placements


def _axes(mesh: Mesh, tensor_axis, needs_tensor: bool) -> tuple[list[int], Optional[int]]:
    """The data axes and the tensor axis (None when the recipe has none)."""
    if not needs_tensor:
        return list(range(mesh.ndim)), None
    t = mesh.axis(tensor_axis)
    return [a for a in range(mesh.ndim) if a != t], t


def batch_split(graph: Graph, mesh: Mesh, data_axes: Sequence[int], name: str) -> Allowed:
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


def placement_fits(spec: TensorSpec, pl: Sequence, mesh: Mesh) -> bool:
    """Whether placements ``pl`` split ``spec`` into non-empty pieces along every split dim, with
    dims of equal blocks cut evenly (``blocks_fit``)."""
    for d in {p.dim for p in pl if isinstance(p, Split)}:
        if spec.shape[d] < math.prod(n for p, n in zip(pl, mesh.shape) if isinstance(p, Split) and p.dim == d):
            return False
    return blocks_fit(spec.shape, pl, mesh.shape, spec.blocks)


def shard_dim(spec: TensorSpec, mesh: Mesh, data: Sequence[int], base: Sequence) -> Optional[int]:
    """The dim FSDP splits over the data axes, given the placements ``base`` already has (the tensor
    axis's split): dim 0 when it is free and large enough, else the largest dim that is."""
    taken = {p.dim for p in base if isinstance(p, Split)}

    def ok(d: int) -> bool:
        return d not in taken and placement_fits(spec, [Split(d) if a in data else p for a, p in enumerate(base)], mesh)

    if spec.shape and ok(0):
        return 0
    fits = [d for d in range(len(spec.shape)) if ok(d)]
    return max(fits, key=lambda d: (spec.shape[d], -d)) if fits else None


#: ``tensor_layout`` per graph (the three tensor-parallel recipes of one plan share it).
_LAYOUTS: "weakref.WeakKeyDictionary[Graph, dict[str, int]]" = weakref.WeakKeyDictionary()


def tensor_layout(graph: Graph) -> dict[str, int]:
    """Megatron's tensor-parallel weight layout, from the dataflow: ``{parameter node: dim}`` for the
    parameters split on the tensor axis (the others are replicated there).

    - a pair of weight matrices where a dim of one reaches a dim of the other (``TensorRegions.pairs``:
      ``wq``'s output features reach ``wo``'s input features through attention): the first used
      is column-parallel, the second row-parallel;
    - an embedding table looked up by the model's inputs splits its vocabulary
      (``VocabParallelEmbedding``); one looked up by computed indices (positions) is replicated;
    - a matrix of no pair with exactly one dim that does not reach the residual stream (the output
      head's vocabulary) splits along it (column-parallel, as Megatron's and torchtitan's heads);
    - a vector a column-parallel weight's split dim reaches (its bias) splits along with it;
    - everything else (norms, row-parallel biases, routers) is replicated."""
    if graph in _LAYOUTS:
        return dict(_LAYOUTS[graph])
    regions = regions_of(graph)
    layout = dict(regions.pairs())
    tables = _embedding_tables(graph)
    vocab = _token_tables(graph)
    outside = tables | set(graph.inputs.values())
    # per dataflow component (``id``), scanned once: whether it touches an input or a table, and the
    # vectors whose dim 0 it holds (a residual stream's component holds most of the graph)
    touches: dict[int, bool] = {}
    held: dict[int, list[str]] = {}

    def reaches_outside(node: str, d: int) -> bool:
        comp = regions.component(node, d)
        if id(comp) not in touches:
            touches[id(comp)] = any(ref.node in outside for ref, _ in comp)
        return touches[id(comp)]

    for node in sorted(graph.params.values()):
        spec = graph.node(node).out
        if node in layout or spec.ndim != 2:
            continue
        if node in tables:
            if node in vocab:
                layout[node] = 0
            continue
        free = [d for d in range(2) if not reaches_outside(node, d)]
        if len(free) == 1:
            layout[node] = free[0]
    vectors = {v for v in graph.params.values() if graph.node(v).out.ndim == 1}
    for node, d in sorted(layout.items()):
        if node in tables:
            continue
        comp = regions.component(node, d)
        if id(comp) not in held:
            held[id(comp)] = sorted({ref.node for ref, e in comp if ref.node in vectors and e == 0 and ref.index == 0})
        for v in held[id(comp)]:
            layout.setdefault(v, 0)
    _LAYOUTS[graph] = layout
    return dict(layout)


def _constraints(graph: Graph, mesh: Mesh, name: str, tensor_axis=-1) -> Allowed:
    tp = name in ("megatron_tp", "megatron_sp", "fsdp_tp")
    if name == "fsdp_tp" and mesh.ndim < 2:
        raise RecipeError("fsdp_tp needs a mesh with a data axis and a tensor axis (two axes or more)")
    data, t = _axes(mesh, tensor_axis, tp)
    allowed: Allowed = {}
    if graph.inputs and data:
        allowed.update(batch_split(graph, mesh, data, name))
    elif graph.inputs and t is not None:  # 1-D tensor parallel: every device sees the whole batch
        for node in graph.inputs.values():
            allowed[node] = [tuple(B for _ in mesh.shape)]
    layout = tensor_layout(graph) if t is not None else {}
    sharded_any = False
    for node in graph.params.values():
        spec = graph.node(node).out
        base: list = [B] * mesh.ndim
        if node in layout:
            base[t] = Split(layout[node])
            if placement_fits(spec, base, mesh):
                sharded_any = True
            else:  # too small to split on the tensor axis (a few heads of a tiny model)
                base[t] = B
        if name in ("fsdp", "fsdp_tp") and data:
            d = shard_dim(spec, mesh, data, base)
            if d is not None:
                for a in data:
                    base[a] = Split(d)
        allowed[node] = [tuple(base)]
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


def _token_tables(graph: Graph) -> set[str]:
    """The embedding tables whose indices come from the model's inputs (token ids), not from ops
    such as ``arange`` alone (position ids)."""
    inputs = set(graph.inputs.values())
    out = set()
    for n in graph.ops():
        if n.op != "aten.embedding.default" or len(n.inputs) < 2:
            continue
        seen, todo = set(), [n.inputs[1].node]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            todo.extend(r.node for r in graph.node(name).inputs)
        if seen & inputs:
            out.add(n.inputs[0].node)
    return out


class TensorRegions:
    """Megatron tensor parallelism splits activations on its tensor axis only between a
    column-split weight and the row-split one after it: along the dims that hold a factor of some
    weight's split dim (heads, the MLP's hidden dim, the vocabulary), never the batch, the sequence
    or the model dim of the residual stream. Left free, a completion splits the residual stream
    (a reduce-scatter and an all-gather where Megatron all-reduces: ``megatron_sp``'s shape).

    ``allowed(splits)`` (parameter node -> its split dim) gives ``{node: {output: dims}}``, the dims
    each tensor may be split along there; what every dim reaches is found in one pass
    (``dimflow.linked_dims``)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._links = linked_dims(graph)
        self._sorted: dict[int, list] = {}  # id(component) -> its keys, sorted by name

    def component(self, node: str, d: int) -> tuple:
        """The ``(tensor, dim)`` pairs dim ``d`` of ``node``'s output is linked with (unsorted; one
        object per component)."""
        key = (Ref(node, 0), d)
        return self._links.get(key, (key,))

    def reach(self, node: str, d: int) -> list:
        """Every ``(tensor, dim)`` dim ``d`` of ``node``'s output reaches through the ops (sorted)."""
        comp = self.component(node, d)
        if id(comp) not in self._sorted:
            self._sorted[id(comp)] = sorted(comp, key=lambda k: (k[0].node, k[0].index, k[1]))
        return self._sorted[id(comp)]

    def allowed(self, splits: dict[str, int]) -> dict[str, dict[int, set[int]]]:
        """The dims activations may be split along on the tensor axis, given the weights' splits."""
        out: dict[str, dict[int, set[int]]] = {}
        for node, d in sorted(splits.items()):
            for ref, dim in self.reach(node, d):
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
        # the residual stream's model dim reaches every weight: a chain that touches an input or
        # an embedding table is not a pair. A weight's dim pairs where its component holds another
        # weight's dim: one look per component, not one per pair of its weights.
        outside = tables | set(g.inputs.values())
        mat_set = set(mats)
        found: dict[str, set[int]] = {}
        paired: dict[int, bool] = {}  # id(component) -> it holds two weights' dims and touches no outside
        for p in mats:
            for d in range(2):
                comp = self.component(p, d)
                if id(comp) not in paired:
                    touches = any(ref.node in outside for ref, _ in comp)
                    weights = {ref.node for ref, _ in comp if ref.node in mat_set and not ref.index}
                    paired[id(comp)] = not touches and len(weights) > 1
                if paired[id(comp)]:
                    found.setdefault(p, set()).add(d)
        return {p: ds.pop() for p, ds in sorted(found.items()) if len(ds) == 1}


def tensor_regions(graph: Graph, name: str) -> Optional[TensorRegions]:
    """The activation rule of recipe ``name`` on its tensor axis: Megatron TP's for ``megatron_tp``;
    None (free: the residual stream may be split on the sequence, as Megatron SP and torchtitan's
    FSDP x TP split it) for the others."""
    return regions_of(graph) if name == "megatron_tp" else None


#: ``TensorRegions`` per graph, shared by ``tensor_layout`` and ``tensor_regions``.
_REGIONS: "weakref.WeakKeyDictionary[Graph, TensorRegions]" = weakref.WeakKeyDictionary()


def regions_of(graph: Graph) -> TensorRegions:
    """The graph's ``TensorRegions``, made once."""
    if graph not in _REGIONS:
        _REGIONS[graph] = TensorRegions(graph)
    return _REGIONS[graph]


def constraints(graph: Graph, mesh: Mesh, name: str, tensor_axis=-1) -> Allowed:
    """The placements recipe ``name`` prescribes for the graph's parameters and inputs."""
    if name not in NAMES:
        raise RecipeError(f"unknown recipe {name!r}; recipes are {', '.join(NAMES)}")
    if not graph.params:
        raise RecipeError(f"{name}: the model has no parameters")
    # an axis of size 1 carries nothing: the recipe's splits there read as B (the search's strategies)
    return {node: list(dict.fromkeys(unit_replicated(p, mesh.shape) for p in options))
            for node, options in _constraints(graph, mesh, name, tensor_axis).items()}


__all__ = ["NAMES", "TensorRegions", "batch_split", "constraints", "pinned_axes", "placement_fits", "shard_dim",
           "tensor_regions"]
