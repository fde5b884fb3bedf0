"""Sequence parallelism in the export's projection: where the tensor-parallel layers' residual stream
(the norms, the residual adds) runs split along the sequence on the tensor axis, as Megatron's
sequence parallelism and torchtitan's Llama layout run it.

The module styles that say it: each norm under ``SequenceParallel`` with its output gathered once
(``PrepareModuleOutput``, Shard(1) -> Replicate: one all-gather for the layer's column-parallel
Linears, one reduce-scatter of their input gradients' partial sums in the backward), each
row-parallel Linear reduce-scattering its output to the positions (``RowwiseParallel(output_layouts=
Shard(1))``), the token embedding's output cut to this rank's positions (``PrepareModuleOutput``,
Replicate -> Shard(1), no communication). The output head stays replicated (``EXIT``) or is split on
the vocabulary (``VOCAB``), the model's own cross-entropy then computed on the split logits under
``loss_parallel``. ``sequence_modules`` finds those modules; ``residual_placements`` and
``loss_placements`` say the same op by op for the planner's evaluator: the residual stream's ops
split along dim 1 on the tensor axis, the loss's reductions over the classes partial there.
"""

from __future__ import annotations

from typing import Optional

import torch

from autopar.ir.graph import Graph
from autopar.ir.placement import Partial, Split, parse
from autopar.passes.search.strategies import output_placement

#: the roles of ``Styles.sequence``'s modules: a norm in a layer (its output gathered for the
#: column-parallel Linears after it), the last norm (its output gathered for the head), the token
#: embedding (its output cut to the positions), the output head replicated (``EXIT``) or split on
#: the vocabulary with the loss computed on the split logits (``VOCAB``: torch's ``loss_parallel``)
NORM, FINAL, ENTRY, EXIT, VOCAB = "norm", "final", "entry", "exit", "vocab"


def _leaf_params(module: torch.nn.Module) -> list:
    return list(module.parameters(recurse=False))


def _is_norm(module: torch.nn.Module) -> bool:
    """A module holding vectors only, and no submodule with parameters: a norm's scale (and shift)."""
    params = _leaf_params(module)
    return bool(params) and all(p.dim() == 1 for p in params) and not any(
        any(True for _ in c.parameters()) for c in module.children())


def sequence_modules(model: torch.nn.Module, units: list[str], linear: dict[str, str]) -> tuple[dict, str]:
    """``({module path: role}, why not)``: the modules sequence parallelism sets, or ``({}, reason)``
    when the model's shape does not let module styles say it. It does when every parameter of the
    layers (``units`` other than the root) lies in a norm or a split Linear, and outside them there
    is one embedding (the entry) and one replicated Linear (the head, the exit), the rest norms."""
    layers = [u for u in units if u]
    if not layers or not linear:
        return {}, "no tensor-parallel layers"
    out: dict[str, str] = {}
    entry, head = [], []
    for path, module in model.named_modules():
        if not _leaf_params(module):
            continue
        inside = any(path == u or path.startswith(u + ".") for u in layers)
        if _is_norm(module):
            out[path] = NORM if inside else FINAL
        elif inside and path not in linear:
            return {}, f"{path} in a layer is neither a norm nor split on the tensor axis"
        elif not inside and isinstance(module, torch.nn.Embedding):
            entry.append(path)
        elif not inside and isinstance(module, torch.nn.Linear) and path not in linear:
            head.append(path)
        elif not inside:
            return {}, f"{path} outside the layers is neither the embedding, a norm nor the output head"
    if len(entry) != 1 or len(head) != 1:
        return {}, (f"{len(entry)} embeddings and {len(head)} output heads outside the layers "
                    "(sequence parallelism is exported for one of each)")
    out[entry[0]], out[head[0]] = ENTRY, EXIT
    return dict(sorted(out.items())), ""


def _module_of(nodes: list[dict]) -> dict[str, str]:
    return {n["name"]: n.get("module", "") for n in nodes}


