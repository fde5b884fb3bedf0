"""The stage cut: one micro-batch's lowered program cut into pipeline stages, a ``program.staged.Cut``
(the pipeline runtimes, ``runtime.pipeline``, run it).

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

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from autopar.errors import ArgumentError
from autopar.program import collectives as C
from autopar.program.program import Program
from autopar.program.staged import IR_TAG, PARAM_VALUE, SHAPE, Cut, Reductions, StageCut, local_shape

_aten = torch.ops.aten
#: Ops the per-step part may hold besides the reductions: linear in their tensor inputs, so running
#: them once on the micro-batches' sum equals summing their per-micro-batch results.
_LINEAR = {_aten.add.Tensor, _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default,
           _aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.clone.default,
           _aten._to_copy.default, _aten.sum.dim_IntList, operator.getitem, C.wait, C.all_reduce, C.all_gather,
           C.reduce_scatter, C.all_to_all,
           # a resharding's local steps (``passes.lower.reshard``): a slice, and a block padded with a sum's
           # zeros (to a partial sum), the zeros made in its shape
           _aten.slice.Tensor, "contiguous", "reshape", _aten.slice_scatter.default, _aten.new_full.default,
           _aten.full_like.default}


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
        return math.prod(self.sizes[a] for a in axis) if isinstance(axis, tuple) else self.sizes[axis]

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

    def permute(self, x, axis, dest):  # noqa: ARG002
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


def _local_reductions(joint: _Joint, step_part: set, frontier: list, stage: dict, local: set,
                      device: Optional[torch.device] = None) -> Reductions:
    """``Reductions`` of the ``local`` stages: the gradients whose frontier inputs (the summed
    contributions) some local stage makes, or none does, with the per-step nodes they need."""
    in_frontier = set(frontier)

    def makers(o) -> set:
        seen, todo, out = set(), [o], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in in_frontier:
                out.add(stage.get(n))
            elif n in step_part:
                todo += n.all_input_nodes
        return out

    kept = []
    for k, o in enumerate(joint.grads):
        found = makers(o)
        if not found or found & local:
            kept.append(k)
    need = _closure_up([joint.grads[k] for k in kept], lambda x: x not in step_part)
    gm = _extract(joint.root, [n for n in joint.backward.nodes if n in step_part and n in need], frontier,
                  [joint.grads[k] for k in kept], joint.same)
    return Reductions(gm, kept, [local_shape(o) for o in joint.grads], device)


@dataclass
class _Joint:
    """The forward and backward programs read together: their graphs, placeholders and outputs, and
    what the static-value analysis found (``_static_values``)."""

    program: Program
    forward: fx.Graph
    backward: fx.Graph
    root: torch.nn.Module  # holds every submodule and constant either program calls
    inputs: list[fx.Node]  # the forward's placeholders, one per program.inputs slot
    slot_of: dict[fx.Node, int]
    loss: fx.Node
    saved_for: dict[fx.Node, fx.Node]  # a backward placeholder of a saved value -> the forward node
    placeholder_of: dict[fx.Node, fx.Node]  # a saved forward value -> its (first) backward placeholder
    tangent: Optional[fx.Node]  # the backward's placeholder of the loss's gradient
    grads: list[fx.Node]  # the backward's outputs, in program.grads order
    static: dict[fx.Node, bool] = field(default_factory=dict)  # made from parameters/buffers/constants alone
    same: dict[fx.Node, fx.Node] = field(default_factory=dict)  # node -> the first node computing its value

    def first(self, n: fx.Node) -> fx.Node:
        return self.same.get(n, n)


def _read_programs(program: Program) -> _Joint:
    fwd, bwd = program.forward.graph, program.backward.graph
    inputs = [n for n in fwd.nodes if n.op == "placeholder"]
    outs = next(n for n in fwd.nodes if n.op == "output").args[0]
    b_inputs = [n for n in bwd.nodes if n.op == "placeholder"]
    saved_for = dict(zip(b_inputs[:program.n_saved], outs[1:]))
    placeholder_of: dict[fx.Node, fx.Node] = {}
    for ph, value in saved_for.items():
        placeholder_of.setdefault(value, ph)  # a value saved twice (an identity dropped) has two
    return _Joint(program, fwd, bwd, _holder(program), inputs, {n: k for k, n in enumerate(inputs)}, outs[0],
                  saved_for, placeholder_of, b_inputs[program.n_saved] if len(b_inputs) > program.n_saved else None,
                  list(next(n for n in bwd.nodes if n.op == "output").args[0]))


def _static_values(joint: _Joint) -> None:
    """Mark the values made from parameters, buffers and constants alone (``joint.static``), hash-consed
    across both programs (``joint.same``): a backward regather of a parameter the forward gathered at the
    same placements is the forward's (its copy is kept for the step), and equal calls are one."""
    first_of_call: dict[Any, fx.Node] = {}
    by_value: dict[Any, fx.Node] = {}  # a parameter at the placements a forward op reads it -> its node
    for graph in (joint.forward, joint.backward):
        for n in graph.nodes:
            if n.op == "output":
                continue
            if n.op == "placeholder":
                if graph is joint.forward:
                    joint.static[n] = joint.program.inputs[joint.slot_of[n]].kind in ("param", "buffer")
                else:
                    src = joint.saved_for.get(n)
                    joint.static[n] = src is not None and joint.static[src]
                    if src is not None:
                        joint.same[n] = joint.first(src) if joint.static[n] else joint.placeholder_of[src]
                continue
            joint.static[n] = all(joint.static[a] for a in n.all_input_nodes)
            if not joint.static[n]:
                continue
            if graph is joint.forward and PARAM_VALUE in n.meta:
                by_value.setdefault(n.meta[PARAM_VALUE], n)
            if graph is joint.backward and by_value.get(n.meta.get(PARAM_VALUE)) is not None:
                joint.same[n] = by_value[n.meta[PARAM_VALUE]]
            else:
                key = (n.op, str(n.target),
                       repr(fx.node.map_arg((n.args, n.kwargs), lambda a: ("n", id(joint.first(a))))))
                if key in first_of_call:
                    joint.same[n] = first_of_call[key]
                else:
                    first_of_call[key] = n


