"""Pipeline stages: the model cut into segments, the segments split into stages, the schedule chosen.

``segments`` reads one solved intra-op plan (a ``Problem`` and its choice, solved on the mesh without
the pipeline axis at the micro-batch's shape) back per *segment*: what runs before the first layer
instance (embedding, values every layer reads such as RoPE tables), each layer instance in graph
order (``ir.layers``'s membership, folded or not: folded instances share their representative's
figures, so stages of alike layers share the one folded solve), and what runs after the last
(final norm, head, loss). Per segment, per micro-batch:

- forward and backward compute plus the activation reshardings that land in it (each transfer is
  charged to its first consumer's segment and phase, per instance, so the segments add up to the
  plan's compute and activation communication);
- the backward split into *input* gradients (ops whose results reach the previous segment's
  backward) and *weight* gradients (ops that only feed parameter gradients), for ZBV's ``I``/``W``;
- memory by kind (a parameter read both before and after the layers, a tied embedding and head,
  is held by both ends: each holds a copy, as torch's pipelines and Megatron keep it), a reduced
  parameter's gradient as the unreduced accumulator the stage holds through the step, and the
  largest op's transient bytes;
- per step: its parameter gathers (the forward's; the backward's regathers are dropped since the
  gathered copy is kept for the step, whose bytes are ``kept``) and its gradient reductions.

``split`` cuts the layer instances into contiguous stages minimising the slowest stage (an exact
dynamic programme over cut points, uneven where the count does not divide; the first stage pays for
the segment before the layers, the last for the one after). ``best_pipelines`` prices every schedule torch
2.13 runs that fits (``cost_model/schedules.py``'s constraints) at the given micro-batch count by
replay (``cost_model/pipeline_price.py``) and returns them cheapest first. When a candidate's ranks
recompute, the layers are split again with the recomputed instances charged their re-run
(``with_reruns``; a stage that recomputes more gets fewer layers) and the better split is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from autopar.cost_model.comm import reshard_time
from autopar.cost_model.compute import matmul_shape, row_growth
from autopar.cost_model.mesh import Mesh
from autopar.cost_model.memory import activation_bytes
from autopar.cost_model.pipeline_price import AFTER_STEP, PipelinePrice, Recompute, Segment, combine, price_pipeline
from autopar.cost_model.precision import Precision
from autopar.cost_model.schedules import SCHEDULES, check_schedule
from autopar.ir.graph import Graph, Phase, Role
from autopar.ir.layers import layers
from autopar.ir.placement import local_shape
from autopar.ir.recompute import MODES
from autopar.ir.stages import POST, PRE, chain, region_paths
from autopar.passes.search.checkpoint import Choice, GroupTerms, group_figures
from autopar.passes.search.fold import Folding
from autopar.passes.search.problem import MEMORY_KINDS, Problem, edge_cost, transfer_cost
from autopar.ir.rules import op_call
from autopar.passes.search.strategies import input_placement, output_placement



@dataclass(frozen=True)
class ModelSegments:
    """A model read back per segment: ``pre`` (before the layers), ``units`` (each layer instance, in
    order), ``post`` (after them), and ``boundary_bytes``: the activation one stage sends the next
    per micro-batch (bytes per device: what leaves the first layer instance in the forward);
    ``overlap_slowdown``: the mesh hardware's (compute slowed under hidden synchronisation)."""

    pre: Segment
    units: tuple[Segment, ...]
    post: Segment
    boundary_bytes: float
    overlap_slowdown: float = 0.0
    #: bytes alive between ops besides saved activations, state and the gradients waiting for their
    #: reduction, the most at any moment of a micro-batch (``between_ops``): one computes at a time
    temporaries: float = 0.0

    @property
    def pre_paths(self) -> list[str]:
        """The module paths that run before the layers."""
        return list(self.pre.paths)

    @property
    def unit_paths(self) -> list[str]:
        """Each layer instance's module path, in order."""
        return [p for u in self.units for p in u.paths]

    @property
    def post_paths(self) -> list[str]:
        """The module paths that run after the layers."""
        return list(self.post.paths)

    def stage_paths(self, ranges: Sequence[tuple[int, int]]) -> list[list[str]]:
        """Each stage's module paths (``ranges``: its layer instances): the first with those before the
        layers, the last with those after."""
        units = self.unit_paths
        return [(self.pre_paths if s == 0 else []) + units[a:b] + (self.post_paths if s == len(ranges) - 1 else [])
                for s, (a, b) in enumerate(ranges)]


