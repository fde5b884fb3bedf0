"""Cost: price every strategy of every node and every resharding between them, as a ``Problem``.

Reads the graph, its folding, the candidate strategies and the hints; writes a ``Problem``
(``passes/search/problem.py``). Folded layers are priced once and carry their multiplicity.
A parameter's optimizer step on the block this device stores (memory-bound,
``cost_model.compute.optimizer_time``) is priced as its node's ``comm``: the per-strategy time that
nothing hides (it runs after the backward, when no gather or reduction can hide under it); the
plan's ``comm_time`` therefore includes it (a few percent of a step at most).
Memory per device: each parameter's stored weights, gradient and optimizer state under its
placement, and every forward activation that the backward reads (live at the peak, between
forward and backward; not the parameters' layout views, which the backward derives again), each
storage once and whole (a saved view keeps its base alive: ``ir.views.storage_shares``), in the
precision's bytes. Edges are grouped into transfers (``_edges``):
one resharding of a tensor to a placement serves all its consumers that need that placement.
A parameter's gradient made as a partial sum (data-parallel weight gradients) counts at its
producer's placement too: its reduction waits for the end of the backward (``cost_model.liveness``),
so every layer's unreduced gradient is alive there at once, beside the saved activations.
A forward value the backward reads and a forward consumer reads resharded is kept resharded too
(the lowering saves the forward's copy): the edge's ``saved`` bytes, per target placement. Beside it, per strategy, each
op's transient bytes (``PNode.transient``: what it makes or reads that nothing saves), which the
memory-fitting search adds once a walked plan is over the budget (``passes.search.peak``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

from autopar.cost_model.buckets import grad_time
from autopar.cost_model.casting import cast_policy, transfer_bytes, transfer_role
from autopar.cost_model.comm import reshard_time
from autopar.cost_model.compute import compute_time, optimizer_time
from autopar.cost_model.experts import exchange_time, expert_axis
from autopar.cost_model.fusion import fused_ops
from autopar.cost_model.gathers import gather_shares, gather_time
from autopar.cost_model.memory import activation_bytes, param_state_bytes
from autopar.cost_model.mesh import Mesh
from autopar.cost_model.precision import Precision
from autopar.cost_model.ring import causal_split_factor, ring_time
from autopar.ir.graph import Graph, Phase, Ref, Role
from autopar.ir.layers import layers
from autopar.ir.placement import B, Partial, Placements, format_placements, local_shape
from autopar.ir.rules import op_call
from autopar.ir.rules.ring import ring_axis
from autopar.ir.views import ALIASES, param_views, storage_shares
from autopar.passes.search.fold import Folding
from autopar.passes.search.problem import MEMORY_KINDS, Group, PEdge, PNode, Problem
from autopar.passes.search.strategies import Constraint, HintError, input_placement, output_placement


def _local_shapes(specs, placements_per_tensor, mesh: Mesh):
    zero = (0,) * mesh.ndim
    return [None if s is None else local_shape(s.shape, p, mesh.shape, zero) for s, p in zip(specs, placements_per_tensor)]


def _transient(graph: Graph, n, s, in_specs, saved: set, views: set, mesh: Mesh, precision: Precision) -> float:
    """Bytes op ``n`` holds at strategy ``s`` beside the persistent memory while it runs
    (``PNode.transient``): its outputs nothing saves for the backward (a view's share its base) and
    the values it reads that are neither saved, parameters nor inputs, at the placements it reads them."""
    total = 0.0
    if n.op not in ALIASES:
        for j, spec in enumerate(n.outputs):
            if spec is not None and Ref(n.name, j) not in saved:
                total += activation_bytes(spec.shape, spec.dtype, output_placement(s, j), mesh, precision)
    for k, (r, spec) in enumerate(zip(n.inputs, in_specs)):
        if r not in saved and r.node not in views and not graph.node(r.node).is_placeholder:
            total += activation_bytes(spec.shape, spec.dtype, input_placement(s, k), mesh, precision)
    return total


def build_problem(
    graph: Graph,
    mesh: Mesh,
    folding: Folding,
    strategies: dict[str, list],
    precision: Precision,
    memory_budget: float,
    constraints: Optional[list[Constraint]] = None,
    compiled: bool = False,
) -> Problem:
    """The problem over the representative nodes of ``folding`` (every node when nothing folds);
    ``compiled`` prices pointwise chains as the fused kernels of a compiled program
    (``cost_model.fusion``)."""
    hw = mesh.hardware
    fused = fused_ops(graph) if compiled else {}
    users_backward: set[Ref] = set()
    for n in graph.nodes:
        if n.phase == Phase.BACKWARD:
            users_backward.update(r for r in n.inputs if graph.node(r.node).phase == Phase.FORWARD)
    param_node = {name: fqn for fqn, name in graph.params.items()}
    # parameters' layout views are derived again in the backward (the lowering never saves them)
    views = param_views(graph)
    # the model's other outputs (``Graph.extras``) live until the step returns them, as saved values do
    users_backward.update(r for r in graph.extras if graph.node(r.node).phase == Phase.FORWARD)
    # what a saved value's storage adds (a view keeps its whole base; two views of one base, one storage)
    shares = storage_shares(graph, [r for r in users_backward if r.node not in views])
    # parameters' gradients as the backward makes them: a partial one is reduced after the backward's
    # ops (or held by its collective to their end), so every layer's unreduced block is alive at once
    unreduced = set(graph.grads.values())
    # the layers' backward begins at the first backward op of a folded layer: before it (the
    # forward, the loss) no layer gradient exists (``PNode.head``, ``PNode.deferred``)
    layers_back = min((i for i, n in enumerate(graph.nodes) if n.phase == Phase.BACKWARD and n.name in folding.where),
                      default=len(graph.nodes))

    # Overlap groups: (layer group or outside, phase). Parameter gathers for forward use run under
    # that phase's forward compute (issued a layer ahead); gradient reductions under the backward.
    # A gather cannot hide under compute that comes after its use, hence the split by phase.
    groups = []
    for name, mult in [("<outside layers>", 1)] + [(g.prefix, g.count) for g in folding.groups]:
        groups += [Group(f"{name} (forward)", mult), Group(f"{name} (backward)", mult)]
    nodes: list[PNode] = []
    index: dict[str, int] = {}
    for at, n in enumerate(graph.nodes):
        rep = folding.representative(n.name)
        if rep != n.name:
            continue
        strats = strategies[n.name]
        loc = folding.where.get(n.name)
        group = 2 * (0 if loc is None else loc[0] + 1) + (n.phase == Phase.BACKWARD)
        pn = PNode(n.name, strats, folding.multiplicity(n.name), group, [], [], {k: [] for k in MEMORY_KINDS},
                   transient=[])
        in_specs = [graph.spec(r) for r in n.inputs]
        call = None if n.is_placeholder else op_call(graph, n)
        unreduced_here = any(Ref(n.name, j) in unreduced for j in range(len(n.outputs)))
        if unreduced_here:
            pn.pending = []
        for s in strats:
            mem = dict.fromkeys(MEMORY_KINDS, 0.0)
            pending = 0.0
            step = 0.0  # what runs exposed: a parameter's optimizer step, an expert exchange
            if n.is_placeholder:
                place = output_placement(s, 0)
                if n.name in param_node:
                    state = param_state_bytes(n.out.shape, place, mesh, precision)
                    for k in ("params", "grads", "optimizer"):
                        mem[k] = float(state[k]) if graph.training or k == "params" else 0.0
                    # the optimizer updates the block this device stores (priced below, as comm)
                    step = optimizer_time(state, hw) if graph.training and n.out.dtype.is_floating_point else 0.0
                elif n.outputs[0] is not None and n.roles[0] != Role.TANGENT:
                    kind = "params" if n.roles[0] == Role.BUFFER else "activations"
                    mem[kind] = float(activation_bytes(n.out.shape, n.out.dtype, place, mesh, precision))
                pn.compute.append(0.0)
            else:
                ins = _local_shapes(in_specs, [input_placement(s, i) for i in range(len(in_specs))], mesh)
                outs = _local_shapes(n.outputs, [output_placement(s, j) if n.outputs[j] is not None else None
                                                 for j in range(len(n.outputs))], mesh)
                ring = ring_axis(s)
                pn.compute.append(compute_time(call, ins, outs, hw, precision, fused.get(n.name))
                                  * causal_split_factor(call, s, mesh.shape) if ring is None else
                                  ring_time(call, s, ins, outs, mesh.shape[ring[0]], mesh.link(ring[0]), hw, precision))
                if expert_axis(s) is not None:  # dropless experts: the busiest device's rows, moved and run
                    eb = activation_bytes((1,), in_specs[0].dtype, (B,) * mesh.ndim, mesh, precision)
                    step, grow = exchange_time(s, [sp.shape for sp in in_specs[:2]],
                                               [input_placement(s, i) for i in range(2)],
                                               n.outputs[0].shape, output_placement(s, 0), eb, mesh)
                    pn.compute[-1] *= grow
                for j, spec in enumerate(n.outputs):
                    r = Ref(n.name, j)
                    if spec is not None and r in users_backward and n.name not in views:
                        mem["activations"] += shares[r] * activation_bytes(spec.shape, spec.dtype, output_placement(s, j),
                                                                           mesh, precision)
                    elif spec is not None and r in unreduced and any(isinstance(p, Partial) for p in output_placement(s, j)):
                        # a partial gradient awaits its reduction to the backward's end (``cost_model.liveness``)
                        pending += activation_bytes(spec.shape, spec.dtype, output_placement(s, j), mesh, precision)
                pn.transient.append(_transient(graph, n, s, in_specs, users_backward, views, mesh, precision))
            if n.is_placeholder:
                pn.transient.append(0.0)
            if unreduced_here:
                pn.pending.append(float(pending))
            # a parameter's optimizer step runs after the backward, under nothing (see the docstring);
            # an expert exchange blocks the grouped product that reads it
            pn.comm.append(step)
            for k in MEMORY_KINDS:
                pn.memory[k].append(mem[k])
        index[n.name] = len(nodes)
        pn.head = n.phase == Phase.FORWARD or at < layers_back
        if loc is not None and graph.training:  # a layer's gradients: made in the layers' backward
            pn.deferred = [g + (pn.pending[s] if pn.pending else 0.0) for s, g in enumerate(pn.memory["grads"])]
        nodes.append(pn)

    _apply_constraints(graph, nodes, index, folding, constraints or [])
    edges = _edges(graph, mesh, folding, nodes, index, precision, users_backward)
    _loss_sink(graph, mesh, folding, nodes, index, precision)
    return Problem(nodes, edges, groups, memory_budget, hw.overlap_slowdown)


def _apply_constraints(graph, nodes, index, folding, constraints: list[Constraint]) -> None:
    for c in constraints:
        name = folding.representative(c.ref.node)
        pn = nodes[index[name]]
        ok = [i for i, s in enumerate(pn.strategies) if output_placement(s, c.ref.index) == c.placements]
        if pn.allowed is not None:
            ok = [i for i in ok if i in pn.allowed]
        if not ok:
            why = ("a split would cut its equal blocks unevenly" if graph.node(c.ref.node).is_placeholder
                   else "the op's sharding rule does not produce that placement")
            raise HintError(f"{c.source}: {graph.user_name(c.ref)} cannot be placed {format_placements(c.placements)}: "
                            f"{why} (or another hint excludes it)")
        pn.allowed = ok


def _edges(graph: Graph, mesh: Mesh, folding: Folding, nodes, index, precision,
           saved: frozenset = frozenset()) -> list[PEdge]:
    """Every (producer output -> consumer input) of the graph, aggregated onto representatives and
    grouped into *transfers* (``PEdge.share``): the edges along which one resharding of one tensor
    to one placement is done once and shared by every consumer that needs that placement.

    A transfer is one tensor of the representative problem (a producer output, with its kind and,
    for parameter gathers, the consumers' phase) over one *class* of producer instances: the
    instances whose tensors feed the same set of edges. Its multiplicity (each edge's ``mult``) is
    the number of producer instances in the class, not the number of consuming instances:

    - inside a folded layer, each instance's tensor feeds that instance's consumers: ``mult`` = L;
    - a layer's output consumed by the next instance (L-1 producer instances) and by an op after
      the layers (the last instance) forms two classes, priced apart;
    - a tensor produced once outside the layers and consumed by every instance of a layer at one
      placement is resharded once (``mult`` 1), and the result serves every instance — as the
      lowering does (one resharding per tensor, target placement and phase).

    Activations resharded in forward are saved for the backward (the lowering does so), so an
    activation's transfer spans both phases; parameter gathers are done again in the backward
    (as FSDP does), so a parameter's transfers are per phase. A transfer's overlap group is that of
    its first edge (its first consumer in graph order for gathers; the producer's for gradients)."""
    kinds: dict[tuple, tuple[str, Ref]] = {}
    # (src rep, out, kind, phase or None) -> producer instance -> the edge keys it feeds
    feeds: dict[tuple, dict] = defaultdict(lambda: defaultdict(set))
    params = param_views(graph)
    shares = gather_shares(graph)  # a gather's part of its layer group's latency
    # a gradient's part of its layer's (FSDP: reduce-scatter) bucket: its parameter's part of the layer
    membership = layers(graph)
    grad_share = {g.node: shares[graph.params[fqn]] for fqn, g in graph.grads.items()
                  if membership.of(graph.params[fqn]) is not None and graph.params[fqn] in shares}
    policy = cast_policy(graph, precision)  # the dtype each value moves in (the lowering casts alike)

    def add(key: tuple, kind: str, ref: Ref, phase) -> None:
        kinds[key] = (kind, ref)
        loc = folding.where.get(ref.node)
        feeds[(key[0], key[1], kind, phase)][-1 if loc is None else loc[1]].add(key)

    rep = folding.representative
    for n in graph.nodes:
        dst = rep(n.name) if n.inputs else None
        for slot, r in enumerate(n.inputs):
            key = (rep(r.node), r.index, dst, slot)
            kind = "param" if r.node in params else "activation"
            add(key, kind, r, n.phase if kind == "param" else None)
    for fqn, g in graph.grads.items():
        add((folding.representative(g.node), g.index, folding.representative(graph.params[fqn]), -1), "grad", g, None)
    for fqn, m in getattr(graph, "mutations", {}).items():
        add((folding.representative(m.node), m.index, folding.representative(graph.buffers[fqn]), -1), "activation", m, None)

    def order(key):
        return index[key[0]], key[1], index[key[2]], key[3]

    # transfers: (the edge keys of one class, the class's producer-instance count)
    transfers: list[tuple[list[tuple], int]] = []
    for tkey in sorted(feeds, key=lambda t: (index[t[0]], t[1], t[2], str(t[3]))):
        classes: dict[frozenset, list[int]] = defaultdict(list)
        for inst, keys in feeds[tkey].items():
            classes[frozenset(keys)].append(inst)
        for keys, insts in sorted(classes.items(), key=lambda kv: min(kv[1])):
            transfers.append((sorted(keys, key=order), len(insts)))

    built: dict[tuple, tuple] = {}  # edge key -> (places, cost) (the same for every class)
    matrices: dict[tuple, list] = {}  # (grad?, shape, bytes per element, placements out, in) -> costs
    edges = []
    for share, (keys, mult) in enumerate(transfers):
        group = None
        members = []
        for key in keys:
            src_name, out, dst_name, slot = key
            kind, ref = kinds[key]
            src, dst = index[src_name], index[dst_name]
            if key not in built:
                spec = graph.spec(ref)
                role = transfer_role(kind)
                eb = transfer_bytes(graph, ref, role, precision, policy)
                src_p = [output_placement(s, out) for s in nodes[src].strategies]
                dst_p = [output_placement(s, 0) if slot == -1 else input_placement(s, slot) for s in nodes[dst].strategies]
                places_out = sorted(set(src_p), key=src_p.index)
                places_in = sorted(set(dst_p), key=dst_p.index)
                # gradients that join a bucket share its collectives' latency (cost_model/buckets.py),
                # parameter gathers their group's (cost_model/gathers.py)
                part = shares.get(ref.node) if kind == "param" else grad_share.get(ref.node) if kind == "grad" else None
                mkey = (kind, part, tuple(spec.shape), eb, tuple(places_out), tuple(places_in))
                if mkey not in matrices:  # many edges carry same-shaped tensors between the same placements
                    matrices[mkey] = [[_price(kind, spec.shape, p, q, mesh, eb, part) for q in places_in]
                                      for p in places_out]
                cost = matrices[mkey]
                # a forward value the backward reads, resharded for a forward consumer: the lowering
                # keeps the copy for the backward (``cost_model.liveness``)
                kept = None
                if kind == "activation" and ref in saved and graph.node(dst_name).phase == Phase.FORWARD:
                    kept = [[float(activation_bytes(spec.shape, spec.dtype, q, mesh, precision)) if c else 0.0
                             for q, c in zip(places_in, row)] for row in cost]
                built[key] = ([places_out.index(p) for p in src_p], [places_in.index(q) for q in dst_p],
                              places_out, places_in, cost, eb, kept)
            src_place, dst_place, places_out, places_in, cost, eb, kept = built[key]
            if group is None:  # a gather runs in its (first) consumer's layer and phase; a reduction in its producer's
                group = nodes[src].group if kind == "grad" else nodes[dst].group
            members.append(PEdge(src, out, dst, slot, src_place, dst_place, places_out, places_in, cost, mult,
                                 kind, group, ref, eb, share, saved=kept))
        if len(members) == 1 and members[0].src == members[0].dst:
            # a layer feeding the same position of the next instance, alone: a per-strategy cost
            e, pn = members[0], nodes[members[0].src]
            for s in range(len(pn.strategies)):
                pn.comm[s] += e.cost[e.src_place[s]][e.dst_place[s]] * e.mult / pn.mult
                if e.saved is not None and e.cost[e.src_place[s]][e.dst_place[s]]:
                    pn.memory["activations"][s] += e.saved[e.src_place[s]][e.dst_place[s]] * e.mult / pn.mult
            continue
        edges.extend(members)
    edges.sort(key=lambda e: (e.src, e.src_out, e.dst, e.dst_slot, e.share))
    return edges


def _price(kind: str, shape, src, dst, mesh: Mesh, eb: int, share: Optional[float]) -> float:
    """Seconds of one resharding: a gradient's in its bucket, a parameter gather's in its group,
    anything else on its own."""
    if kind == "grad":
        return grad_time(shape, src, dst, mesh, eb, share)
    if kind == "param":
        return gather_time(shape, src, dst, mesh, eb, 1.0 if share is None else share)
    return reshard_time(shape, src, dst, mesh, eb)


def _loss_sink(graph: Graph, mesh: Mesh, folding: Folding, nodes, index, precision) -> None:
    """The loss is handed to the user replicated: its reduction is part of the step."""
    if graph.loss is None:
        return
    pn = nodes[index[folding.representative(graph.loss.node)]]
    spec = graph.spec(graph.loss)
    eb = transfer_bytes(graph, graph.loss, "activation", precision, cast_policy(graph, precision))
    target: Placements = tuple(B for _ in mesh.shape)
    for s, strat in enumerate(pn.strategies):
        pn.comm[s] += reshard_time(spec.shape, output_placement(strat, graph.loss.index), target, mesh, eb)
