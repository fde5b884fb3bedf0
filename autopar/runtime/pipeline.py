"""Running a pipelined plan on torch.distributed.pipelining (the pipeline axis alone: ``pp`` ranks).

``pipelined(model, plan, example_inputs)`` cuts the model's forward graph, captured at the
micro-batch's shape (``ir.capture``, ``training=False``), into the plan's stages with the planner's
own rule (``ir.stages``: what runs before the layers goes to the first stage, each layer instance to
the stage the plan lists it in, what runs after the layers to the last stage). Each stage is an
``nn.Module`` that interprets its ops eagerly (autograd records them) on the model's own parameters
and buffers, so gradients land in the model's ``.grad``. torch's public ``PipelineStage`` and
schedule classes (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleZBVZeroBubble``, by the plan's name) run them: the autograd path, point-to-point sends of
the boundary values on the process group, ``scale_grads=False``.

What crosses a stage boundary: every value that carries gradient (depends on a trainable parameter)
made in an earlier stage and read in a later one, forwarded stage to stage (torch's schedules only
talk to adjacent stages). Values that carry no gradient (RoPE tables, masks, positions: made from
buffers, constants and the inputs) are recomputed in every stage that reads them. The model's inputs
are given to every rank (``pmodel(*inputs)`` is called on every rank, SPMD); each stage reads the
micro-batch's slice of the inputs it needs (stages run their forwards in micro-batch order in every
schedule, which the stage checks by counting).

``pmodel(*inputs)`` runs the whole schedule (forward and backward) and returns the loss on every
rank: the whole batch's loss, each micro-batch's loss times its weight (``pipeline_loss``: 1/m, or
for a cross-entropy mean its counted targets over the batch's, so ``ignore_index`` targets spread
unevenly over the micro-batches still give the batch's mean; refused where no weighting can). ``loss.backward()``
then writes the step's gradients into the parameters' ``.grad`` (scaled by the incoming gradient).
A parameter read on several ranks (a tied embedding and head) has its gradients summed over them.
Under ``torch.no_grad()`` it runs the forward only (``run_schedule``: ``schedule.eval``, for ZBV its
forward actions only).

Random ops (dropout, attention with dropout) do not run as torch's eager ops, which would draw from
torch's generator in the schedule's order: each is a ``program.RandomOp`` on one device, drawing the
single-device program's numbers (``ir.rules.random_ops``) at the micro-batch's place in the whole
batch (``random_state.pipelined_draws``), with the seed shared at build and the step advanced per
call, as the mesh runtime draws them. Each stage module holds only the parameters its ops read.

With other mesh axes, ``runtime/pipeline_mesh.py`` runs each stage's slice of the plan's lowered
sharded program (``autopar.compile`` picks it). Not built here: the split backward through autopar's
own lowered programs (torch's autograd split is used for ZBV), point-to-point transfers in records.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.fx.node import map_aggregate

from autopar import _torch_compat as tc
from autopar.errors import ArgumentError
from autopar.ir.capture import as_args, capture
from autopar.ir.graph import Graph, Ref
from autopar.ir.stages import stage_rule
from autopar.program.program import RandomOp, RandomState
from autopar.runtime.pipeline_loss import loss_weights
from autopar.runtime.pipeline_state import drop_parameters, refuse_buffer_updates, without_dropped
from autopar.runtime.random_state import RANDOM_KEY, pipelined_draws, random_tensor, take_random_state


def micro_slices(args: tuple, kwargs: dict, batch: int, m: int) -> list[dict[str, Any]]:
    """Per micro-batch: input key (``input:i`` / keyword) -> its slice (tensors with ``batch`` rows)."""
    named = {f"input:{i}": a for i, a in enumerate(args)}
    named.update(kwargs)
    out: list[dict[str, Any]] = [{} for _ in range(m)]
    for k, v in named.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch:
            for i, part in enumerate(torch.tensor_split(v, m)):
                out[i][k] = part
        else:
            for i in range(m):
                out[i][k] = v
    return out


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


class _Stage(torch.nn.Module):
    """One pipeline stage: its ops in graph order, run on the model's parameters and buffers (only
    those its ops read: ``values``), its random ops drawn by ``randoms`` (node name -> ``RandomOp``)."""

    def __init__(self, graph: Graph, nodes: list, inputs: list[Ref], outputs: list[Ref], values: dict[str, Any],
                 inputs_of: dict[str, str], store: list, weights: list, m: int, last: bool,
                 randoms: dict[str, RandomOp], random: Optional[RandomState]):
        super().__init__()
        self.graph, self.nodes, self.inputs, self.outputs = graph, nodes, inputs, outputs
        self.values, self.inputs_of, self.store, self.m, self.last = values, inputs_of, store, m, last
        self.weights = weights  # per micro-batch, its loss's factor in the step's loss (shared, set per step)
        self.randoms, self.random = randoms, random
        self.given = {r.node for r in inputs}
        self.calls = 0
        params = []
        for v in values.values():
            if isinstance(v, torch.nn.Parameter) and all(v is not p for p in params):
                params.append(v)
        # its own parameters: torch's weight-gradient backward (ZBV's W) runs over these
        self.held = torch.nn.ParameterList(params)

    def forward(self, *boundary):
        mb = self.calls % self.m
        self.calls += 1
        if self.random is not None:  # random ops draw micro-batch mb's block of the whole batch's draw
            self.random.micro = mb
        env: dict[Ref, Any] = dict(zip(self.inputs, boundary))
        for n in self.nodes:
            if n.is_placeholder:
                if n.name in self.values:
                    env[Ref(n.name, 0)] = self.values[n.name]
                else:
                    env[Ref(n.name, 0)] = self.store[mb][self.inputs_of[n.name]]
                continue
            if n.name in self.given:
                continue  # a forwarded boundary value (another output of its op, unread here, is not sent)
            if n.name in self.randoms:  # the counter-based draw (its math differentiable: autograd's backward)
                out = self.randoms[n.name](*[env[r] for r in n.inputs])
            else:
                args = map_aggregate(n.args, lambda a: env[a] if isinstance(a, Ref) else a)
                kwargs = map_aggregate(n.kwargs, lambda a: env[a] if isinstance(a, Ref) else a)
                # a view recorded on fake tensors may rely on strides a drawn attention's dense output lacks
                out = (torch.ops.aten.reshape.default if n.target in _VIEWS else n.target)(*args, **kwargs)
            if len(n.outputs) == 1:
                env[Ref(n.name, 0)] = out
            else:
                for j, o in enumerate(out):
                    env[Ref(n.name, j)] = o
        outs = tuple(env[r].view_as(env[r]) if r in self.inputs else env[r] for r in self.outputs)
        if self.last:
            return outs[0] * self.weights[mb]
        return outs[0] if len(outs) == 1 else outs


class ScheduleStep(torch.autograd.Function):
    """The whole schedule as one autograd op: forward runs forward and backward of every
    micro-batch and returns the loss; backward hands out the stored gradients. ``runner.run(inputs,
    backward=True)`` -> (loss, per-parameter gradients); the mesh runtime's module runs through it too."""

    @staticmethod
    def forward(ctx, runner, inputs, *params):  # noqa: ARG004 - params only route the gradients
        loss, grads = runner.run(inputs, backward=True)
        ctx.grads = grads
        return loss

    @staticmethod
    def backward(ctx, g):
        return (None, None, *[None if x is None else x * g for x in ctx.grads])


