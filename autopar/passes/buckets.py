"""Gradient buckets: which gradient reductions run together as one collective, as DDP and FSDP do.

A gradient whose resharding to its parameter's placement is one reduce-scatter on one mesh axis
(FSDP) or all-reduces only (DDP, on one axis or several) joins a bucket of gradients with the same
collectives, axes, reductions and dtype; buckets fill in the order the backward produces the gradients and
close at ``BUCKET_SIZE`` bytes. The plan's report and the lowering both call ``grad_buckets``, so
the collectives a plan predicts are the ones its program runs. Other gradient reshardings (several
steps, or an all-to-all) run alone.
"""

from __future__ import annotations

from typing import Optional, Sequence

from autopar.cost_model.comm import Step
from autopar.ir.graph import Graph

#: Bytes per bucket (DDP's default, 25 MiB).
BUCKET_SIZE = 25 * 2**20


def bucket_key(steps: Sequence[Step], dtype) -> Optional[tuple]:
    """The key of a gradient's bucket, or None when its resharding cannot share a collective:
    one reduce-scatter, or all-reduces on one or more axes (DDP over a 2-D mesh: one all-reduce
    of the bucket per axis)."""
    if len(steps) == 1 and steps[0].kind == "reduce_scatter":
        s = steps[0]
        return (("reduce_scatter", s.axis, s.reduce),), str(dtype)
    if steps and all(s.kind == "all_reduce" for s in steps):
        return tuple(("all_reduce", s.axis, s.reduce) for s in steps), str(dtype)
    return None


def grad_buckets(graph: Graph, items: dict[str, tuple[Optional[tuple], int]]) -> dict[str, int]:
    """``{fqn: bucket index}`` for the gradients ``items`` (fqn -> (bucket key, bytes of its first
    step)) that can be bucketed; indices count buckets in the order they fill."""
    where = {n.name: i for i, n in enumerate(graph.nodes)}
    order = sorted((fqn for fqn, (key, _) in items.items() if key is not None),
                   key=lambda f: (where[graph.grads[f].node], f))
    open_bucket: dict[tuple, tuple[int, int]] = {}  # key -> (bucket index, bytes so far)
    out: dict[str, int] = {}
    count = 0
    for fqn in order:
        key, nbytes = items[fqn]
        cur = open_bucket.get(key)
        if cur is None or (cur[1] and cur[1] + nbytes > BUCKET_SIZE):
            cur = (count, 0)
            count += 1
        out[fqn] = cur[0]
        open_bucket[key] = (cur[0], cur[1] + nbytes)
    return out


def mark_grad_buckets(graph: Graph, reshardings: list[dict], mesh, precision) -> None:
    """Set ``"bucket"`` on the plan's gradient reshardings (``kind == "grad"``) that share a
    collective, exactly as the lowering groups them."""
    from autopar.cost_model.comm import reshard_steps
    from autopar.cost_model.precision import element_bytes
    from autopar.ir.placement import parse

    items: dict[str, tuple[Optional[tuple], int]] = {}
    entry_of: dict[str, dict] = {}
    for r in reshardings:
        if r["kind"] != "grad" or not r["consumer"].startswith("param:"):
            continue
        fqn = r["consumer"][len("param:"):]
        spec = graph.spec(graph.grads[fqn])
        steps = reshard_steps(spec.shape, parse(r["from"], ndim=mesh.ndim), parse(r["to"], ndim=mesh.ndim), mesh,
                              element_bytes(spec.dtype, "grad", precision))
        key = bucket_key(steps, spec.dtype)
        items[fqn] = (key, steps[0].bytes if key else 0)
        entry_of[fqn] = r
    for fqn, b in grad_buckets(graph, items).items():
        entry_of[fqn]["bucket"] = b


__all__ = ["BUCKET_SIZE", "bucket_key", "grad_buckets", "mark_grad_buckets"]
