"""One micro-batch's lowered program cut into pipeline stages (``runtime/pipeline_mesh.py`` runs them).

The program is the plan's, lowered for this rank's coordinates on the stage mesh (the mesh without
the ``pp`` axis) by ``passes.lower.tagged``, which marks each fx node with the IR op it was written
for. Each node then goes where the planner put its op (``ir.stages``'s chain rule, the plan's
stages), and the programs are cut in four kinds of part:

- **static** (once per step, before the schedule): what depends on parameters, buffers and
  constants only: parameter gathers and casts, RoPE tables. The backward's regathers of a
  parameter are the forward's when they are the same call (hash-consed): the gathered copy is kept
  for the step, as the pipeline price assumes;
- **a stage's forward** (per micro-batch): its ops and the reshardings they read; values that carry
  no gradient made by an earlier stage are made again (masks from the inputs); values that carry
  gradient and are read later are sent stage to stage (``f_out`` / ``f_in``), forwarded through
  stages in between; the forward also hands its backward what that reads (``stash``);
- **a stage's backward** (per micro-batch): its backward ops; gradients a later stage made arrive
  as ``g_in``; what it makes for an earlier stage leaves as ``g_out`` (carried in the slots of the
  forward's boundary values of equal local shape, which torch's stages send back); the unreduced
  parameter gradients (and the other inputs of the per-step part) leave as ``frontier`` values,
  summed over the micro-batches;
- **per step** (after the last micro-batch): the gradient reductions (buckets as the plan has them:
  a pipelined plan's never span stages) and, for a weight read in two stages (a tied embedding and
  head), the sum of the two gradient contributions, on the summed frontier, zeros standing in for
  values other stages make (every op in it is linear). A rank runs only the reductions of the
  gradients its stages contribute to (``Reductions``), as the pipeline price charges each rank its
  own stages' reductions; the other gradients are zeros.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from autopar.errors import ArgumentError
from autopar.program import collectives as C

IR_TAG = "autopar_ir"  # as ``passes.lower.tagged`` writes them (runtime may not import passes)
PARAM_VALUE = "autopar_param_value"
SHAPE = "autopar_local"  # (shape, dtype) of a node's local value, from ``dry_run``

_aten = torch.ops.aten
#: Ops the per-step part may hold besides the reductions: linear in their tensor inputs, so running
#: them once on the micro-batches' sum equals summing their per-micro-batch results.
_LINEAR = {_aten.add.Tensor, _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default,
           _aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.clone.default,
           _aten._to_copy.default, _aten.sum.dim_IntList, operator.getitem, C.wait, C.all_reduce, C.all_gather,
           C.reduce_scatter, C.all_to_all}


@dataclass
class StageCut:
    """One stage's per-micro-batch programs and what they read and write."""

    index: int
    forward: fx.GraphModule  # (*statics, *given, *f_in) -> (*f_out, *stash)
    f_statics: list[int]  # static value ids it reads
    f_given: list[int]  # input slot positions (program.inputs) it reads
    f_in: list[fx.Node]
    f_out: list[fx.Node]
    stash: list[fx.Node]
    backward: fx.GraphModule  # (*stash, *statics, *g_in, [tangent]) -> (*g_out, *frontier)
    b_statics: list[int]
    g_in: list[fx.Node]
    g_out: list[fx.Node]
    frontier: list[int]  # frontier ids it makes
    tangent: bool  # its backward reads the loss's gradient
    #: The backward split for zero-bubble schedules (``cut(..., split=True)``), else None:
    #: ``backward_input`` (same inputs) -> (*g_out, *shared): the input gradients, and what the
    #: weight part reads of its work; ``backward_weight`` (same inputs, *shared) -> (*frontier).
    backward_input: Optional[fx.GraphModule] = None
    backward_weight: Optional[fx.GraphModule] = None


@dataclass
class Cut:
    """The program cut into stages (see the module docstring)."""

    stages: list[StageCut]
    static: fx.GraphModule  # (*params and buffers it reads) -> every static value, in id order
    state_slots: list[int]  # the program.inputs positions the static program reads
    reduce: Callable  # (*frontier) -> the program's gradients (program.grads order): ``Reductions``
    frontier_shapes: list[tuple]  # (shape, dtype) per frontier id
    frontier_stage: list[int]
    n_static: int


def _shape(n: fx.Node) -> tuple:
    got = n.meta.get(SHAPE)
    if got is None:
        raise ArgumentError(f"autopar pipeline: no local shape for {n.name} (the dry run did not reach it)")
    return got