class PipelinedModule(torch.nn.Module):
    """``model`` run by a pipelined plan on this rank (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, plan, example_inputs=(), example_kwargs: Optional[dict] = None,
                 group: Optional[dist.ProcessGroup] = None):
        super().__init__()
        pl = plan.pipeline
        if pl is None:
            raise ArgumentError("autopar pipelined: the plan has no pipeline (plan.pipeline is None)")
        others = [(n, s) for n, s in zip(pl["mesh_names"], pl["mesh_shape"]) if n != pl["axis"] and s > 1]
        if others:
            raise ArgumentError(f"autopar pipelined: a pipeline with other mesh axes {others} runs its stages' sharded "
                                "programs: build it with autopar.compile(model, mesh, example_inputs, plan=plan)")
        object.__setattr__(self, "model", model)  # not a child: the model's own tables become this module's (below)
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        pp = int(pl["degree"])
        if dist.get_world_size(self.group) != pp:
            raise ArgumentError(f"autopar pipelined: the plan pipelines over {pp} ranks, the process group has "
                                f"{dist.get_world_size(self.group)}")
        self.m = int(pl["microbatches"])
        self.schedule_name = pl["schedule"]
        ranks = list(pl["stage_ranks"])
        n_stages = len(ranks)
        args = as_args(example_inputs)
        kwargs = dict(example_kwargs or {})
        self.batch = next(int(v.shape[0]) for v in list(args) + list(kwargs.values())
                          if isinstance(v, torch.Tensor) and v.dim() >= 1)
        if self.batch % self.m:
            raise ArgumentError(f"autopar pipelined: {self.m} micro-batches do not divide the batch of {self.batch}")
        micro = micro_slices(args, kwargs, self.batch, self.m)[0]
        margs = tuple(micro[f"input:{i}"] for i in range(len(args)))
        mkwargs = {k: micro[k] for k in kwargs}
        graph = capture(model, margs, mkwargs, training=False)
        if not graph.outputs or graph.outputs[0] is None or graph.spec(graph.outputs[0]).shape != ():
            raise ArgumentError("autopar pipelined: the model must return its loss (a scalar) to be pipelined")
        refuse_buffer_updates(graph, "autopar pipelined")
        stage = stage_rule(graph, pl["stages"])
        # random ops (dropout): the single-device program's draw, not torch's generator's (see the docstring)
        self.random, randoms = pipelined_draws(graph, self.m, self.batch // self.m, self.group)

        values: dict[str, Any] = {}
        for fqn, name in graph.params.items():
            values[name] = model.get_parameter(fqn)
        for fqn, name in graph.buffers.items():
            values[name] = model.get_buffer(fqn)
        inputs_of = {name: key for key, name in graph.inputs.items()}
        # which values carry gradient
        carries: dict[Ref, bool] = {}
        for n in graph.nodes:
            for j, spec in enumerate(n.outputs):
                if spec is None:
                    continue
                if n.is_placeholder:
                    v = values.get(n.name)
                    c = isinstance(v, torch.nn.Parameter) and v.requires_grad
                else:
                    c = spec.dtype.is_floating_point and any(carries.get(r, False) for r in n.inputs)
                carries[Ref(n.name, j)] = c
        ops = [n for n in graph.nodes if not n.is_placeholder]
        home = {n.name: stage(n.name) for n in ops}
        readers: dict[Ref, set[int]] = {}
        for n in ops:
            for r in n.inputs:
                readers.setdefault(r, set()).add(home[n.name])
        loss = graph.outputs[0]
        readers.setdefault(loss, set()).add(n_stages)  # the loss leaves the last stage
        boundaries: list[list[Ref]] = [[] for _ in range(n_stages)]  # after stage s
        for n in ops:
            for j in range(len(n.outputs)):
                r = Ref(n.name, j)
                if not carries.get(r) or r not in readers:
                    continue
                for s in range(home[n.name], max(readers[r]) if r != loss else home[n.name]):
                    boundaries[s].append(r)
        by_name = {n.name: n for n in graph.nodes}
        self.store: list = []
        self.weights: list = []
        self.graph, self.values = graph, values
        self.stages = []
        mods = []
        for s in range(n_stages):
            if ranks[s] != self.rank:
                continue
            own = {n.name for n in ops if home[n.name] == s}
            need = set(own)
            todo = [r.node for name in own for r in by_name[name].inputs]
            inputs = boundaries[s - 1] if s > 0 else []
            given = {r.node for r in inputs}
            while todo:  # values made elsewhere that carry no gradient: recomputed here
                name = todo.pop()
                if name in need or name in given:
                    continue
                node = by_name[name]
                if not node.is_placeholder and any(carries.get(Ref(name, j)) for j in range(len(node.outputs))):
                    raise ArgumentError(f"autopar pipelined: stage {s} reads {graph.user_name(Ref(name))} from a "
                                        "non-adjacent stage without its gradient path; this model does not cut cleanly")
                need.add(name)
                todo += [r.node for r in node.inputs]
            nodes = [n for n in graph.nodes if n.name in need or n.name in given]
            outputs = [loss] if s == n_stages - 1 else boundaries[s]
            read = {n.name: values[n.name] for n in nodes if n.is_placeholder and n.name in values}
            mods.append(_Stage(graph, nodes, inputs, outputs, read, inputs_of, self.store, self.weights, self.m,
                               s == n_stages - 1, {k: v for k, v in randoms.items() if k in need}, self.random))
            # static metadata from the graph (no shape inference run): requires_grad marks what gets gradients
            def example(r: Ref, grad: bool = True) -> torch.Tensor:
                spec = graph.spec(r)
                return torch.empty(spec.shape, dtype=spec.dtype, requires_grad=grad)

            ins = tuple(example(r, s > 0) for r in inputs) if s > 0 else (torch.empty(self.batch // self.m),)
            outs = (torch.empty(()),) if s == n_stages - 1 else tuple(example(r) for r in outputs)
            self.stages.append(PipelineStage(mods[-1], s, n_stages, torch.device("cpu"), input_args=ins,
                                             output_args=outs, group=self.group))
        self._mods = mods
        cls = _SCHEDULES[self.schedule_name]
        single = self.schedule_name in ("GPipe", "1F1B")
        loss_fn = _take_loss
        self.schedule = cls(self.stages[0] if single else self.stages, self.m, loss_fn=loss_fn, scale_grads=False)
        self.last_rank = ranks[-1]
        self.params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        where: dict[int, set[int]] = {}
        for m_ in range(n_stages):
            for n in graph.nodes:
                if n.is_placeholder and n.name in graph.params.values() and any(
                        home.get(u) == m_ for u in graph.users()[n.name] if u in home):
                    where.setdefault(id(values[n.name]), set()).add(ranks[m_])
        self.shared = {id(p) for p in self.params if len(where.get(id(p), ())) > 1}
        # the rank holds only the parameters its stages read (the others would go stale: runtime.pipeline_state)
        def keep(fqn: str) -> bool:  # read here, read by no stage, or never updated (no gradient)
            p = model.get_parameter(fqn)
            return not p.requires_grad or self.rank in where.get(id(p), {self.rank})

        self._dropped = drop_parameters(model, keep)
        self.params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        held = {id(p) for p in model.parameters()}  # (and no reference to the dropped ones is kept here)
        self.values = {k: v for k, v in values.items() if not isinstance(v, torch.nn.Parameter) or id(v) in held}
        # last: ``parameters()``, ``state_dict()`` and ``load_state_dict`` by the model's own names
        tc.share_tables(self, model)

    def train(self, mode: bool = True) -> "PipelinedModule":
        """Set training mode on this module and the model (whose root is not a child of it)."""
        super().train(mode)
        self.model.training = mode
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` by the single-device model's names; the entries of parameters
        other pipeline ranks hold are checked and skipped (``runtime.pipeline_state``); ``RANDOM_KEY``
        sets the random draws' seed and step."""
        state_dict = take_random_state(self.random, state_dict)
        return self.model.load_state_dict(without_dropped(state_dict, self._dropped), strict=strict, assign=assign)

    def state_dict(self, *args, **kwargs):
        """The held parameters and every buffer by the model's names; with random ops also
        ``RANDOM_KEY`` (``[seed, next step]``, a plain tensor: every rank's is the same)."""
        out = super().state_dict(*args, **kwargs)
        if self.random is not None:
            out[kwargs.get("prefix", "") + RANDOM_KEY] = random_tensor(self.random)
        return out

    def run(self, inputs: tuple, backward: bool):
        """One step of the schedule on ``inputs`` (every rank passes the whole batch): the loss on every
        rank and, with ``backward``, this rank's gradient per parameter (None where it has none)."""
        args, kwargs = inputs
        self.store[:] = micro_slices(args, kwargs, self.batch, self.m)
        self.weights[:] = loss_weights(self.graph, self.store, self.values)
        for mod in self._mods:
            mod.calls = 0
        dummy = torch.zeros(self.batch)
        target = torch.zeros(self.batch)
        losses: list = []
        first = any(st.is_first for st in self.stages)
        last = any(st.is_last for st in self.stages)
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            run_schedule(self.schedule, backward, *((dummy,) if first else ()), target=target if last else None,
                         losses=losses if last else None)
            grads = [p.grad for p in self.params]
        finally:
            for p, g in zip(self.params, saved):
                p.grad = g
        for p_i, p in enumerate(self.params):
            if id(p) in self.shared:
                g = grads[p_i] if grads[p_i] is not None else torch.zeros_like(p)
                dist.all_reduce(g, group=self.group)
                grads[p_i] = g
        total = torch.stack([x.detach() for x in losses]).sum() if last else torch.zeros(())
        total = total.to(self.graph.spec(self.graph.outputs[0]).dtype).clone()  # the model's loss dtype
        dist.broadcast(total, group_src=self.last_rank, group=self.group)
        return total, grads

    def forward(self, *args, **kwargs):
        try:
            if not torch.is_grad_enabled():
                return self.run((args, kwargs), backward=False)[0]
            return ScheduleStep.apply(self, (args, kwargs), *self.params)
        finally:
            if self.random is not None:  # the next step draws new numbers (as ParallelModule)
                self.random.step += 1