def _weight_only(graph: Graph, region: dict[str, int], users: dict[str, list[str]]) -> set[str]:
    """Backward ops whose results reach no other segment's op (only parameter gradients and the
    graph's outputs): the weight-gradient part of their segment's backward (``users``: the graph's)."""
    outputs = {n.name for n in graph.nodes if n.op == "output"}
    crosses: dict[str, bool] = {}
    for n in reversed(graph.nodes):
        if n.phase != Phase.BACKWARD or n.is_placeholder or n.name in outputs:
            continue
        r = region.get(n.name)
        hit = False
        for u in users[n.name]:
            if u in outputs:
                continue
            if region.get(u) != r or crosses.get(u, False):
                hit = True
                break
        crosses[n.name] = hit
    return {k for k, v in crosses.items() if not v}


def segments(graph: Graph, folding: Folding, problem: Problem, choice: Sequence[int], mesh: Mesh,
             precision: Precision, terms: Sequence[GroupTerms] = ()) -> ModelSegments:
    """The plan ``choice`` of ``problem`` read back per segment (see the module docstring), each
    segment with its module paths (``ModelSegments.pre_paths``, ...). With ``terms``
    (``checkpoint.group_terms`` of ``problem``, which must be priced without recomputation), each
    layer instance also says what recomputing it would save and cost per mode (``Segment.recompute``),
    for the pipeline's per-stage recomputation."""
    found = layers(graph)
    ch = chain(graph)
    keys = list(ch.keys)
    region = ch.region
    users = graph.users()
    weight = _weight_only(graph, region, users)
    n_units = len(keys)
    fig = {r: dict.fromkeys(("forward", "input_grad", "weight_grad", "gathers", "reductions", "kept", "optimizer",
                             "forward_growth", "input_grad_growth", "weight_grad_growth"), 0.0)
           for r in [PRE, POST] + list(range(n_units))}
    data = _per_row(graph)
    mem = {r: dict.fromkeys(MEMORY_KINDS, 0.0) for r in fig}
    transient = dict.fromkeys(fig, 0.0)

    def rep(name: str) -> int:
        return problem.index[folding.representative(name)]

    def regions_of(name: str) -> list[int]:
        r = region.get(name)
        if r is None:
            return []
        return [PRE, POST] if name in ch.both else [r]

    # per representative node: its per-instance compute (and sink communication) by phase part
    per_node: dict[int, dict[str, float]] = {}
    for i, pn in enumerate(problem.nodes):
        # a parameter's comm is its optimizer step: once per step, not per micro-batch
        step = pn.comm[choice[i]] if graph.node(pn.name).is_placeholder else 0.0
        per_node[i] = {"compute": pn.compute[choice[i]] + pn.comm[choice[i]] - step, "optimizer": step,
                       "growth": _node_growth(graph, pn, choice[i], mesh, precision) if pn.name in data else 0.0}
    # transfers, charged per instance to their first consumer (a reduction to its parameter)
    extra: dict[int, dict[str, float]] = {}
    for ks in problem.transfers:
        edges = [problem.edges[k] for k in ks]
        e = edges[0]
        c = edge_cost(e, choice) if len(ks) == 1 else transfer_cost(edges, choice)
        if c <= 0:
            continue
        dst = problem.nodes[e.dst]
        share = c * e.mult / dst.mult
        slot = extra.setdefault(e.dst, {})
        kind = {"activation": "activation", "param": "param", "grad": "grad"}[e.kind]
        slot[kind] = slot.get(kind, 0.0) + share
        if kind == "activation" and problem.nodes[e.src].name in data:
            slot["growth"] = slot.get("growth", 0.0) + share * _transfer_growth(graph, edges, choice, mesh)
        if e.kind == "param" and graph.node(dst.name).phase == Phase.FORWARD:
            seen = set()
            kept = 0.0
            spec = graph.spec(e.ref)
            for ed in edges:
                q = ed.places_in[ed.dst_place[choice[ed.dst]]]
                if q not in seen:
                    seen.add(q)
                    kept += activation_bytes(spec.shape, spec.dtype, q, mesh, precision)
            slot["kept"] = slot.get("kept", 0.0) + kept * e.mult / dst.mult
    for n in graph.nodes:
        if n.op == "output":
            continue
        i = rep(n.name) if folding.representative(n.name) in problem.index else None
        if i is None:
            continue
        regs = regions_of(n.name)
        pn = problem.nodes[i]
        ex = extra.get(i, {})
        own = per_node[i]["compute"] + ex.get("activation", 0.0)
        grows = per_node[i]["growth"] + ex.get("growth", 0.0)
        part = "forward" if n.phase == Phase.FORWARD else "weight_grad" if n.name in weight else "input_grad"
        for r in regs:
            f = fig[r]
            f[part] += own
            f[part + "_growth"] += grows
            if n.phase == Phase.FORWARD:  # the backward's regathers are not run: the copy is kept
                f["gathers"] += ex.get("param", 0.0)
            f["reductions"] += ex.get("grad", 0.0)
            f["kept"] += ex.get("kept", 0.0)
            f["optimizer"] += per_node[i]["optimizer"]
            for k in MEMORY_KINDS:
                mem[r][k] += pn.memory[k][choice[i]]
            if pn.transient:
                transient[r] = max(transient[r], pn.transient[choice[i]])
    for m in mem.values():  # the gradients held once the step's reductions are done
        m[AFTER_STEP] = m["grads"]
    _accumulators(graph, problem, folding, choice, mesh, precision, regions_of, mem)

    def seg(r: int, paths: tuple[str, ...]) -> Segment:
        f, m = fig[r], mem[r]
        return Segment(f["forward"], f["input_grad"], f["weight_grad"], m["params"] + m["grads"] + m["optimizer"],
                       m["activations"], f["gathers"], f["reductions"], f["kept"], memory=dict(m), paths=paths,
                       optimizer=f["optimizer"],
                       growth=(f["forward_growth"], f["input_grad_growth"], f["weight_grad_growth"]),
                       transient=transient[r])

    unit_paths = list(ch.paths)
    pre_paths, post_paths = region_paths(graph, ch, PRE), region_paths(graph, ch, POST)
    options = _recompute_options(problem, choice, terms)
    units = tuple(replace(seg(u, (unit_paths[u],)),
                          recompute=((unit_paths[u], options[unit_paths[u]]),) if unit_paths[u] in options else ())
                  for u in range(n_units))
    boundary = 0.0
    if n_units:
        first = set(found.instances[keys[0]])
        for name in found.instances[keys[0]]:
            n = graph.node(name)
            if n.phase != Phase.FORWARD or n.is_placeholder:
                continue
            for j, spec in enumerate(n.outputs):
                if spec is None:
                    continue
                readers = [u for u in users[name] if u not in first and graph.node(u).phase == Phase.FORWARD
                           and any(r.node == name and r.index == j for r in graph.node(u).inputs)]
                if readers:
                    i = rep(name)
                    place = output_placement(problem.nodes[i].strategies[choice[i]], j)
                    boundary += activation_bytes(spec.shape, spec.dtype, place, mesh, precision)
    return ModelSegments(seg(PRE, tuple(pre_paths)), units, seg(POST, tuple(post_paths)), boundary,
                         mesh.hardware.overlap_slowdown)


