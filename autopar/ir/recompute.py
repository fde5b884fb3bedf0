"""Which values a checkpointed layer instance keeps and which forward ops it re-runs in the backward.

One rule for the planner's prices and the lowering's program ("priced = executed"). For one layer
instance (``ir.layers``'s membership) and a mode:

- ``"full"``: the instance keeps only what leaves it (its forward values that any op outside the
  instance reads: the residual stream the next instance starts from); every forward op of the
  instance whose value the backward needs is re-run, from those kept values and the instance's
  inputs;
- ``"selective"``: as torchtitan's op-level policy: also keep the outputs of attention ops and of
  every other matmul (the 1st, 3rd, ... in forward order), so the re-run stops at them and the
  costly ops mostly do not run twice.

The instance's inputs (values made outside it: the previous instance's output, RoPE tables, masks)
are kept by their producers.
"""

from __future__ import annotations

from autopar.ir.graph import Graph, Phase, Ref
from autopar.ir.layers import Key, Layers, layers
from autopar.ir.views import param_views

#: the checkpointing modes, as ``Plan.checkpointing`` names them
MODES = ("full", "selective")

#: matmuls: selective mode keeps every other one's output (counted per instance, forward order)
MATMULS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"})
#: attention: selective mode keeps every one's outputs
ATTENTION = frozenset({
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "autopar.random_attention.default",
})


def instance_plan(graph: Graph, membership: Layers, key: Key, mode: str) -> tuple[frozenset[Ref], frozenset[str]]:
    """``(kept, recomputed)`` for instance ``key`` checkpointed in ``mode``: the instance's forward
    values it keeps for the backward, and the names of its forward ops the backward re-runs."""
    if mode not in MODES:
        raise ValueError(f"checkpointing mode {mode!r}: expected one of {MODES}")
    names = membership.instances[key]
    inside = set(names)
    views = param_views(graph)  # the backward derives parameters' views again in any case
    forward = [graph.node(n) for n in names if graph.node(n).phase == Phase.FORWARD
               and not graph.node(n).is_placeholder and n not in views]
    made = {n.name for n in forward}
    kept: set[Ref] = set()
    needed: set[Ref] = set()  # forward values of the instance the backward reads
    for n in graph.nodes:
        for r in n.inputs:
            if r.node not in made:
                continue
            if n.name not in inside:  # leaves the instance: kept (the next instance starts from it)
                kept.add(r)
            elif n.phase == Phase.BACKWARD:
                needed.add(r)
    policy: set[Ref] = set()  # the values selective mode keeps besides the boundary
    if mode == "selective":
        matmuls = 0
        for n in forward:
            if n.op in MATMULS:
                matmuls += 1
            if n.op in ATTENTION or (n.op in MATMULS and matmuls % 2 == 1):
                policy.update(Ref(n.name, j) for j, o in enumerate(n.outputs) if o is not None)
    # what the re-run must make: the needed values not kept, and recursively what they are made from
    stop = kept | policy
    redo: set[str] = set()
    todo = sorted((r for r in needed if r not in stop), key=lambda r: (r.node, r.index))
    while todo:
        r = todo.pop()
        if r.node in redo:
            continue
        redo.add(r.node)
        todo.extend(x for x in graph.node(r.node).inputs if x.node in made and x not in stop)
    # a policy value is kept only when the backward or the re-run reads it
    reads = {x for n in redo for x in graph.node(n).inputs} | needed
    kept |= {r for r in policy if r in reads}
    return frozenset(kept), frozenset(redo)


def recomputed_ops(graph: Graph, checkpointing: dict[str, str]) -> frozenset[str]:
    """Every forward op the backward re-runs for ``checkpointing`` (``Plan.checkpointing``: module
    path of each recomputed layer instance -> mode); a ValueError names a path that is no layer
    instance of ``graph`` or an unknown mode."""
    if not checkpointing or not graph.training:  # (no backward: nothing to recompute)
        return frozenset()
    membership = layers(graph)
    paths = {(f"{prefix}.{i}" if prefix else str(i)): (prefix, i) for prefix, i in membership.instances}
    out: set[str] = set()
    for path, mode in sorted(checkpointing.items()):
        if path not in paths:
            known = ", ".join(sorted(paths)[:4]) or "none"
            raise ValueError(f"the plan checkpoints {path!r}, which is not a layer instance of this model "
                             f"(instances: {known} ...)")
        if mode not in MODES:
            raise ValueError(f"the plan checkpoints {path!r} in mode {mode!r}: expected one of {MODES}")
        out |= instance_plan(graph, membership, paths[path], mode)[1]
    return frozenset(out)


__all__ = ["ATTENTION", "MATMULS", "MODES", "instance_plan", "recomputed_ops"]
