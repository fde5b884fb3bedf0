"""Fold: group the repeated layers of a graph so later passes work on one instance only.

Which nodes make up a layer instance, and which instances agree node by node, is ``ir.layers``'s
one membership rule (the same one the cast policy and the parameter-gather groups use): instances
are anchored by their numbered parameters, and the ops run between them (in the layer's module or
in the parent's ``forward``) belong to them, backward ops following their forward op. Agreeing
instances have the same strategies and costs, so the plan gives every instance the same strategy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.ir.graph import Graph
from autopar.ir.layers import layers


@dataclass
class LayerGroup:
    """``instances[i]`` lists the node names of layer ``indices[i]`` in graph order; all have one shape,
    except that an instance may lack some of the first's gradient accumulations (``ir.agreement``):
    ``lacking[pos]`` counts the instances without a node at position ``pos`` of the first."""

    prefix: str
    indices: list[int]
    instances: list[list[str]]
    lacking: dict[int, int] = field(default_factory=dict)

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
        """How many nodes ``name`` stands for (the instances of its group that have its position;
        1 outside layers)."""
        loc = self.where.get(name)
        if loc is None:
            return 1
        group = self.groups[loc[0]]
        return group.count - group.lacking.get(loc[2], 0)


def fold(graph: Graph) -> Folding:
    """Group the graph's agreeing layer instances (``ir.layers.layers``); a prefix whose instances
    all differ is left unfolded."""
    found = layers(graph)
    folding = Folding()
    for prefix in sorted(found.alike):
        indices = list(found.alike[prefix])
        instances = [list(found.instances[(prefix, i)]) for i in indices]
        g = len(folding.groups)
        group = LayerGroup(prefix, indices, instances)
        folding.groups.append(group)
        for inst, (i, names) in enumerate(zip(indices, instances)):
            at = found.positions.get((prefix, i), range(len(names)))
            for pos, n in zip(at, names):
                folding.where[n] = (g, inst, pos)
            for pos in set(range(len(instances[0]))) - set(at):
                group.lacking[pos] = group.lacking.get(pos, 0) + 1
    return folding


def no_folding() -> Folding:
    """A folding with no groups: every node stands for itself (tests; models without layers)."""
    return Folding()