def _assign_stages(joint: _Joint, stage_of: Callable[[str], int]) -> dict[fx.Node, int]:
    """Each per-micro-batch node's stage: its IR op's (``IR_TAG``), else the latest of its inputs'."""
    stage: dict[fx.Node, int] = {}
    for graph in (joint.forward, joint.backward):
        for n in graph.nodes:
            if n.op in ("placeholder", "output") or joint.static[n]:
                continue
            tag = n.meta.get(IR_TAG)
            if tag is not None:
                stage[n] = stage_of(tag)
            else:
                ins = [stage[joint.first(a)] for a in n.all_input_nodes if joint.first(a) in stage]
                stage[n] = max(ins, default=0)
    return stage


def _gradient_free(joint: _Joint) -> dict[fx.Node, bool]:
    """Forward values with no parameter upstream: made again in each stage that reads them."""
    free: dict[fx.Node, bool] = {}
    for n in joint.forward.nodes:
        if n.op == "placeholder":
            free[n] = joint.program.inputs[joint.slot_of[n]].kind != "param"
        elif n.op != "output":
            free[n] = all(free[a] for a in n.all_input_nodes)
    return free


def _per_step_part(joint: _Joint, stage: dict[fx.Node, int]) -> tuple[set, list[fx.Node]]:
    """The backward nodes run once per step on the micro-batches' sums, and the frontier: the
    per-micro-batch values they read (summed), then the gradients that need no reduction."""
    users = {n: [u for u in n.users if u.op != "output"] for n in joint.backward.nodes}
    # nodes the lowering wrote while finishing the program (no IR op): the reductions, casts before them
    reductions = {n for n in joint.backward.nodes if n.op not in ("placeholder", "output") and IR_TAG not in n.meta
                  and not joint.static[n]}
    # linear on the way to the reductions (or to a gradient that needs none) only: a sum of gradient
    # contributions (a tied weight's)
    grads_out = set(joint.grads)
    to_grads: dict[fx.Node, bool] = {}
    for n in reversed(list(joint.backward.nodes)):
        if n.op != "output":
            us = users[n]
            to_grads[n] = n in reductions or (n.target in _LINEAR and (bool(us) or n in grads_out)
                                              and all(to_grads[u] for u in us))
    crossing = [n for n in joint.backward.nodes if n in stage and n not in reductions and to_grads[n] and any(
        a in stage and a.graph is joint.backward and stage[a] > stage[n] for a in n.all_input_nodes)]
    below: set = set()
    todo = list(crossing)
    while todo:
        for u in users.get(todo.pop(), []):
            if u not in below:
                below.add(u)
                todo.append(u)
    step_part = reductions | set(crossing) | below
    frontier: list[fx.Node] = []
    for n in joint.backward.nodes:
        if n in step_part:
            for a in n.all_input_nodes:
                if a not in step_part and not joint.static[a] and a not in frontier:
                    if a.op == "placeholder":
                        raise ArgumentError(f"autopar pipeline: a gradient reduction reads {a.name} directly")
                    frontier.append(a)
    for o in joint.grads:
        if o not in step_part and o not in frontier:
            frontier.append(o)  # a gradient that needs no reduction
    return step_part, frontier