def _accumulators(graph: Graph, problem: Problem, folding: Folding, choice: Sequence[int], mesh: Mesh,
                  precision: Precision, regions_of, mem: dict) -> None:
    """Each parameter's unreduced gradient block (at the placement its backward makes it, in the
    compute dtype, as ``cost_model.liveness`` holds it) in the ``grads`` of the segments that hold
    the parameter, in place of its reduced gradient: a pipeline stage adds every micro-batch's
    gradient into it and reduces once per step (``runtime/pipeline``), so it is held through the
    step's micro-batches, and the reduced gradient is made only at the step's end, when they are
    done. A gradient made at its parameter's placement needs no reduction, but its accumulator is
    still in the compute dtype (under bf16-mixed half the float32 gradient made from it at the end)."""

    def placed(ref) -> tuple:
        i = problem.index[folding.representative(ref.node)]
        return output_placement(problem.nodes[i].strategies[choice[i]], ref.index)

    def reduced(name: str) -> float:
        i = problem.index[folding.representative(name)]
        return problem.nodes[i].memory["grads"][choice[i]]

    for fqn, ref in graph.grads.items():
        name = graph.params.get(fqn)
        if ref is None or name is None:
            continue
        place = placed(ref)
        spec = graph.spec(ref)
        nbytes = activation_bytes(spec.shape, spec.dtype, place, mesh, precision)
        for r in regions_of(name):
            mem[r]["grads"] += nbytes - reduced(name)