def run_schedule(schedule, backward: bool, *args, **kwargs) -> None:
    """One step of torch's ``schedule`` (forward and backward of every micro-batch), or without
    ``backward`` its forwards only (``eval``, under ``no_grad``). A schedule that runs a lowered
    action order runs only its forward actions then (``_torch_compat.forward_only``): torch 2.13's
    ``eval`` of ZBVZeroBubble would run the V's same-rank backward hand-over and fail."""
    if backward:
        with torch.enable_grad():
            schedule.step(*args, return_outputs=False, **kwargs)
        return
    only = tc.forward_only(schedule) if tc.runs_action_order(schedule) else contextlib.nullcontext()
    with torch.no_grad(), only:
        schedule.eval(*args, return_outputs=False, **kwargs)


_SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
              "ZBVZeroBubble": ScheduleZBVZeroBubble}


def _take_loss(output, target):  # noqa: ARG001 - the last stage's output is the micro-batch's loss already
    return output


def pipelined(model: torch.nn.Module, plan, example_inputs=(), example_kwargs: Optional[dict] = None,
              group: Optional[dist.ProcessGroup] = None) -> PipelinedModule:
    """``model`` run by ``plan`` (a pipelined plan) on this rank of ``group`` (default: the world)."""
    return PipelinedModule(model, plan, example_inputs, example_kwargs, group)


__all__ = ["PipelinedModule", "ScheduleStep", "pipelined", "run_schedule"]