@dataclass
class _Crossings:
    """Per stage: its nodes and what crosses its boundaries (``_crossings``)."""

    forward_nodes: list[list[fx.Node]]  # its forward nodes, the gradient-free values it makes again included
    backward_nodes: list[list[fx.Node]]
    stash: list[list[fx.Node]]  # forward values its backward reads
    sent: list[list[fx.Node]]  # sent[s]: gradient-carrying values sent from stage s to s + 1
    sent_back: list[list[fx.Node]]  # sent_back[s]: backward values sent from stage s + 1 to s


def _crossings(joint: _Joint, stage: dict, step_part: set, frontier: list, n_stages: int) -> _Crossings:
    """Which nodes each stage runs and what crosses between stages (forwarded through the stages in
    between); a backward that reads an earlier stage's backward value does not cut cleanly."""
    grad_free = _gradient_free(joint)
    b_nodes = [[n for n in joint.backward.nodes if stage.get(n) == s and n not in step_part] for s in range(n_stages)]
    stash: list[list[fx.Node]] = [[] for _ in range(n_stages)]
    for s in range(n_stages):
        for n in b_nodes[s]:
            for a in n.all_input_nodes:
                src = joint.saved_for.get(a)
                if src is not None and not joint.static[src] and src not in stash[s]:
                    stash[s].append(src)
    f_nodes, need = [], []
    for s in range(n_stages):
        mine = {n for n in joint.forward.nodes if stage.get(n) == s}
        want = [a for n in joint.forward.nodes if n in mine for a in n.all_input_nodes] + stash[s] + (
            [joint.loss] if s == n_stages - 1 else [])
        wanted = [a for a in dict.fromkeys(want) if a not in mine and not joint.static[a] and a.op != "placeholder"]
        again = _closure_up([a for a in wanted if grad_free[a]],
                            lambda x: x in mine or joint.static[x] or x.op == "placeholder")
        f_nodes.append([n for n in joint.forward.nodes if n in mine or n in again])
        need.append([a for a in wanted if not grad_free[a]])
    sent = []
    for s in range(n_stages - 1):
        later = {a for t in range(s + 1, n_stages) for a in need[t]}
        sent.append([n for n in joint.forward.nodes if n in later and stage.get(n, n_stages) <= s])
    b_need = []
    for s in range(n_stages):
        mine = set(b_nodes[s])
        want = [a for n in b_nodes[s] for a in n.all_input_nodes] + [f for f in frontier if stage.get(f) == s]
        got = [a for a in dict.fromkeys(want) if a not in mine and a in stage and a.graph is joint.backward]
        for a in got:
            if stage[a] < s:
                raise ArgumentError(f"autopar pipeline: stage {s}'s backward reads {a.name} from the earlier stage "
                                    f"{stage[a]}; this model does not cut into stages cleanly")
        b_need.append(got)
    sent_back = []
    for s in range(n_stages - 1):
        earlier = {a for t in range(s + 1) for a in b_need[t]}
        sent_back.append([n for n in joint.backward.nodes if n in earlier and stage.get(n, -1) >= s + 1])
    return _Crossings(f_nodes, b_nodes, stash, sent, sent_back)