def between_ops(model: ModelSegments, peak) -> ModelSegments:
    """``model`` charged what its micro-batch plan's walk (``cost_model.liveness.Peak.between``) holds
    between ops at the most, besides saved values, state and the gradients waiting for their
    reduction: a walk of one whole micro-batch holds every parameter's to the end of its backward
    (its buckets reduce after it), where a pipeline rank holds only its own stages' (their
    accumulators, counted in their ``grads``). Not the temporaries at the walk's own peak: that
    is at the backward's end, with every saved value alive, where a stage's peak is mid-step."""
    if peak is None:
        return model
    return replace(model, temporaries=float(peak.between))


def _per_row(graph: Graph) -> set[str]:
    """Nodes whose work is per row of the batch: those that read, at some remove, an input of the
    model (the parameters' own casts and the tables built from buffers do not)."""
    out: set[str] = set(graph.inputs.values())
    for n in graph.nodes:
        if not n.is_placeholder and any(r.node in out for r in n.inputs):
            out.add(n.name)
    return out


def _node_growth(graph: Graph, pn, s: int, mesh: Mesh, precision: Precision) -> float:
    """``compute.row_growth`` of a per-row node at strategy ``s`` on its local shapes; a parameter
    gradient's own op grows only if it is a product (its operands' rows are contracted: a
    memory-bound op writing a gradient, such as the sum of two gradients, is not per row)."""
    n = graph.node(pn.name)
    if n.is_placeholder or n.op == "output":
        return 0.0
    strat = pn.strategies[s]
    call = op_call(graph, n)
    zero = (0,) * mesh.ndim
    ins = [None if sp is None else local_shape(sp.shape, input_placement(strat, k), mesh.shape, zero)
           for k, sp in enumerate(graph.spec(r) for r in n.inputs)]
    outs = [None if sp is None else local_shape(sp.shape, output_placement(strat, j), mesh.shape, zero)
            for j, sp in enumerate(n.outputs)]
    if Role.GRADIENT in n.roles and matmul_shape(call, ins, outs) is None:
        return 0.0
    return row_growth(call, ins, outs, mesh.hardware, precision)


def _transfer_growth(graph: Graph, edges, choice: Sequence[int], mesh: Mesh) -> float:
    """A per-row activation transfer's growth over its seconds: its first priced edge's resharding at
    twice the rows (dimension 0 doubled) less once, over once (the latency does not grow)."""
    for e in edges:
        src, dst = e.places_out[e.src_place[choice[e.src]]], e.places_in[e.dst_place[choice[e.dst]]]
        shape = tuple(graph.spec(e.ref).shape)
        once = reshard_time(shape, src, dst, mesh, e.elem_bytes)
        if once > 0:
            twice = reshard_time((2 * shape[0],) + shape[1:], src, dst, mesh, e.elem_bytes) if shape else once
            return max(0.0, twice - once) / once
    return 0.0


