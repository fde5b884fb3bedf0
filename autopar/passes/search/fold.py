"""Fold: find the repeated layers of a graph so later passes work on one layer only.

Layers are recognised by module paths of the form ``<prefix>.<i>`` (``layers.3``, ``blocks.0``,
``model.layers.7``), forward and backward nodes alike, parameters by their FQN. Instances fold when
their node sequences are identical (op, shapes, dtypes, non-tensor arguments, module path relative
to the layer, and the producers of their inputs relative to the layer): every instance then has
the same strategies and costs, and the plan gives every instance the same strategy.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from torch.fx.node import map_aggregate

from autopar.ir.graph import Graph, Node, Ref
from autopar.ir.layers import layers as _layers


@dataclass
class LayerGroup:
    """``instances[i]`` lists the node names of layer ``i`` in graph order; all have one shape."""

    prefix: str
    indices: list[int]
    instances: list[list[str]]

    @property
    def count(self) -> int:
        """How many alike instances the group folds."""
        return len(self.instances)


@dataclass
class Folding:
    """Which nodes stand for which: the folded layer groups, and for each node in a group its
    (group, instance, position). Later passes price and choose only instance 0; every instance
    gets its strategy."""

    groups: list[LayerGroup] = field(default_factory=list)
    #: node name -> (group index, instance index, position in the instance)
    where: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    def representative(self, name: str) -> str:
        """The node of instance 0 that ``name`` stands for (itself when not in a layer)."""
        loc = self.where.get(name)
        if loc is None:
            return name
        g, _, pos = loc
        return self.groups[g].instances[0][pos]

    def multiplicity(self, name: str) -> int:
        """How many nodes ``name`` stands for (its group's instance count; 1 outside layers)."""
        loc = self.where.get(name)
        return 1 if loc is None else self.groups[loc[0]].count


def _signature(node: Node, prefix: str, index: int, members: dict[str, int]) -> tuple:
    """What must agree between instances for them to fold."""
    here = f"{prefix}.{index}" if prefix else str(index)

    def rel(path: str) -> str:
        return path[len(here):] if path.startswith(here) else "<outside>:" + path

    def ref_key(r: Ref):
        pos = members.get(r.node)
        return ("in", pos, r.index) if pos is not None else ("out", r.index)

    args = map_aggregate(node.args, lambda a: ref_key(a) if isinstance(a, Ref) else a)
    kwargs = map_aggregate(node.kwargs, lambda a: ref_key(a) if isinstance(a, Ref) else a)
    outer = tuple(ref_key(r) for r in node.inputs if r.node not in members)
    return (node.op, tuple(node.outputs), repr(args), repr(kwargs), rel(node.module_path), node.phase, len(outer))


def _instances(graph: Graph, by_layer, prefix: str) -> Optional[tuple[list[int], list[list[str]]]]:
    """The largest set of alike instances of ``prefix`` (two or more), else None. The first or
    last layer often differs (it touches the embedding or the head); the rest still fold."""
    indices = sorted(i for p, i in by_layer if p == prefix)
    alike: dict[tuple, list[int]] = defaultdict(list)
    for i in indices:
        names = by_layer[(prefix, i)]
        members = {n: k for k, n in enumerate(names)}
        alike[tuple(_signature(graph.node(n), prefix, i, members) for n in names)].append(i)
    best = max(alike.values(), key=lambda ix: (len(ix) * len(by_layer[(prefix, ix[0])]), -ix[0]), default=[])
    if len(best) < 2:
        return None
    return best, [by_layer[(prefix, i)] for i in best]


def fold(graph: Graph) -> Folding:
    """Group the graph's layer instances; a group whose instances differ is left unfolded.

    Gradient-accumulation nodes are taken into their layer when that keeps the instances alike
    (so the ILP does not grow with depth), and left outside otherwise (tied embeddings, say).
    """
    with_acc = _layers(graph, True)
    without = _layers(graph, False)
    folding = Folding()
    for prefix in sorted({p for p, _ in with_acc}):
        options = [f for f in (_instances(graph, with_acc, prefix), _instances(graph, without, prefix)) if f]
        if not options:
            continue
        found = max(options, key=lambda f: (len(f[0]) * len(f[1][0]), len(f[1][0])))
        indices, instances = found
        g = len(folding.groups)
        folding.groups.append(LayerGroup(prefix, indices, instances))
        for inst, names in enumerate(instances):
            for pos, n in enumerate(names):
                folding.where[n] = (g, inst, pos)
    return folding


def no_folding() -> Folding:
    """A folding with no groups: every node stands for itself (tests; models without layers)."""
    return Folding()