def dry_run(program, inputs: list) -> None:
    """Run ``program`` (forward, then backward from a unit tangent) once with collectives that only
    shape their results (no communication), recording every fx node's local (shape, dtype) in its
    ``meta[SHAPE]``: the shapes the stages' boundaries and their examples need."""
    class _Shapes(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                t = C.wait(out)
                n.meta[SHAPE] = (tuple(t.shape), t.dtype)
            return out

    with C.use_backend(_ShapeOnly(program.mesh_shape)), torch.no_grad():
        res = _Shapes(program.forward).run(*inputs)
        res = [C.wait(t) for t in res]
        saved = res[len(res) - program.n_saved:]
        loss = res[0]
        if program.backward is not None:
            _Shapes(program.backward).run(*saved, torch.ones_like(loss))


class _ShapeOnly:
    """A collective backend that communicates nothing: results of the right shapes (``dry_run``)."""

    def __init__(self, mesh_shape):
        self.sizes = list(mesh_shape)

    def axis_size(self, axis):
        return self.sizes[axis]

    def all_gather(self, x, axis, dim):
        return torch.cat([x] * self.sizes[axis], dim)

    def reduce_scatter(self, x, axis, dim, reduce):  # noqa: ARG002
        return x.narrow(dim, 0, x.shape[dim] // self.sizes[axis]).clone()

    def all_reduce(self, x, axis, reduce):  # noqa: ARG002
        return x.clone()

    def all_reduce_(self, x, axis, reduce):  # noqa: ARG002
        return x

    def all_to_all(self, x, axis):  # noqa: ARG002
        return x.clone()


def _holder(program) -> torch.nn.Module:
    """A module holding every submodule and constant either program calls (the same objects)."""
    root = torch.nn.Module()
    for gm in (program.forward, program.backward):
        if gm is None:
            continue
        for n in gm.graph.nodes:
            if n.op in ("call_module", "get_attr") and not hasattr(root, n.target):
                obj = gm.get_submodule(n.target) if n.op == "call_module" else getattr(gm, n.target)
                if isinstance(obj, torch.nn.Module):
                    root.add_module(n.target, obj)
                elif isinstance(obj, torch.nn.Parameter):
                    root.register_parameter(n.target, obj)
                elif isinstance(obj, torch.Tensor):
                    root.register_buffer(n.target, obj)
                else:
                    setattr(root, n.target, obj)
    return root


def _extract(root: torch.nn.Module, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
             remap: dict) -> fx.GraphModule:
    """A program of ``nodes`` (in order) reading ``inputs`` (placeholders, in order) and returning
    ``outputs``; a node read but not in the program is looked up as ``remap`` names it (a static
    value's first computation, a saved value's forward node)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, n in enumerate(inputs):
        env[n] = g.placeholder(f"in{k}_{n.name}")

    def look(a: fx.Node) -> fx.Node:
        while a not in env:
            if a not in remap:
                raise ArgumentError(f"autopar pipeline: cutting the program lost the value {a.name}")
            a = remap[a]
        return env[a]

    for n in nodes:
        if n not in env:
            env[n] = g.node_copy(n, look)
    g.output(tuple(look(o) for o in outputs))
    g.lint()
    return fx.GraphModule(root, g)


def _closure_up(starts, stop: Callable[[fx.Node], bool], through: Callable[[fx.Node], fx.Node] = lambda a: a) -> set:
    """``starts`` and their inputs (seen ``through`` a mapping), transitively, not entering nodes
    where ``stop`` holds."""
    seen: set = set()
    todo = list(starts)
    while todo:
        n = through(todo.pop())
        if n in seen or stop(n):
            continue
        seen.add(n)
        todo += n.all_input_nodes
    return seen


class Reductions:
    """The per-step part for one rank: ``(*frontier) ->`` every gradient of the program, in order. Only
    the reductions of gradients that this rank's stages contribute to run (one collective for a
    bucket whole if any member's does); the others are zeros of their reduced shape (a weight read
    on several ranks, a tied embedding and head, is summed over the pipeline group from them)."""

    def __init__(self, gm: fx.GraphModule, kept: list[int], shapes: list[tuple]):
        self.gm, self.kept, self.shapes = gm, kept, shapes

    def __call__(self, *frontier):
        got = dict(zip(self.kept, self.gm(*frontier)))
        return [got[k] if k in got else torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in enumerate(self.shapes)]


def _local_reductions(root, bg: fx.Graph, step_part: set, frontier: list, b_out: list, same: dict, stage: dict,
                      local: set) -> Reductions:
    """``Reductions`` of the ``local`` stages: the gradients whose frontier inputs (the summed
    contributions) some local stage makes, or none does, with the per-step nodes they need."""
    fid = set(frontier)

    def makers(o) -> set:
        seen, todo, out = set(), [o], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in fid:
                out.add(stage.get(n))
            elif n in step_part:
                todo += n.all_input_nodes
        return out

    kept = []
    for k, o in enumerate(b_out):
        found = makers(o)
        if not found or found & local:
            kept.append(k)
    need = _closure_up([b_out[k] for k in kept], lambda x: x not in step_part)
    gm = _extract(root, [n for n in bg.nodes if n in step_part and n in need], frontier, [b_out[k] for k in kept],
                  same)
    return Reductions(gm, kept, [_shape(o) for o in b_out])


def cut(program, stage_of: Callable[[str], int], n_stages: int, local: Sequence[int], split: bool = False) -> Cut:
    """``program`` (tagged, after ``dry_run``) cut into ``n_stages`` stages; ``stage_of`` gives an IR
    op's stage; the static program computes what the ``local`` stages (this rank's) read. ``split``:
    each stage's backward also in its input- and weight-gradient parts (``_split_backward``)."""
    if program.backward is None:
        raise ArgumentError("autopar pipeline: only training plans run pipelined with other mesh axes")
    kinds = [s.kind for s in program.outputs]
    if kinds != ["loss"]:
        raise ArgumentError(f"autopar pipeline: the program writes {kinds[1:]} besides the loss (buffer updates); "
                            "a pipelined run with other mesh axes does not handle them yet")
    fg, bg = program.forward.graph, program.backward.graph
    root = _holder(program)
    f_ph = [n for n in fg.nodes if n.op == "placeholder"]
    slot_of = {n: k for k, n in enumerate(f_ph)}
    outs = next(n for n in fg.nodes if n.op == "output").args[0]
    loss, saved = outs[0], list(outs[1:])
    b_ph = [n for n in bg.nodes if n.op == "placeholder"]
    saved_ph = dict(zip(b_ph[:program.n_saved], saved))
    ph_of: dict[fx.Node, fx.Node] = {}  # a forward value -> its (first) backward placeholder
    for k, v in saved_ph.items():
        ph_of.setdefault(v, k)  # a value saved twice (an identity dropped) has two
    tangent = b_ph[program.n_saved] if len(b_ph) > program.n_saved else None
    b_out = list(next(n for n in bg.nodes if n.op == "output").args[0])

    # -- static values, hash-consed across both programs -------------------------------------------
    static: dict[fx.Node, bool] = {}
    same: dict[fx.Node, fx.Node] = {}  # node -> the first node computing the same value
    canon: dict[Any, fx.Node] = {}
    by_value: dict[Any, fx.Node] = {}  # a parameter at the placements a forward op reads it -> its node

    def first(n: fx.Node) -> fx.Node:
        return same.get(n, n)

    for graph in (fg, bg):
        for n in graph.nodes:
            if n.op == "output":
                continue
            if n.op == "placeholder":
                if graph is fg:
                    static[n] = program.inputs[slot_of[n]].kind in ("param", "buffer")
                else:
                    src = saved_ph.get(n)
                    static[n] = src is not None and static[src]
                    if src is not None:
                        same[n] = first(src) if static[n] else ph_of[src]
                continue
            static[n] = all(static[a] for a in n.all_input_nodes)
            if static[n] and graph is fg and PARAM_VALUE in n.meta:
                by_value.setdefault(n.meta[PARAM_VALUE], n)
            if static[n] and graph is bg and by_value.get(n.meta.get(PARAM_VALUE)) is not None:
                same[n] = by_value[n.meta[PARAM_VALUE]]  # the forward gathered it: its copy is kept for the step
            elif static[n]:
                k = (n.op, str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), lambda a: ("n", id(first(a))))))
                if k in canon:
                    same[n] = canon[k]
                else:
                    canon[k] = n
    # -- stages of the per-micro-batch nodes ---------------------------------------------------------
    stage: dict[fx.Node, int] = {}
    for graph in (fg, bg):
        for n in graph.nodes:
            if n.op in ("placeholder", "output") or static[n]:
                continue
            tag = n.meta.get(IR_TAG)
            if tag is not None:
                stage[n] = stage_of(tag)
            else:
                ins = [stage[first(a)] for a in n.all_input_nodes if first(a) in stage]
                stage[n] = max(ins, default=0)
    grad_free: dict[fx.Node, bool] = {}  # forward values with no parameter upstream: made again where read
    for n in fg.nodes:
        if n.op == "placeholder":
            grad_free[n] = program.inputs[slot_of[n]].kind != "param"
        elif n.op != "output":
            grad_free[n] = all(grad_free[a] for a in n.all_input_nodes)
    # -- the per-step part -------------------------------------------------------------------------
    users = {n: [u for u in n.users if u.op != "output"] for n in bg.nodes}

    def below(starts) -> set:
        out: set = set()
        todo = list(starts)
        while todo:
            for u in users.get(todo.pop(), []):
                if u not in out:
                    out.add(u)
                    todo.append(u)
        return out

    # nodes the lowering wrote while finishing the program (no IR op): the reductions, casts before them
    reductions = {n for n in bg.nodes if n.op not in ("placeholder", "output") and IR_TAG not in n.meta
                  and not static[n]}
    # linear on the way to the reductions (or to a gradient that needs none) only: a sum of gradient
    # contributions (a tied weight's)
    grads_out = set(b_out)
    to_grads: dict[fx.Node, bool] = {}
    for n in reversed(list(bg.nodes)):
        if n.op != "output":
            us = users[n]
            to_grads[n] = n in reductions or (n.target in _LINEAR and (bool(us) or n in grads_out)
                                              and all(to_grads[u] for u in us))
    crossing = [n for n in bg.nodes if n in stage and n not in reductions and to_grads[n] and any(
        a in stage and a.graph is bg and stage[a] > stage[n] for a in n.all_input_nodes)]
    step_part = reductions | set(crossing) | below(crossing)
    frontier: list[fx.Node] = []
    for n in bg.nodes:
        if n in step_part:
            for a in n.all_input_nodes:
                if a not in step_part and not static[a] and a not in frontier:
                    if a.op == "placeholder":
                        raise ArgumentError(f"autopar pipeline: a gradient reduction reads {a.name} directly")
                    frontier.append(a)
    for o in b_out:
        if o not in step_part and o not in frontier:
            frontier.append(o)  # a gradient that needs no reduction
    fid = {n: k for k, n in enumerate(frontier)}

    # -- per stage: nodes, what crosses ------------------------------------------------------------------
    b_nodes = [[n for n in bg.nodes if stage.get(n) == s and n not in step_part] for s in range(n_stages)]
    stash_of: list[list[fx.Node]] = [[] for _ in range(n_stages)]  # forward values a stage's backward reads
    for s in range(n_stages):
        for n in b_nodes[s]:
            for a in n.all_input_nodes:
                src = saved_ph.get(a)
                if src is not None and not static[src] and src not in stash_of[s]:
                    stash_of[s].append(src)
    f_own = [[n for n in fg.nodes if stage.get(n) == s] for s in range(n_stages)]
    need = []
    for s in range(n_stages):
        mine = set(f_own[s])
        want = [a for n in f_own[s] for a in n.all_input_nodes] + stash_of[s] + ([loss] if s == n_stages - 1 else [])
        need.append([a for a in dict.fromkeys(want) if a not in mine and not static[a] and a.op != "placeholder"])
    f_nodes = []
    for s in range(n_stages):
        mine = set(f_own[s])
        again = _closure_up([a for a in need[s] if grad_free[a]],
                            lambda x: x in mine or static[x] or x.op == "placeholder")
        f_nodes.append([n for n in fg.nodes if n in mine or n in again])
        need[s] = [a for a in need[s] if not grad_free[a]]
    f_bound = []  # f_bound[s]: grad-carrying values sent from stage s to s + 1
    for s in range(n_stages - 1):
        later = {a for t in range(s + 1, n_stages) for a in need[t]}
        f_bound.append([n for n in fg.nodes if n in later and stage.get(n, n_stages) <= s])
    b_need = []
    for s in range(n_stages):
        mine = set(b_nodes[s])
        want = [a for n in b_nodes[s] for a in n.all_input_nodes] + [f for f in frontier if stage.get(f) == s]
        got = [a for a in dict.fromkeys(want) if a not in mine and a in stage and a.graph is bg]
        for a in got:
            if stage[a] < s:
                raise ArgumentError(f"autopar pipeline: stage {s}'s backward reads {a.name} from the earlier stage "
                                    f"{stage[a]}; this model does not cut into stages cleanly")
        b_need.append(got)
    g_bound = []  # g_bound[s]: backward values sent from stage s + 1 to s
    for s in range(n_stages - 1):
        earlier = {a for t in range(s + 1) for a in b_need[t]}
        g_bound.append([n for n in bg.nodes if n in earlier and stage.get(n, -1) >= s + 1])

    static_reads: list[set] = []
    stages = []
    for s in range(n_stages):
        f_in = f_bound[s - 1] if s > 0 else []
        f_out = [loss] if s == n_stages - 1 else f_bound[s]
        skip = set(f_in)
        nodes = [n for n in f_nodes[s] if n not in skip]
        reads = [a for n in nodes for a in n.all_input_nodes] + f_out + stash_of[s]
        f_statics = list(dict.fromkeys(first(a) for a in reads if static.get(a)))
        f_given = sorted({slot_of[a] for a in reads if a.op == "placeholder" and a.graph is fg and not static[a]})
        fwd = _extract(root, nodes, f_statics + [f_ph[k] for k in f_given] + f_in, f_out + stash_of[s], same)
        g_in = g_bound[s] if s < n_stages - 1 else []
        g_out = g_bound[s - 1] if s > 0 else []
        made = [f for f in frontier if stage.get(f) == s]
        skip = set(g_in)
        nodes_b = [n for n in b_nodes[s] if n not in skip]
        b_reads = [a for n in nodes_b for a in n.all_input_nodes] + g_out + made
        b_statics = list(dict.fromkeys(first(a) for a in b_reads if static.get(a)))
        uses_tangent = tangent is not None and any(a is tangent for a in b_reads)
        stash_in = [ph_of[x] for x in stash_of[s]]
        b_inputs = stash_in + b_statics + g_in + ([tangent] if uses_tangent else [])
        bwd = _extract(root, nodes_b, b_inputs, g_out + made, same)
        halves = _split_backward(root, nodes_b, b_inputs, g_out, made, same) if split else (None, None)
        static_reads.append(set(f_statics) | set(b_statics))
        stages.append(StageCut(s, fwd, f_statics, f_given, f_in, f_out, stash_of[s], bwd, b_statics, g_in, g_out,
                               [fid[f] for f in made], uses_tangent, *halves))
    # -- the static program: every static value some stage reads --------------------------------------
    wanted = set().union(*(static_reads[s] for s in local))
    static_list = [n for g in (fg, bg) for n in g.nodes if n in wanted]
    ids = {n: k for k, n in enumerate(static_list)}
    for st in stages:
        if st.index in local:
            st.f_statics = [ids[n] for n in st.f_statics]
            st.b_statics = [ids[n] for n in st.b_statics]
    up = _closure_up(static_list, lambda x: False, first)
    state = [n for n in f_ph if n in up]
    body = [n for g in (fg, bg) for n in g.nodes if n in up and n.op != "placeholder"]
    static_gm = _extract(root, body, state, static_list, same)
    reduce_fn = _local_reductions(root, bg, step_part, frontier, b_out, same, stage, set(local))
    return Cut(stages, static_gm, [slot_of[n] for n in state], reduce_fn, [_shape(n) for n in frontier],
               [stage[n] for n in frontier], len(static_list))


