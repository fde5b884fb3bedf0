"""The ``attention=`` keyword applied to a problem: each attention op (and its backward) keeps only
the strategies in the form asked on each mesh axis, and for a form whose operands must arrive split
a certain way (Ulysses: sequence-split q, k and v), their producers keep only the strategies that
produce them so. Forms are ``ir.attention_forms.FORMS``; a hard constraint like a hint.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from autopar.cost_model.mesh import Mesh
from autopar.errors import HintError
from autopar.ir.attention import ATTN_BWD, ATTN_FWD
from autopar.ir.attention_forms import FORMS, classify, forms_for, is_attention, matches, q_index, qkv_indices
from autopar.ir.graph import Graph, Ref
from autopar.ir.placement import Split
from autopar.ir.rules.random_attention import attention_dropout
from autopar.passes.search.fold import Folding
from autopar.passes.search.problem import Problem, evaluate
from autopar.passes.search.strategies import input_placement, output_placement

__all__ = ["apply_forms", "form_report"]


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
                  f"axis of {mesh.shape[a]} devices " + _why_not(node, form))
            if form.arrives is None or qi != 0:  # the forward's operands (the backward follows)
                continue
            for slot in qkv_indices(node.op):
                ref: Ref = node.inputs[slot]
                src = problem.nodes[index[folding.representative(ref.node)]]
                _keep(src, lambda s, r=ref: _split_on(output_placement(s, r.index)[a], form.arrives),
                      f"attention={{{axis!r}: {name!r}}}: {graph.user_name(ref)}, an operand of "
                      f"{graph.user_name(node)}, cannot be produced split on dim {form.arrives} over {axis!r}")


def _why_not(node, form) -> str:
    """Why an attention op has no strategy in ``form``, as far as its call says."""
    p = attention_dropout(node.op, node.args, node.kwargs)
    if form.tag is not None and p > 0:  # ring's blocks are not the dropout mask's (``ir.rules.ring``)
        return (f"(it draws dropout, p={p}, which ring attention does not run; force 'ulysses' or 'gather' there, "
                "which keep the dropout mask the one-device program draws, or set the dropout to 0)")
    return "(too few heads, sequence or batch to split?)"


def _split_on(p, dim: int) -> bool:
    return isinstance(p, Split) and p.dim == dim


def _keep(pn, ok, why: str) -> None:
    keep = [i for i in pn.alive() if ok(pn.strategies[i])]
    if not keep:
        raise HintError(why)
    pn.allowed = keep


def form_report(graph: Graph, mesh: Mesh, folding: Folding, problem: Problem, choice: Sequence[int]) -> dict[str, list]:
    """Per module path, each attention op's form on every mesh axis that splits it and the price of
    the other forms there: ``{"op", "axis", "form", "alternatives": [{"name": form, "delta": s}]}``,
    ``delta`` the change in step time with the op (forward and backward) in that form on that axis,
    everything else held (so its operands arrive as they do now: a head split of sequence-split
    operands is Ulysses, of head-split ones tensor parallelism)."""
    base = evaluate(problem, choice).step_time
    backward = _backward_of(graph, folding)
    out: dict[str, list] = {}
    for node in graph.nodes:
        if node.op != ATTN_FWD or folding.representative(node.name) != node.name:
            continue
        i = problem.index[node.name]
        j = problem.index.get(backward.get(node.name, ""), None)
        st = problem.nodes[i].strategies[choice[i]]
        for a, axis in enumerate(mesh.names):
            arrived = _arrived(graph, folding, problem, choice, node, a)
            form = classify(st[a].tag, input_placement(st, 0)[a], arrived)
            if form is None:
                continue
            prices: dict[str, float] = {}
            for s in range(len(problem.nodes[i].strategies)):  # forced forms too: the user asked why
                other = problem.nodes[i].strategies[s]
                if s == choice[i] or any(other[b] != st[b] for b in range(len(st)) if b != a):
                    continue
                name = classify(other[a].tag, input_placement(other, 0)[a], arrived)
                if name is None or name == form:
                    continue
                for t in _matching_backward(problem, choice, j, other, a):
                    trial = list(choice)
                    trial[i] = s
                    if t is not None:
                        trial[j] = t
                    d = evaluate(problem, trial).step_time - base
                    prices[name] = min(prices.get(name, d), d)
            alts = [{"name": k, "delta": v} for k, v in sorted(prices.items(), key=lambda kv: (kv[1], kv[0]))]
            out.setdefault(node.module_path, []).append({"op": node.name, "axis": axis, "form": form,
                                                         "alternatives": alts})
    return out


def _backward_of(graph: Graph, folding: Folding) -> dict[str, str]:
    """Each attention forward node -> its backward node (the k-th of each under one module path)."""
    fwd: dict[str, list[str]] = {}
    bwd: dict[str, list[str]] = {}
    for n in graph.nodes:
        if n.op in (ATTN_FWD, ATTN_BWD) and folding.representative(n.name) == n.name:
            (fwd if n.op == ATTN_FWD else bwd).setdefault(n.module_path, []).append(n.name)
    return {f: b for path, fs in fwd.items() for f, b in zip(fs, bwd.get(path, []))}


def _arrived(graph: Graph, folding: Folding, problem: Problem, choice: Sequence[int], node, a: int):
    """How q reaches the attention op on axis ``a``: its producer's chosen output placement."""
    ref = node.inputs[0]
    k = problem.index[folding.representative(ref.node)]
    return output_placement(problem.nodes[k].strategies[choice[k]], ref.index)[a]


def _matching_backward(problem: Problem, choice: Sequence[int], j: Optional[int], fwd, a: int) -> list:
    """The backward's strategies that run the forward strategy ``fwd``'s form on axis ``a`` (the
    chosen one elsewhere); ``[None]`` without a backward."""
    if j is None:
        return [None]
    pn, chosen = problem.nodes[j], problem.nodes[j].strategies[choice[j]]
    want_tag, want_q = fwd[a].tag, input_placement(fwd, 0)[a]
    return [t for t in range(len(pn.strategies))
            if pn.strategies[t][a].tag == want_tag and input_placement(pn.strategies[t], 1)[a] == want_q
            and all(pn.strategies[t][b] == chosen[b] for b in range(len(chosen)) if b != a)] or [choice[j]]
