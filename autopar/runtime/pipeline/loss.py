"""The whole batch's loss from micro-batch losses: each micro-batch's weight in the step's loss.

A pipelined step runs the model's program once per micro-batch, at the micro-batch's shape, so each
run returns its micro-batch's loss. The step's loss must be the single-device model's loss of the
whole batch. For a mean over samples of equal count, that is the mean of the micro-batch losses
(weight ``1/m`` each). A cross-entropy mean with ``ignore_index`` targets (or class weights) is a
sum over the counted targets divided by their count (``nll_loss_forward``'s total weight, which
capture rewrites as ``div(sum, total_weight)``, ``ir.capture.normalize_mean_losses``): when
micro-batches count different numbers of targets, the mean of their means is not the batch's mean.

``loss_weights`` gives, per micro-batch, the factor its loss is multiplied by so that the weighted
sum is the whole batch's loss, and the gradient of that sum the whole batch's gradient (the weights
are constants of the step, computed from the targets before the schedule runs):

- the loss is a cross-entropy mean (``div`` of the sum by the total weight of one
  ``nll_loss_forward``): ``total_weight_i / sum_j total_weight_j`` (the micro-batch's counted
  targets, class-weighted, over the batch's);
- otherwise ``1/m``, after checking that every cross-entropy mean inside the loss counts the same
  total weight in every micro-batch; when they differ (a loss computed from a cross-entropy mean,
  with ignored targets unevenly spread) it refuses, naming why: the mean of the micro-batch losses
  is not the whole batch's loss then, and whether some weighting is depends on what the loss does
  with the mean, which is not analysed.

The total weights are computed from the targets alone: the captured graph's ops that make the
target (and class-weight) operands of ``nll_loss_forward`` are run eagerly on each micro-batch's
inputs (cheap: no activation is computed).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx.node import map_aggregate

from autopar.errors import ArgumentError
from autopar.ir.graph import Graph, Ref

_NLL = ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")


def _mean_of(graph: Graph, ref: Ref) -> Optional[str]:
    """The ``nll_loss_forward`` node whose mean ``ref`` is (``div(sum, total_weight)`` as capture
    writes it), or None."""
    div = graph.node(ref.node)
    if div.op != "aten.div.Tensor" or len(div.inputs) != 2:
        return None
    num, den = div.args[0], div.args[1]
    if not (isinstance(num, Ref) and isinstance(den, Ref) and num.node == den.node and (num.index, den.index) == (0, 1)):
        return None
    unbind = graph.node(num.node)
    if unbind.op != "aten.unbind.int":
        return None
    stack = graph.node(unbind.inputs[0].node)
    parts = stack.args[0] if stack.op == "aten.stack.default" else None
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and all(isinstance(p, Ref) for p in parts)):
        return None
    nll = graph.node(parts[0].node)
    if nll.op not in _NLL or parts[1] != Ref(nll.name, 1) or parts[0] != Ref(nll.name, 0):
        return None
    return nll.name


def _means_in(graph: Graph, loss: Ref) -> list[str]:
    """Every cross-entropy mean the loss is computed from (the ``nll_loss_forward`` nodes)."""
    seen, todo, out = set(), [loss.node], []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        node = graph.node(name)
        if node.op in _NLL and node.args[3] == 2:  # capture made every mean a sum divided by its weight
            out.append(name)
        todo += [r.node for r in node.inputs]
    return sorted(out)


def on_device(kwargs: dict, device: Optional[torch.device]) -> dict:
    """A captured op's keyword arguments with its factory ``device=`` (the capture's CPU) replaced by
    ``device`` (None: kept as captured), as the lowering rewrites them."""
    return dict(kwargs, device=device) if device is not None and "device" in kwargs else kwargs


def _evaluate(graph: Graph, refs: list, inputs: dict[str, Any], values: dict[str, Any],
              device: Optional[torch.device] = None) -> list:
    """``refs`` (Refs or None) computed eagerly from the inputs, parameters and buffers they depend on."""
    need, todo = set(), [r.node for r in refs if isinstance(r, Ref)]
    while todo:
        name = todo.pop()
        if name not in need:
            need.add(name)
            todo += [r.node for r in graph.node(name).inputs]
    by_name = {name: key for key, name in graph.inputs.items()}
    env: dict[Ref, Any] = {}
    for n in graph.nodes:
        if n.name not in need:
            continue
        if n.is_placeholder:
            if n.name in by_name:
                v = inputs[by_name[n.name]]
                env[Ref(n.name)] = v.to(device) if device is not None and isinstance(v, torch.Tensor) else v
            elif n.name in values:
                v = values[n.name]
                env[Ref(n.name)] = v.full_tensor() if hasattr(v, "full_tensor") else v
            else:
                raise ArgumentError(f"autopar pipeline: the loss's targets read {graph.user_name(Ref(n.name))}, "
                                    "which is not an input, parameter or buffer")
            continue
        args = map_aggregate(n.args, lambda a: env[a] if isinstance(a, Ref) else a)
        kwargs = map_aggregate(n.kwargs, lambda a: env[a] if isinstance(a, Ref) else a)
        out = n.target(*args, **on_device(kwargs, device))
        for j in range(len(n.outputs)):
            env[Ref(n.name, j)] = out if len(n.outputs) == 1 else out[j]
    return [env[r] if isinstance(r, Ref) else r for r in refs]


def _total_weight(graph: Graph, nll: str, inputs: dict[str, Any], values: dict[str, Any],
                  device: Optional[torch.device] = None) -> float:
    """``nll_loss_forward``'s total weight on one micro-batch: its counted targets, class-weighted."""
    node = graph.node(nll)
    target, weight = _evaluate(graph, [node.args[1], node.args[2]], inputs, values, device)
    ignore = int(node.args[4])
    counted = target != ignore
    if weight is None:
        return float(counted.sum())
    return float((weight.detach().to(torch.float64)[torch.where(counted, target, 0)] * counted).sum())