def _recompute_options(problem: Problem, choice: Sequence[int], terms: Sequence[GroupTerms]) -> dict[str, dict]:
    """Per layer instance's module path, per recomputation mode: what recomputing it saves and costs
    per micro-batch (``checkpoint.group_figures`` of its folded group at ``choice``)."""
    out: dict[str, dict] = {}
    for mode in MODES:
        recompute = Choice(tuple(mode for _ in terms), tuple(1 for _ in terms))
        for t, fig in zip(terms, group_figures(problem, list(terms), recompute, list(choice))):
            option = Recompute(max(0.0, fig["saved_bytes"] - fig["input_bytes"]), fig["recompute_time"],
                               t.peak_share[mode] * fig["saved_bytes"])
            for path in t.paths:
                out.setdefault(path, {})[mode] = option
    return out


def scaled(model: ModelSegments, factor: float) -> ModelSegments:
    """``model``'s segments at a micro-batch ``factor`` times as large: the per-micro-batch figures
    (forward, input and weight gradients, saved activations, the boundary activation) scaled, the
    per-step ones (state, gathers, reductions, the kept copy, the optimizer step) kept. An estimate
    that leans optimistic, so that a count it ranks worse than a solved one would not have won: for a
    smaller micro-batch (``factor < 1``) the times are scaled linearly (smaller kernels run further
    from their peak and each call keeps its latency, so the real times are larger); for a larger one
    they grow only by their ``growth`` (``Segment.growth``: each per-row op's time at full efficiency,
    each per-row activation transfer's bytes; the launch floors, latencies and what is not per row
    stay as they are), where a linear scale would be pessimistic (53% on a 1.3B-wide GPT at one
    1024-token row per micro-batch on tp4). The intra-op plan at the other shape may differ too: the
    pipeline driver ranks micro-batch counts with it and solves the best exactly."""

    def grown(t: float, g: float) -> float:
        return t * factor if factor <= 1 else t + (factor - 1) * g

    def one(s: Segment) -> Segment:
        mem = dict(s.memory)
        if "activations" in mem:
            mem["activations"] = mem["activations"] * factor
        redo = tuple((path, {k: Recompute(o.saving * factor, o.seconds * min(1.0, factor), o.transient * factor)
                             for k, o in opts.items()}) for path, opts in s.recompute)
        return Segment(grown(s.forward, s.growth[0]), grown(s.input_grad, s.growth[1]),
                       grown(s.weight_grad, s.growth[2]), s.state,
                       s.activations * factor, s.gathers, s.reductions, s.kept, memory=mem, paths=s.paths,
                       optimizer=s.optimizer, recompute=redo, growth=s.growth, transient=s.transient * factor)

    return ModelSegments(one(model.pre), tuple(one(u) for u in model.units), one(model.post),
                         model.boundary_bytes * factor, model.overlap_slowdown, model.temporaries * factor)


def split(model: ModelSegments, n_stages: int) -> Optional[list[tuple[int, int]]]:
    """Contiguous ranges ``[a, b)`` of layer instances, one per stage, that minimise the slowest
    stage's forward + backward seconds (the first stage with the segment before the layers, the
    last with the one after); ties go to the earliest cut. None when there are fewer instances than
    stages."""
    units = model.units
    n = len(units)
    if n_stages < 1 or n < n_stages:
        return None
    cost = [u.forward + u.backward for u in units]
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    pre, post = model.pre.forward + model.pre.backward, model.post.forward + model.post.backward

    def span(s: int, a: int, b: int) -> float:
        return prefix[b] - prefix[a] + (pre if s == 0 else 0.0) + (post if s == n_stages - 1 else 0.0)

    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for b in range(s, n - (n_stages - s) + 1):
            for a in range(s - 1, b):
                if best[s - 1][a] == inf:
                    continue
                v = max(best[s - 1][a], span(s - 1, a, b))
                if v < best[s][b] - 1e-15 * max(1.0, abs(v)):
                    best[s][b], cut[s][b] = v, a
    out = []
    b = n
    for s in range(n_stages, 0, -1):
        a = cut[s][b]
        out.append((a, b))
        b = a
    return out[::-1]


