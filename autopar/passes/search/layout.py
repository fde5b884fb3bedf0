"""A layout written outside autopar, as a recipe: the placements a DTensor ``parallelize`` function
or a torchtitan job config gives the parameters, priced by the same completion and evaluator as
the named recipes (``recipes.py``), so it compares with them and with the searched plan.

A ``Layout`` says what each mesh axis does (``roles``): ``"replicate"`` (DDP: parameters whole,
the batch split), ``"shard"`` (FSDP: parameters split, gathered before use, the batch split) or
``"tensor"`` (tensor parallelism: weights used where they lie, the batch whole). Its parameters'
placements are either given per FQN (``params``: read off a DTensor layout) or made from the roles
as the named recipes make theirs (Megatron's column/row split on the tensor axis, FSDP's dim on the
shard axes). ``recipe_*`` take a recipe name or a Layout alike, for the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

from autopar.cost_model.mesh import Mesh
from autopar.errors import RecipeError
from autopar.ir.graph import Graph
from autopar.ir.placement import B, Placements, Split, format_placements
from autopar.passes.search import recipes
from autopar.passes.search.strategies import unit_replicated

ROLES = ("replicate", "shard", "tensor")


@dataclass(frozen=True)
class Layout:
    """A user's layout as a recipe (see the module docstring). ``name`` labels it in the plan
    (``source`` ``"recipe:NAME"``, its baseline); ``sequence_parallel``: activations between blocks
    may be split on the tensor axes (torch's ``SequenceParallel``), else they follow Megatron's
    regions there."""

    name: str
    roles: tuple[str, ...]
    params: Optional[Mapping[str, Placements]] = field(default=None, compare=False)
    sequence_parallel: bool = True

    def axes(self, role: str) -> list[int]:
        """The mesh axes with ``role``."""
        return [a for a, r in enumerate(self.roles) if r == role]

    def constraints(self, graph: Graph, mesh: Mesh) -> recipes.Allowed:
        """The placements this layout gives the graph's parameters and inputs."""
        if len(self.roles) != mesh.ndim or any(r not in ROLES for r in self.roles):
            raise RecipeError(f"{self.name}: roles {list(self.roles)} must give one of {list(ROLES)} per axis of the "
                              f"mesh {mesh.axes}")
        data = [a for a, r in enumerate(self.roles) if r != "tensor"]
        allowed: recipes.Allowed = {}
        if graph.inputs and data:
            allowed.update(recipes.batch_split(graph, mesh, data, self.name))
        else:
            allowed.update({n: [tuple(B for _ in mesh.shape)] for n in graph.inputs.values()})
        params = self._given(graph) if self.params is not None else self._from_roles(graph, mesh)
        for fqn, node in graph.params.items():
            pl = params[node]
            spec = graph.node(node).out
            if len(pl) != mesh.ndim or not recipes.placement_fits(spec, pl, mesh):
                raise RecipeError(f"{self.name}: parameter {fqn!r} of shape {list(spec.shape)} cannot be placed "
                                  f"{format_placements(pl)} on the mesh {mesh.axes} (autopar splits evenly: each "
                                  f"split dim must hold every device's block)")
            allowed[node] = [unit_replicated(pl, mesh.shape)]
        return {k: list(dict.fromkeys(unit_replicated(p, mesh.shape) for p in v)) for k, v in allowed.items()}

    def _given(self, graph: Graph) -> dict[str, Placements]:
        """``params`` by graph node; a tied parameter is found under any of its names."""
        names: dict[str, list[str]] = {}
        for fqn, node in graph.params.items():
            names.setdefault(node, []).append(fqn)
        for alias, canon in graph.aliases.items():
            if canon in graph.params:
                names[graph.params[canon]].append(alias)
        out = {}
        for node, fqns in names.items():
            found = [self.params[f] for f in fqns if f in self.params]
            if not found:
                raise RecipeError(f"{self.name}: the layout places no parameter named {fqns[0]!r}; it names "
                                  f"{', '.join(sorted(self.params)[:5])}{', ...' if len(self.params) > 5 else ''}")
            out[node] = tuple(found[0])
        return out

    def _from_roles(self, graph: Graph, mesh: Mesh) -> dict[str, Placements]:
        """Placements made from the roles as the named recipes make them."""
        tensor, shard = self.axes("tensor"), self.axes("shard")
        layout = recipes.tensor_layout(graph) if tensor else {}
        out = {}
        for node in graph.params.values():
            spec = graph.node(node).out
            base: list = [B] * mesh.ndim
            if node in layout:
                trial = [Split(layout[node]) if a in tensor else B for a in range(mesh.ndim)]
                if recipes.placement_fits(spec, trial, mesh):
                    base = trial
            if shard:
                d = recipes.shard_dim(spec, mesh, shard, base)
                if d is not None:
                    base = [Split(d) if a in shard else p for a, p in enumerate(base)]
            out[node] = tuple(base)
        return out


Recipe = Union[str, Layout]


def recipe_name(recipe: Recipe) -> str:
    """The name a recipe is listed under (a named recipe's own, a Layout's ``name``)."""
    return recipe.name if isinstance(recipe, Layout) else recipe


def recipe_constraints(graph: Graph, mesh: Mesh, recipe: Recipe, tensor_axis=-1) -> recipes.Allowed:
    """``recipes.constraints`` for a named recipe, the Layout's own for a Layout."""
    if isinstance(recipe, Layout):
        if not graph.params:
            raise RecipeError(f"{recipe.name}: the model has no parameters")
        return recipe.constraints(graph, mesh)
    return recipes.constraints(graph, mesh, recipe, tensor_axis)


def recipe_pinned(mesh: Mesh, recipe: Recipe, tensor_axis=-1) -> list[int]:
    """The axes where the recipe uses weights where they lie (``recipes.pinned_axes``; a Layout's tensor axes)."""
    return recipe.axes("tensor") if isinstance(recipe, Layout) else recipes.pinned_axes(mesh, recipe, tensor_axis)


def recipe_regions(graph: Graph, recipe: Recipe) -> Optional[recipes.TensorRegions]:
    """The activation rule on the pinned axes (``recipes.tensor_regions``; a Layout without sequence
    parallelism keeps Megatron's regions)."""
    if isinstance(recipe, Layout):
        return None if recipe.sequence_parallel else recipes.regions_of(graph)
    return recipes.tensor_regions(graph, recipe)


__all__ = ["ROLES", "Layout", "Recipe", "recipe_constraints", "recipe_name", "recipe_pinned", "recipe_regions"]