def loss_weights(graph: Graph, micro: list[dict[str, Any]], values: dict[str, Any],
                 device: Optional[torch.device] = None) -> list[float]:
    """Per micro-batch, its loss's factor in the step's loss (see the module docstring). ``graph`` is
    the capture at the micro-batch's shape; ``micro[i]`` maps its input keys (``input:k`` / keyword)
    to micro-batch ``i``'s values; ``values`` maps parameter and buffer node names to tensors;
    ``device``: where the captured factory ops make their tensors (the values'; None: as captured)."""
    m = len(micro)
    loss = graph.loss if graph.loss is not None else graph.outputs[0]
    if loss is None or m == 1:
        return [1.0 / m] * m
    nll = _mean_of(graph, loss)
    if nll is not None:
        counts = [_total_weight(graph, nll, mb, values, device) for mb in micro]
        total = sum(counts)
        if total == 0:  # torch's mean of nothing is nan; so is every micro-batch's: keep it
            return [1.0 / m] * m
        return [c / total for c in counts]
    for name in _means_in(graph, loss):
        counts = [_total_weight(graph, name, mb, values, device) for mb in micro]
        if len(set(counts)) > 1:
            raise ArgumentError(
                f"autopar pipeline: the micro-batches count different numbers of targets in the cross-entropy "
                f"mean at {graph.node(name).where()} (total weights {counts}: ignore_index or class weights), "
                "and the loss is not that mean itself but computed from it, so the mean of the micro-batch "
                "losses is not the whole batch's loss, and autopar weighs micro-batch losses only for a loss "
                "that is one cross-entropy mean. Return the cross-entropy mean itself (add other terms outside "
                "the model), use reduction='sum' and divide by a count computed outside the model, or plan "
                "with pipeline={'microbatches': 1}")
    return [1.0 / m] * m


__all__ = ["loss_weights", "on_device"]