def token_split(nodes: list[dict], sequence: dict[str, str], t: int) -> bool:
    """Whether the plan (its ``nodes``) splits the norms' activations along the tokens (dim 0 or 1,
    the batch or the sequence) on mesh axis ``t``: the residual stream sequence parallelism splits."""
    for n in nodes:
        if sequence.get(n.get("module", "")) in (NORM, FINAL) and n.get("phase") == "forward":
            for text in n.get("outputs", []):
                places = parse(text) if text else ()
                if len(places) > t and isinstance(places[t], Split) and places[t].dim in (0, 1):
                    return True
    return False


def residual_placements(problem, graph: Graph, nodes: list[dict], sequence: dict[str, str], units: list[str],
                        linear: dict[str, str], t: int) -> dict[str, list[tuple]]:
    """The completion's constraints that say sequence parallelism op by op: the ops of the norms
    and those of the layers themselves (the residual adds) split along dim 1 on mesh axis ``t``
    where their output can be (never a partial sum elsewhere); the entry's and the exit's ops
    whole on ``t`` (the embedding runs replicated, the head on its gathered input)."""
    module = _module_of(nodes)
    layers = {u for u in units if u}
    # the residual stream's shapes: those of the norms' forward ops; the root's ops of these shapes
    # (the backward's sums of the residual gradients) run on the positions too
    shapes = {graph.node(n["name"]).out.shape for n in nodes if n.get("phase") == "forward"
              and sequence.get(n.get("module", "")) in (NORM, FINAL) and graph.node(n["name"]).out is not None}
    named = {x.name for x in graph.nodes}
    phase = {n["name"]: n.get("phase", "") for n in nodes}
    # the sizes of the token dims: the sequence, and the batch's rows times it (flattened for a matmul)
    tokens = {s[1] for s in shapes if len(s) == 3} | {s[0] * s[1] for s in shapes if len(s) == 3}
    out = {}
    for n in problem.nodes:
        m = module.get(n.name)
        role = sequence.get(m) if m is not None else None
        places = [p for p in dict.fromkeys(output_placement(s, 0) for s in n.strategies) if p is not None]
        spec = graph.node(n.name).out if n.name in named else None
        if role in (NORM, FINAL) or m in layers or (m == "" and spec is not None and spec.shape in shapes):
            ok = [p for p in places if p[t] == Split(1) and not any(isinstance(q, Partial) for q in p)]
        elif linear.get(m) == "rowwise" and phase.get(n.name) == "backward" and spec is not None:
            # the gradient a row-parallel Linear receives is gathered once (the reduce-scatter's
            # backward), then read whole by both its gradient products, each on this rank's
            # features: no token split and no partial sum there
            ok = [p for p in places if not isinstance(p[t], Partial)
                  and not (isinstance(p[t], Split) and spec.shape[p[t].dim] in tokens)]
        elif role == VOCAB and m == "":
            continue
        elif role in (ENTRY, EXIT):
            ok = [p for p in places if not isinstance(p[t], (Split, Partial))]
        else:
            continue
        if ok and len(ok) < len(places):
            out[n.name] = ok
    return out


def loss_head(graph: Graph, model: torch.nn.Module, head: str) -> str:
    """Why the output head at ``head`` cannot be split on the vocabulary with the loss computed on
    the split logits, or "" when it can: the model's forward returns its loss tensor alone, computed
    by one cross-entropy (a log-softmax then an nll loss, unweighted, of 2-D logits) whose classes
    the head's output features are. ``loss_parallel`` handles exactly that op pair on DTensor logits."""
    tree = graph.output_tree
    if tree is not None and tree.kind != "loss":
        return "the model's forward returns more than its loss tensor (the export returns the loss alone)"
    nll = [n for n in graph.ops() if n.op == "aten.nll_loss_forward.default"]
    if len(nll) != 1:
        return f"the model's forward computes {len(nll)} nll losses (one cross-entropy is exported split)"
    call = nll[0]
    if len(call.inputs) > 2 or graph.node(call.inputs[0].node).outputs[call.inputs[0].index].ndim != 2:
        return "its cross-entropy is weighted or not over 2-D logits"
    module = model.get_submodule(head)
    if head + ".weight" not in graph.params or not isinstance(module, torch.nn.Linear):
        return f"{head} is not an nn.Linear"
    if graph.node(call.inputs[0].node).outputs[call.inputs[0].index].shape[1] != module.out_features:
        return f"the cross-entropy's classes are not {head}'s output features"
    return ""