def _split_backward(root, nodes: list[fx.Node], inputs: list[fx.Node], g_out: list[fx.Node], made: list[fx.Node],
                    same: dict) -> tuple[fx.GraphModule, fx.GraphModule]:
    """A stage's backward (``nodes`` reading ``inputs``) in two programs, as zero-bubble schedules run
    it: the input-gradient part makes what goes to the previous stage (``g_out``) and nothing else;
    the weight-gradient part makes the rest (the unreduced parameter gradients, ``made``), reading
    the first part's values it needs (``shared``, handed over) instead of computing them again."""
    inside = set(nodes)
    first = _closure_up(g_out, lambda x: x not in inside)
    rest = inside - first  # everything else (nothing is dropped, whatever it writes)
    shared = list(dict.fromkeys([a for n in nodes if n in rest for a in n.all_input_nodes if a in first]
                                + [f for f in made if f in first]))
    inp = _extract(root, [n for n in nodes if n in first], inputs, g_out + shared, same)
    wgt = _extract(root, [n for n in nodes if n in rest], inputs + shared, made, same)
    return inp, wgt


def boundary_pairs(f_vals: list, g_vals: list, where: str) -> list[int]:
    """For each backward boundary value, the forward boundary slot of equal local shape and dtype
    that carries it back (torch's stages send a stage's input gradients in its inputs' shapes)."""
    free = list(range(len(f_vals)))
    out = []
    for g in g_vals:
        want = g.meta.get(SHAPE)
        slot = next((k for k in free if f_vals[k].meta.get(SHAPE) == want), None)
        if slot is None:
            raise ArgumentError(f"autopar pipeline: the backward sends {g.name} {want} back across {where}, but no "
                                "value the forward sends there has its local shape; this plan's placements do not "
                                "pair the stage boundary's gradients with its activations")
        free.remove(slot)
        out.append(slot)
    return out


__all__ = ["Cut", "StageCut", "boundary_pairs", "cut", "dry_run"]
