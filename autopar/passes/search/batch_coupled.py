"""Ops that couple a whole batch: their result for one sample depends on the other samples.

Micro-batching (a pipeline, or gradient accumulation) runs the forward on ``B / m`` samples at a
time, so such an op computes something else than on the whole batch: batch-norm statistics over
the micro-batch, an MoE router's per-expert capacity and slot positions over the micro-batch's
tokens. The intra-op plans are exact for them (their rules gather what they need across a data
axis); a pipeline is not. ``batch_coupled`` finds them in the captured forward so the plan can say
so (``plan.pipeline.batch_coupled``, with ``reference`` "micro-batched": the single-device run it
equals is the one that runs the same micro-batches one after the other), or the user pins one
micro-batch (``pipeline={"microbatches": 1}``, GPipe).

Detected, in the forward only:

- batch normalization in training mode (statistics over the batch): ``native_batch_norm`` and its
  functional/legit forms with their ``training`` flag set (``_no_training`` forms are per-sample);
- scans, sorts and selections over a token dimension (``cumsum``, ``cummax``, ``cummin``,
  ``logcumsumexp``, ``sort``, ``argsort``, ``topk``, ``kthvalue``, ``msort``): capacity-limited
  routing numbers tokens per expert with a ``cumsum`` over all tokens, expert-choice routing takes a
  ``topk`` over them. The operated dimension is a token dimension when its size is a multiple of
  the batch rows times the sizes of the inputs' leading dimensions (``B``, ``B x S``, ...: the
  batch flattened with its sequence) and at least that, or when it is dimension 0 and a multiple of
  ``B``. A top-k over the experts of each token (token-choice routing without capacity) is not
  coupled and is not reported.
"""

from __future__ import annotations

import math

from autopar.ir.graph import Graph, Phase, Role, short_op

#: ops that scan, sort or select along one dimension, and where their dimension argument sits
#: (position in ``args``, the default when absent)
_ALONG = {"cumsum": (1, 0), "cummax": (1, 0), "cummin": (1, 0), "logcumsumexp": (1, 0), "sort": (1, -1),
          "argsort": (1, -1), "topk": (2, -1), "kthvalue": (2, -1), "msort": (None, 0)}


def _units(graph: Graph, rows: int) -> set[int]:
    """The batch rows times each product of the inputs' leading dimensions (``B``, ``B x S``, ...)."""
    out = {rows}
    for n in graph.nodes:
        if not n.is_placeholder or not n.roles or n.roles[0] != Role.INPUT:
            continue
        spec = n.outputs[0]
        if spec is None or not spec.shape or spec.shape[0] != rows:
            continue
        for k in range(2, spec.ndim + 1):
            out.add(math.prod(spec.shape[:k]))
    return {u for u in out if u > 0}


def batch_coupled(graph: Graph, rows: int) -> list[str]:
    """Forward ops of ``graph`` (captured with ``rows`` samples per batch) that couple the batch,
    as ``"module.path: op"`` strings, in graph order, each once (see the module docstring)."""
    units = _units(graph, rows)
    out: list[str] = []
    for n in graph.nodes:
        if n.phase != Phase.FORWARD or n.is_placeholder or n.op == "output":
            continue
        op = short_op(n.op)
        base = op.split(".")[0].lstrip("_")
        hit = False
        if "batch_norm" in base and "backward" not in base and "no_training" not in op:
            hit = any(a is True for a in n.args)
        elif base in _ALONG and n.inputs:
            pos, default = _ALONG[base]
            dim = n.args[pos] if pos is not None and len(n.args) > pos and isinstance(n.args[pos], int) else \
                n.kwargs.get("dim", default)
            spec = graph.spec(n.inputs[0])
            if spec is not None and spec.ndim:
                d = dim % spec.ndim
                size = spec.shape[d]
                hit = (d == 0 and size % rows == 0) or any(u > rows and size >= u and size % u == 0 for u in units)
        if hit:
            label = f"{n.module_path or '<top>'}: {op}"
            if label not in out:
                out.append(label)
    return out


__all__ = ["batch_coupled"]