def loss_placements(problem, graph: Graph, nodes: list[dict], head: str, t: int) -> dict[str, list[tuple]]:
    """The completion's constraints that say ``loss_parallel`` op by op: between the vocabulary-split
    head and the nll loss, each reduction over the classes (the log-softmax's maximum and sum, the
    picked logits) leaves partial results on mesh axis ``t``, all-reduced, where the logits are never
    gathered; in the backward the loss's gradient stays split on the classes."""
    module = _module_of(nodes)
    after, todo = set(), [n["name"] for n in nodes if n.get("module") == head and n.get("phase") == "forward"]
    users: dict[str, list[str]] = {}
    for n in graph.ops():
        for r in n.inputs:
            users.setdefault(r.node, []).append(n.name)
    while todo:
        name = todo.pop()
        if name not in after:
            after.add(name)
            todo.extend(users.get(name, []))
    nll = [n for n in graph.ops() if n.op == "aten.nll_loss_forward.default"]
    before, todo = set(), [n.name for n in nll]
    while todo:
        name = todo.pop()
        if name not in before and name in after:
            before.add(name)
            todo.extend(r.node for r in graph.node(name).inputs)
    classes = graph.node(nll[0].inputs[0].node).outputs[nll[0].inputs[0].index].shape[1] if nll else None
    phase = {n["name"]: n.get("phase", "") for n in nodes}
    out = {}
    for n in problem.nodes:
        spec = graph.node(n.name).out if n.name in before or module.get(n.name) == "" else None
        if phase.get(n.name) == "backward" and spec is not None and spec.ndim == 2 and spec.shape[1] == classes:
            # the loss's gradient stays on this rank's classes (loss_parallel's backward is local)
            ok = [p for p in dict.fromkeys(output_placement(s, 0) for s in n.strategies)
                  if p is not None and p[t] == Split(1)]
            if ok:
                out[n.name] = ok
            continue
        if n.name not in before or module.get(n.name) == head:
            continue
        node = graph.node(n.name)
        ins = [graph.node(r.node).outputs[r.index] for r in node.inputs]
        if node.out is None or tuple(node.out.shape[1:]) not in ((), (1,)) or not any(
                i is not None and i.ndim == 2 and i.shape[1] == classes for i in ins):
            continue  # not a reduction over the classes
        places = [p for p in dict.fromkeys(output_placement(s, 0) for s in n.strategies) if p is not None]
        ok = [p for p in places if isinstance(p[t], Partial)]
        if ok and len(ok) < len(places):
            out[n.name] = ok
    return out


class SequenceRegions:
    """Megatron's activation rule (``recipes.TensorRegions``) on the tensor axis, with the residual
    stream's nodes also allowed their sequence split (dim 1)."""

    def __init__(self, regions, residual: set[str]) -> None:
        self.graph: Graph = regions.graph
        self._regions, self._residual = regions, residual

    def allowed(self, splits: dict[str, int]) -> dict[str, dict[int, set[int]]]:
        out = self._regions.allowed(splits)
        for name in self._residual:
            out.setdefault(name, {}).setdefault(0, set()).add(1)
        return out


def why_not(reason: str, axis: str) -> Optional[str]:
    """The note saying sequence parallelism is not exported, and why."""
    return f"no sequence parallelism on {axis!r}: {reason}" if reason else None


__all__ = ["ENTRY", "EXIT", "FINAL", "NORM", "VOCAB", "SequenceRegions", "loss_head", "loss_placements",
           "residual_placements", "sequence_modules", "token_split", "why_not"]
