"""Gradient buckets: which gradient reductions run together as one collective, as DDP and FSDP do.

A gradient whose resharding to its parameter's placement is a sequence of all-reduces,
reduce-scatters and all-gathers (DDP: all-reduces, on one axis or several; FSDP: one
reduce-scatter; on a 2-D mesh e.g. an all-reduce on one axis, then an all-gather on the other)
joins a bucket of gradients with the same sequence of collectives, axes and reductions and the
same dtype: the bucket runs one collective per step. Buckets fill in the order the backward
produces the gradients and close at ``BUCKET_SIZE`` bytes (of their first step), except that
reductions with a reduce-scatter (FSDP's) group per layer instance, as FSDP2 does. The plan's report
and the lowering both call ``grad_buckets``, so the collectives a plan predicts are the ones its
program runs. Other gradient reshardings (an all-to-all, or a local step) run alone.
"""

from __future__ import annotations

import weakref
from typing import Mapping, Optional, Sequence

from autopar.cost_model.comm import LOCAL_KINDS, Step, collective_time, reshard_steps
from autopar.cost_model.precision import element_bytes
from autopar.ir.graph import Graph
from autopar.ir.layers import layers
from autopar.ir.placement import parse

#: Bytes per bucket (DDP's default, 25 MiB).
BUCKET_SIZE = 25 * 2**20


#: The collectives a bucket can run for all its gradients at once.
BUCKETED_KINDS = ("all_reduce", "reduce_scatter", "all_gather")


def bucket_key(steps: Sequence[Step], dtype) -> Optional[tuple]:
    """The key of a gradient's bucket, or None when its resharding cannot share a collective: the
    sequence of its steps (collective, axis, reduction), all of them all-reduces, reduce-scatters
    or all-gathers (DDP over a 2-D mesh: one all-reduce of the bucket per axis)."""
    if not steps or any(s.kind not in BUCKETED_KINDS for s in steps):
        return None
    return tuple((s.kind, s.axis, s.reduce if s.kind != "all_gather" else "") for s in steps), str(dtype)


def grad_time(shape, src, dst, mesh, elem_bytes: int, layer_share: Optional[float] = None) -> float:
    """Seconds to reduce a gradient from ``src`` to its parameter's placement ``dst``. When its
    steps can be bucketed, a bucket pays each collective's latency once for all its gradients
    (DDP's reason to bucket), so a gradient pays the bandwidth term of each step and its share of
    the latency: with a reduce-scatter in a numbered layer (``layer_share``: its part of the
    layer's elements), its part of the layer's bucket (FSDP2 reduces a layer's gradients in one
    collective); otherwise in proportion to its bytes in a full bucket (the whole latency from
    ``BUCKET_SIZE`` bytes up: such a gradient fills its own bucket). Otherwise the resharding's
    own time."""
    if tuple(src) == tuple(dst):
        return 0.0
    steps = reshard_steps(shape, src, dst, mesh, elem_bytes)
    if bucket_key(steps, None) is None:
        return sum(s.time for s in steps)
    if layer_share is not None and _per_layer(steps):
        return shared_latency_time(steps, min(1.0, layer_share), mesh)
    return shared_latency_time(steps, min(1.0, steps[0].bytes / BUCKET_SIZE), mesh)


def _per_layer(steps: Sequence[Step]) -> bool:
    """Whether a bucketed gradient reduction groups per layer (FSDP's reduce-scatter) rather than
    in ``BUCKET_SIZE`` buckets (DDP's all-reduce)."""
    return any(s.kind == "reduce_scatter" for s in steps)


def shared_latency_time(steps: Sequence[Step], share: float, mesh) -> float:
    """Seconds of ``steps`` run by a collective that several tensors share: each step's bandwidth
    term and ``share`` of its latency (the whole latency at ``share`` 1)."""
    n, links = mesh.shape, mesh.links
    latency = [collective_time(s.kind, 0, n[s.axis], links[s.axis]) for s in steps]
    return sum(s.time - (1.0 - share) * lat for s, lat in zip(steps, latency))


def grad_steps(graph: Graph, fqn: str, src, dst, mesh, precision) -> list[Step]:
    """The steps that reshard parameter ``fqn``'s gradient from ``src`` to ``dst`` (its
    parameter's placement), priced at the precision's gradient bytes."""
    if tuple(src) == tuple(dst):
        return []
    spec = graph.spec(graph.grads[fqn])
    return reshard_steps(spec.shape, src, dst, mesh, element_bytes(spec.dtype, "grad", precision))


def _key(spec, steps: Sequence[Step]) -> Optional[tuple]:
    """``bucket_key``; a gradient with dims of equal blocks shares only all-reduces (a bucket's
    reduce-scatter or all-gather lays gradients out as plain splits)."""
    if spec.blocks and any(s.kind != "all_reduce" for s in steps):
        return None
    return bucket_key(steps, spec.dtype)