def _stage_programs(joint: _Joint, crossings: _Crossings, stage: dict, frontier: list, s: int, n_stages: int,
                    split: bool) -> StageCut:
    """Stage ``s``'s forward and backward programs (static value ids are the nodes, numbered later)."""
    last = s == n_stages - 1
    f_in = crossings.sent[s - 1] if s > 0 else []
    f_out = [joint.loss] if last else crossings.sent[s]
    stash = crossings.stash[s]
    given_in = set(f_in)
    nodes = [n for n in crossings.forward_nodes[s] if n not in given_in]
    reads = [a for n in nodes for a in n.all_input_nodes] + f_out + stash
    f_statics = list(dict.fromkeys(joint.first(a) for a in reads if joint.static.get(a)))
    f_given = sorted({joint.slot_of[a] for a in reads if a.op == "placeholder" and a.graph is joint.forward
                      and not joint.static[a]})
    forward = _extract(joint.root, nodes, f_statics + [joint.inputs[k] for k in f_given] + f_in, f_out + stash,
                       joint.same)
    g_in = [] if last else crossings.sent_back[s]
    g_out = crossings.sent_back[s - 1] if s > 0 else []
    made = [f for f in frontier if stage.get(f) == s]
    given_in = set(g_in)
    nodes = [n for n in crossings.backward_nodes[s] if n not in given_in]
    reads = [a for n in nodes for a in n.all_input_nodes] + g_out + made
    b_statics = list(dict.fromkeys(joint.first(a) for a in reads if joint.static.get(a)))
    tangent = joint.tangent is not None and any(a is joint.tangent for a in reads)
    inputs = [joint.placeholder_of[v] for v in stash] + b_statics + g_in + ([joint.tangent] if tangent else [])
    halves = _split_backward(joint.root, nodes, inputs, g_out, made, joint.same) if split else (None, None)
    fid = {n: k for k, n in enumerate(frontier)}
    return StageCut(index=s, forward=forward, f_statics=f_statics, f_given=f_given, f_in=f_in, f_out=f_out,
                    stash=stash, backward=_extract(joint.root, nodes, inputs, g_out + made, joint.same),
                    b_statics=b_statics, g_in=g_in, g_out=g_out, frontier=[fid[f] for f in made], tangent=tangent,
                    backward_input=halves[0], backward_weight=halves[1])


def _static_program(joint: _Joint, stages: list[StageCut], local: set) -> tuple[fx.GraphModule, list[int], int]:
    """The per-step static program of every static value the ``local`` stages read, and renumber those
    stages' static reads by position in its outputs: (program, the input slots it reads, its value count)."""
    wanted = set().union(*(set(st.f_statics) | set(st.b_statics) for st in stages if st.index in local))
    values = [n for g in (joint.forward, joint.backward) for n in g.nodes if n in wanted]
    ids = {n: k for k, n in enumerate(values)}
    for st in stages:
        if st.index in local:
            st.f_statics = [ids[n] for n in st.f_statics]
            st.b_statics = [ids[n] for n in st.b_statics]
    up = _closure_up(values, lambda x: False, joint.first)
    state = [n for n in joint.inputs if n in up]
    body = [n for g in (joint.forward, joint.backward) for n in g.nodes if n in up and n.op != "placeholder"]
    return _extract(joint.root, body, state, values, joint.same), [joint.slot_of[n] for n in state], len(values)


def cut(program: Program, stage_of: Callable[[str], int], n_stages: int, local: Sequence[int],
        split: bool = False, device: Optional[torch.device] = None) -> Cut:
    """``program`` (tagged, after ``dry_run``) cut into ``n_stages`` stages; ``stage_of`` gives an IR
    op's stage; the static program computes what the ``local`` stages (this rank's) read. ``split``:
    each stage's backward also in its input- and weight-gradient parts (``_split_backward``).
    ``device``: the one ``program`` was lowered for (the reductions' zeros are made there)."""
    if program.backward is None:
        raise ArgumentError("autopar pipeline: only training plans run pipelined with other mesh axes")
    kinds = [s.kind for s in program.outputs]
    if kinds != ["loss"]:
        raise ArgumentError(f"autopar pipeline: the program writes {kinds[1:]} besides the loss (buffer updates); "
                            "a pipelined run with other mesh axes does not handle them yet")
    joint = _read_programs(program)
    _static_values(joint)
    stage = _assign_stages(joint, stage_of)
    step_part, frontier = _per_step_part(joint, stage)
    crossings = _crossings(joint, stage, step_part, frontier, n_stages)
    stages = [_stage_programs(joint, crossings, stage, frontier, s, n_stages, split) for s in range(n_stages)]
    static, state_slots, n_static = _static_program(joint, stages, set(local))
    return Cut(stages=stages, static=static, state_slots=state_slots,
               reduce=_local_reductions(joint, step_part, frontier, stage, set(local), device),
               frontier_shapes=[local_shape(n) for n in frontier], frontier_stage=[stage[n] for n in frontier],
               n_static=n_static)


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


__all__ = ["cut", "dry_run"]