def with_reruns(model: ModelSegments, recomputed: Sequence[tuple]) -> ModelSegments:
    """``model`` with each layer instance that ``recomputed`` (a price's per-stage ``(mode, paths)``)
    re-runs charged its re-run in its input-gradient time: what ``split`` balances when the stages
    recompute (a stage that recomputes more is given fewer layers)."""
    redo = {path: mode for mode, paths in recomputed for path in paths}
    units = []
    for u in model.units:
        extra = sum(opts[redo[path]].seconds for path, opts in u.recompute if path in redo and redo[path] in opts)
        units.append(replace(u, input_grad=u.input_grad + extra) if extra else u)
    return replace(model, units=tuple(units))


def stages_of(model: ModelSegments, ranges: Sequence[tuple[int, int]]) -> list[Segment]:
    """Each stage's segment: its layer instances, the first with ``pre``, the last with ``post``."""
    out = []
    for s, (a, b) in enumerate(ranges):
        parts = ([model.pre] if s == 0 else []) + list(model.units[a:b]) + ([model.post] if s == len(ranges) - 1 else [])
        out.append(combine(parts))
    return out


#: the virtual stages per rank tried for Interleaved1F1B
INTERLEAVED_VIRTUAL = (2,)


def candidates(pp: int, microbatches: int, schedule: Optional[str] = None,
               virtual: Optional[int] = None) -> list[tuple[str, int]]:
    """The (schedule, virtual stages per rank) pairs torch 2.13 runs for ``pp`` ranks and
    ``microbatches`` (restricted to ``schedule`` / ``virtual`` when given). On one rank only
    gradient accumulation is a pipeline: 1F1B's order on one stage (each micro-batch's backward right
    after its forward, one micro-batch in flight)."""
    names = [schedule] if schedule else list(SCHEDULES)
    out = []
    for name in names:
        vs = {"GPipe": (1,), "1F1B": (1,), "ZBVZeroBubble": (2,)}.get(name, INTERLEAVED_VIRTUAL)
        if virtual is not None:
            vs = (virtual,)
        for v in vs:
            if pp == 1 and name != "1F1B" and schedule is None:
                continue
            try:
                check_schedule(name, pp, microbatches, v)
            except ValueError:
                continue
            out.append((name, v))
    return out


def best_pipelines(model: ModelSegments, pp: int, microbatches: int, p2p: float, schedule: Optional[str] = None,
           virtual: Optional[int] = None, budget: Optional[float] = None) -> list[tuple[PipelinePrice,
                                                                                  list[tuple[int, int]]]]:
    """Every schedule that runs this shape, priced, with its stage ranges; cheapest step first
    (ties: the order of ``SCHEDULES``, then fewer virtual stages). With a ``budget``, ranks over it
    recompute layer instances (``cost_model.pipeline_price.choose_recompute``)."""
    out = []
    splits: dict[int, Optional[list[tuple[int, int]]]] = {}  # stages -> ranges (schedules of alike stage counts share)
    for k, (name, v) in enumerate(candidates(pp, microbatches, schedule, virtual)):
        if pp * v not in splits:
            splits[pp * v] = split(model, pp * v)
        ranges = splits[pp * v]
        if ranges is None:
            continue
        price = price_pipeline(stages_of(model, ranges), name, pp, microbatches, v, p2p, model.boundary_bytes, budget,
                               model.overlap_slowdown, model.temporaries)
        if any(paths for _, paths in price.recomputed):
            # the split balanced the stages without their re-runs: split again with the layer
            # instances this choice recomputes charged their re-run, price that (recomputation chosen
            # anew for its stages) and keep the better of the two (fitting first)
            again = split(with_reruns(model, price.recomputed), pp * v)
            if again is not None and again != ranges:
                other = price_pipeline(stages_of(model, again), name, pp, microbatches, v, p2p, model.boundary_bytes,
                                       budget, model.overlap_slowdown, model.temporaries)
                fits = budget is None or other.peak_memory <= budget
                if (not fits, other.step_time) < (budget is not None and price.peak_memory > budget, price.step_time):
                    price, ranges = other, again
        out.append((k, price, ranges))
    out.sort(key=lambda t: (t[1].step_time, t[0]))
    return [(p, r) for _, p, r in out]


__all__ = ["ModelSegments", "best_pipelines", "between_ops", "candidates", "scaled", "segments", "split", "stages_of",
           "with_reruns"]
