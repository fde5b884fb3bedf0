"""The ``attention=`` keyword applied to a problem: each attention op (and its backward) keeps only
the strategies in the form asked on each mesh axis, and for a form whose operands must arrive split
a certain way (Ulysses: sequence-split q, k and v), their producers keep only the strategies that
produce them so. Forms are ``ir.attention_forms.FORMS``; a hard constraint like a hint.
"""

from __future__ import annotations

from typing import Mapping

from autopar.cost_model.mesh import Mesh
from autopar.errors import HintError
from autopar.ir.attention_forms import FORMS, forms_for, is_attention, matches, q_index, qkv_indices
from autopar.ir.graph import Graph, Ref
from autopar.ir.placement import Split
from autopar.passes.search.fold import Folding
from autopar.passes.search.problem import Problem
from autopar.passes.search.strategies import input_placement, output_placement

__all__ = ["apply_forms"]


def apply_forms(graph: Graph, mesh: Mesh, folding: Folding, problem: Problem,
                forms: Mapping[str, Mapping[str, str]]) -> None:
    """Restrict ``problem``'s nodes (in place) to the attention forms asked (``check_forms``' value)."""
    if not forms:
        return
    index = {n.name: i for i, n in enumerate(problem.nodes)}
    for node in graph.nodes:
        if not is_attention(node.op) or folding.representative(node.name) != node.name:
            continue
        asked = forms_for(forms, node.module_path)
        if not asked:
            continue
        pn = problem.nodes[index[node.name]]
        qi = q_index(node.op)
        for axis, name in asked.items():
            a = mesh.names.index(axis)
            form = FORMS[name]
            _keep(pn, lambda s: matches(form, s[a].tag, input_placement(s, qi)[a], None),
                  f"attention={{{axis!r}: {name!r}}}: {graph.user_name(node)} has no strategy in that form on a mesh "
                  f"axis of {mesh.shape[a]} devices (too few heads, sequence or batch to split?)")
            if form.arrives is None or qi != 0:  # the forward's operands (the backward follows)
                continue
            for slot in qkv_indices(node.op):
                ref: Ref = node.inputs[slot]
                src = problem.nodes[index[folding.representative(ref.node)]]
                _keep(src, lambda s, r=ref: _split_on(output_placement(s, r.index)[a], form.arrives),
                      f"attention={{{axis!r}: {name!r}}}: {graph.user_name(ref)}, an operand of "
                      f"{graph.user_name(node)}, cannot be produced split on dim {form.arrives} over {axis!r}")


def _split_on(p, dim: int) -> bool:
    return isinstance(p, Split) and p.dim == dim


def _keep(pn, ok, why: str) -> None:
    keep = [i for i in pn.alive() if ok(pn.strategies[i])]
    if not keep:
        raise HintError(why)
    pn.allowed = keep