#: per graph: (its node count when made, the graph position of each gradient's node)
_POSITIONS: "weakref.WeakKeyDictionary[Graph, tuple[int, dict[str, int]]]" = weakref.WeakKeyDictionary()


def _grad_positions(graph: Graph) -> dict[str, int]:
    """Gradient node name -> its position in the graph, once per graph (every walk buckets)."""
    got = _POSITIONS.get(graph)
    if got is not None and got[0] == len(graph.nodes) and all(r.node in got[1] for r in graph.grads.values()):
        return got[1]
    wanted = {r.node for r in graph.grads.values()}
    where = {n.name: i for i, n in enumerate(graph.nodes) if n.name in wanted}
    _POSITIONS[graph] = (len(graph.nodes), where)
    return where


def grad_buckets(graph: Graph, steps: dict[str, Sequence[Step]],
                 stages: Optional[Mapping[str, frozenset]] = None) -> dict[str, int]:
    """``{fqn: bucket index}`` for the gradients (fqn -> their resharding steps) that can be
    bucketed, in the order the backward produces them; indices count buckets in the order they
    open. Reductions with a reduce-scatter (FSDP) group per layer instance (``ir.layers.layers``),
    whatever their bytes, as FSDP2 reduces a layer's gradients at once; the others, and those
    outside the numbered layers, fill ``BUCKET_SIZE`` buckets. With ``stages`` (a pipelined plan:
    fqn -> the stages that read it), gradients of different stages never share a bucket: each
    pipeline rank runs its own stages' reductions, as the pipeline price charges them."""
    where = _grad_positions(graph)
    keys = {fqn: _key(graph.spec(graph.grads[fqn]), st) for fqn, st in steps.items()}
    order = sorted((fqn for fqn, key in keys.items() if key is not None),
                   key=lambda f: (where[graph.grads[f].node], f))
    open_bucket: dict[tuple, tuple[int, int]] = {}  # (key, layer) -> (bucket index, bytes so far)
    out: dict[str, int] = {}
    count = 0
    membership = layers(graph)
    for fqn in order:
        nbytes = steps[fqn][0].bytes
        layer = membership.of(graph.params[fqn]) if _per_layer(steps[fqn]) else None
        key = (keys[fqn], layer, stages.get(fqn) if stages is not None else None)
        cur = open_bucket.get(key)
        if cur is None or (layer is None and cur[1] and cur[1] + nbytes > BUCKET_SIZE):
            cur = (count, 0)
            count += 1
        out[fqn] = cur[0]
        open_bucket[key] = (cur[0], cur[1] + nbytes)
    return out


def mark_grad_buckets(graph: Graph, reshardings: list[dict], mesh, precision,
                      stages: Optional[Mapping[str, frozenset]] = None) -> None:
    """Set ``"bucket"`` on the plan's gradient reshardings (``kind == "grad"``) that share a
    collective, exactly as the lowering groups them (``stages``: see ``grad_buckets``)."""
    steps: dict[str, list[Step]] = {}
    entry_of: dict[str, dict] = {}
    for r in reshardings:
        if r["kind"] != "grad" or not r["consumer"].startswith("param:"):
            continue
        fqn = r["consumer"][len("param:"):]
        steps[fqn] = grad_steps(graph, fqn, parse(r["from"], ndim=mesh.ndim), parse(r["to"], ndim=mesh.ndim),
                                mesh, precision)
        entry_of[fqn] = r
    for fqn, b in grad_buckets(graph, steps, stages).items():
        entry_of[fqn]["bucket"] = b


def collective_calls(reshardings: list[dict]) -> list[tuple[str, str, str, int, bool]]:
    """The collectives one device runs per step for a plan's reshardings, one entry per call:
    ``(what moves, collective, axis, bytes, bucketed)``. Local steps move nothing; gradients that
    share a bucket, and parameter gathers that share a group (``cost_model.gathers``), are one call
    per bucket or group and step, of their summed bytes."""
    calls: list[tuple[str, str, str, int, bool]] = []
    bucketed: dict[tuple[str, int], list] = {}  # (kind, bucket or group index) -> its steps
    for r in reshardings:
        if r.get("bucket") is not None:
            b = bucketed.setdefault((r["kind"], r["bucket"]), [[s["kind"], s["axis"], 0] for s in r["steps"]])
            for entry, st in zip(b, r["steps"]):
                entry[2] += int(st["bytes"])
            continue
        calls.extend((r["kind"], st["kind"], st["axis"], int(st["bytes"]), False)
                     for st in r["steps"] if st["kind"] not in LOCAL_KINDS)
    calls.extend((kind, coll, axis, nbytes, True) for (kind, _), steps in bucketed.items()
                 for coll, axis, nbytes in steps)
    return calls


__all__ = ["BUCKETED_KINDS", "BUCKET_SIZE", "bucket_key", "collective_calls", "grad_buckets", "grad_steps", "grad_time", "mark_grad_buckets",
           "shared_latency_time"]
