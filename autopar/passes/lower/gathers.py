"""Lowering of grouped parameter gathers: the gathers ``cost_model.gathers`` groups (a layer's
parameters, per phase) run as one all-gather per step on a packed buffer (``program.bucket``),
as FSDP2 does, and are cut back into each parameter's gathered block. Functions of the lowering's
emitter (``emitter.Emitter``), kept apart so ``emitter.py`` holds the op-by-op emission.

A group is emitted where the program first needs any of its members, so it runs before the first
consumer of each; ``schedule`` then issues it a layer ahead, with its packing.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch.fx as fx

from autopar.cost_model.casting import transfer_bytes
from autopar.cost_model.comm import reshard_steps
from autopar.cost_model.gathers import gather_groups
from autopar.ir.graph import Phase, Ref
from autopar.ir.placement import B, Placements, expand_blocks, local_shape
from autopar.passes.lower.reshard import wait_for
from autopar.passes.search.strategies import input_placement, output_placement
from autopar.program import bucket
from autopar.program import collectives as C

#: The key of one parameter gather: (tensor, target placements, phase value).
GatherKey = tuple[Ref, Placements, str]


def plan_groups(em) -> dict[GatherKey, list[tuple[GatherKey, list]]]:
    """For every gather that shares its collective with others: its key -> the group's members
    (key, steps) in the order the program first reads them. Found as the plan's report finds them
    (``cost_model.gathers.gather_groups``, over the graph's ops in order)."""
    g, res = em.g, em.res
    gathers, steps_of, eb, read_by = [], {}, {}, {}
    # a checkpointed layer's forward ops read their weights again in the backward
    reads = [(node, (node.phase if g.training else Phase.FORWARD).value) for node in g.ops()]
    reads += [(node, Phase.BACKWARD.value) for node in g.ops() if node.name in res.recomputed]
    for node, phase in reads:
        strat = res.strategies[node.name]
        for slot, r in enumerate(node.inputs):
            if r.node not in em.params:
                continue
            src, dst = output_placement(res.strategies[r.node], r.index), input_placement(strat, slot)
            key = (r, tuple(dst), phase)
            if tuple(src) == tuple(dst):
                continue
            if phase == Phase.BACKWARD.value and (r, tuple(dst)) in res.kept:  # served by a kept block
                continue
            read_by.setdefault(node.name, []).append(key)
            if key in steps_of:
                continue
            if r not in eb:
                eb[r] = transfer_bytes(g, r, "gather", res.precision, em.priced)
            steps_of[key] = reshard_steps(g.spec(r).shape, src, dst, res.mesh, eb[r])
            gathers.append((key, r, phase, steps_of[key]))
    members: dict[int, list] = {}
    for key, gid in gather_groups(g, gathers, eb, read_by).items():
        members.setdefault(gid, []).append((key, steps_of[key]))
    return {key: group for group in members.values() if len(group) > 1 for key, _ in group}


def grouped_gather(em, ref: Ref, want: Placements, where: fx.Graph) -> Optional[fx.Node]:
    """``ref`` gathered to ``want`` in phase ``where`` when it belongs to a group: the whole group
    is gathered now (each member cached in ``em.cache``); None when it is gathered alone."""
    phase = (Phase.FORWARD if where is em.fg else Phase.BACKWARD).value
    group = em.gather_groups.get((ref, tuple(want), phase))
    if group is None:
        return None
    sources = []
    for (r, dst, _), _ in group:
        em.ensure_emitted(r.node)
        node, home, have = em.base[r]
        if where is not home:
            node = em.import_value(node)
        entry = em.casts.entry_cast(em.g, r) if em.casts is not None else None
        if entry is not None:  # cast before the gather, as a lone gather does
            node = em.cast(node, entry, where)
        sources.append((node, have))
    steps = group[0][1]
    outs = _gather_steps(em, [s[0] for s in sources], [r for (r, _, _), _ in group], [s[1] for s in sources],
                         [dst for (_, dst, _), _ in group], steps, where)
    for ((r, dst, _), _), out in zip(group, outs):
        em.cache[(id(where), r, dst)] = out
    return em.cache[(id(where), ref, tuple(want))]


def _gather_steps(em, xs, refs, srcs, dsts, steps, where: fx.Graph) -> list[fx.Node]:
    """One all-gather per step for the whole group: the members' shards packed into one buffer
    (``bucket.pack_shards``), gathered on dim 0 and cut back (``bucket.cut_gathered``). A tensor
    with dims of equal blocks is gathered as its expanded view (as ``reshard`` does)."""
    m, c = em.mesh_shape, em.coords
    shapes, curs, finals = [], [], []
    for r, src, dst in zip(refs, srcs, dsts):
        spec = em.g.spec(r)
        shape, cur = expand_blocks(spec.shape, src, spec.blocks) if spec.blocks else (spec.shape, src)
        shapes.append(shape)
        curs.append(list(cur))
        finals.append(list(local_shape(spec.shape, dst, m, c)))
    for k, step in enumerate(steps):
        a, n = step.axis, m[step.axis]
        layouts = []
        for i, (shape, cur) in enumerate(zip(shapes, curs)):
            have = list(local_shape(shape, cur, m, c))
            d = cur[a].dim
            cur[a] = B
            size = local_shape(shape, cur, m, c)[d]
            after = finals[i] if k == len(steps) - 1 else list(local_shape(shape, cur, m, c))
            layouts.append((d, -(-size // n), have, size, after))
        pack = where.call_function(bucket.pack_shards, (list(xs), layouts))
        total = sum(piece * math.prod(s for j, s in enumerate(have) if j != d) for d, piece, have, _, _ in layouts)
        done = wait_for(where.call_function(C.all_gather, (pack, a, 0, n * total)), where)
        cut = where.call_function(bucket.cut_gathered, (done, n, layouts))
        if k < len(steps) - 1:  # cut only to be packed again: ``schedule`` keeps the chain together
            pack.meta["autopar_pack"] = cut.meta["autopar_pack"] = True
        else:
            pack.meta["autopar_pack"] = True
            cut.meta["autopar_cut"] = True
        xs = [where.call_function(operator.getitem, (cut, i)) for i in range(len(layouts))]
        if k < len(steps) - 1:
            for x in xs:
                x.meta["autopar_pack"] = True
    return xs

