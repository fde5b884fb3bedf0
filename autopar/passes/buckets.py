"""Gradient buckets: which gradient reductions run together as one collective, as DDP and FSDP do.

A gradient whose resharding to its parameter's placement is one all-reduce or one reduce-scatter
on one mesh axis (the DDP and FSDP cases) joins a bucket of gradients with the same collective,
axis, reduction and dtype; buckets fill in the order the backward produces the gradients and
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
    """The key of a gradient's bucket, or None when its resharding cannot share a collective."""
    if len(steps) != 1 or steps[0].kind not in ("all_reduce", "reduce_scatter"):
        return None
    s = steps[0]
    return (s.kind, s.axis, s.reduce, str(dtype))


def grad_buckets(graph: Graph, items: dict[str, tuple[Optional[tuple], int]]) -> dict[str, int]:
    """``{fqn: bucket index}`` for the gradients ``items`` (fqn -> (bucket key, bytes)) that can be
    bucketed; indices count buckets in the order they fill."""
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


__all__ = ["BUCKET_SIZE", "bucket_key", "grad_buckets"]
