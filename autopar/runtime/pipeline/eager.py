"""Running a pipelined plan on torch.distributed.pipelining (the pipeline axis alone: ``pp`` ranks).

``PipelinedModule(model, plan, graph, batch)`` runs the model's forward graph, captured at the
micro-batch's shape by the driver (``autopar.api.pipelined``, ``training=False``), cut into the
plan's stages by the planner's own rule (``ir.stages.cut_graph``: what runs before the layers goes to
the first stage, each layer instance to the stage the plan lists it in, what runs after the layers to
the last stage). Each stage is an ``nn.Module`` that interprets its ops eagerly (autograd records
them) on the model's own parameters and buffers, so gradients land in the model's ``.grad``. torch's public ``PipelineStage`` and
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
rank: the whole batch's loss, each micro-batch's loss times its weight (``pipeline.loss``: 1/m, or
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

With other mesh axes, ``runtime/pipeline/sharded.py`` runs each stage's slice of the plan's lowered
sharded program (``autopar.compile`` picks it). Not built here: the split backward through autopar's
own lowered programs (torch's autograd split is used for ZBV), point-to-point transfers in records.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.fx.node import map_aggregate

from autopar import _torch_compat as tc
from autopar.errors import ArgumentError
from autopar.ir.graph import Graph, Ref
from autopar.ir.stages import cut_graph, stage_rule
from autopar.program.program import RandomOp, RandomState
from autopar.runtime.pipeline.loss import loss_weights, on_device
from autopar.runtime.pipeline.schedule import SCHEDULES, ScheduleStep, micro_slices, run_schedule, take_loss
from autopar.runtime.pipeline.state import drop_parameters, without_dropped
from autopar.runtime.random_state import RANDOM_KEY, pipelined_draws, random_tensor, take_random_state


def check_alone(plan, group: Optional[dist.ProcessGroup] = None) -> None:
    """An ``ArgumentError`` unless ``plan`` pipelines over the pipeline axis alone, on as many ranks as
    ``group`` (default: the world) has."""
    pl = plan.pipeline
    if pl is None:
        raise ArgumentError("autopar pipelined: the plan has no pipeline (plan.pipeline is None)")
    others = [(n, s) for n, s in zip(pl.mesh_names, pl.mesh_shape) if n != pl.axis and s > 1]
    if others:
        raise ArgumentError(f"autopar pipelined: a pipeline with other mesh axes {others} runs its stages' sharded "
                            "programs: build it with autopar.compile(model, mesh, example_inputs, plan=plan)")
    pp, size = pl.degree, dist.get_world_size(group or dist.group.WORLD)
    if size != pp:
        raise ArgumentError(f"autopar pipelined: the plan pipelines over {pp} ranks, the process group has {size}")


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


class _Stage(torch.nn.Module):
    """One pipeline stage: its ops in graph order, run on the model's parameters and buffers (only
    those its ops read: ``values``), its random ops drawn by ``randoms`` (node name -> ``RandomOp``)."""

    def __init__(self, graph: Graph, nodes: list, inputs: list[Ref], outputs: list[Ref], values: dict[str, Any],
                 inputs_of: dict[str, str], store: list, weights: list, m: int, last: bool,
                 randoms: dict[str, RandomOp], random: Optional[RandomState], device: Optional[torch.device]):
        super().__init__()
        self.device = device  # where the captured factory ops make their tensors (None: as captured)
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
                kwargs = on_device(kwargs, self.device)  # the captured factory ops' device=: the stage's
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


class PipelinedModule(torch.nn.Module):
    """``model`` run by a pipelined plan on this rank (see the module docstring): ``graph`` is its
    forward captured at the micro-batch's shape, ``batch`` the whole batch's rows, ``device`` the rank's
    device (the process group's: ``compile``'s; None: the CPU), where the model is moved and the stages run."""

    def __init__(self, model: torch.nn.Module, plan, graph: Graph, batch: int,
                 group: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None):
        super().__init__()
        check_alone(plan, group)
        self.device = device
        if device is not None:
            model.to(device)
        pl = plan.pipeline
        object.__setattr__(self, "model", model)  # not a child: the model's own tables become this module's (below)
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.m, self.batch = pl.microbatches, batch
        self.schedule_name = pl.schedule
        ranks = list(pl.stage_ranks)
        n_stages = len(ranks)
        if not graph.outputs or graph.outputs[0] is None or graph.spec(graph.outputs[0]).shape != ():
            raise ArgumentError("autopar pipelined: the model must return its loss (a scalar) to be pipelined")
        # random ops (dropout): the single-device program's draw, not torch's generator's (see the docstring)
        self.random, randoms = pipelined_draws(graph, self.m, self.batch // self.m, self.group)
        values: dict[str, Any] = {}
        for fqn, name in graph.params.items():
            values[name] = model.get_parameter(fqn)
        for fqn, name in graph.buffers.items():
            values[name] = model.get_buffer(fqn)
        trainable = {k for k, v in values.items() if isinstance(v, torch.nn.Parameter) and v.requires_grad}
        cut = cut_graph(graph, stage_rule(graph, pl.stages), n_stages, trainable)
        self.store: list = []
        self.weights: list = []
        self.graph, self.values = graph, values
        self.stages, self._mods = [], []
        for s in range(n_stages):
            if ranks[s] == self.rank:
                self._add_stage(cut, s, n_stages, {name: key for key, name in graph.inputs.items()}, randoms)
        single = self.schedule_name in ("GPipe", "1F1B")
        self.schedule = SCHEDULES[self.schedule_name](self.stages[0] if single else self.stages, self.m,
                                                      loss_fn=take_loss, scale_grads=False)
        self.last_rank = ranks[-1]
        self._hold_own_parameters(cut.home, ranks)
        # last: ``parameters()``, ``state_dict()`` and ``load_state_dict`` by the model's own names
        tc.share_tables(self, model)

    def _add_stage(self, cut, s: int, n_stages: int, inputs_of: dict, randoms: dict) -> None:
        """Stage ``s``'s module (its ops of ``cut``) and torch's ``PipelineStage`` around it."""
        graph, values = self.graph, self.values
        inputs = cut.boundaries[s - 1] if s > 0 else []
        given = {r.node for r in inputs}
        need = cut.runs[s]
        last = s == n_stages - 1
        nodes = [n for n in graph.nodes if n.name in need or n.name in given]
        outputs = [graph.outputs[0]] if last else cut.boundaries[s]
        read = {n.name: values[n.name] for n in nodes if n.is_placeholder and n.name in values}
        mod = _Stage(graph, nodes, inputs, outputs, read, inputs_of, self.store, self.weights, self.m, last,
                     {k: v for k, v in randoms.items() if k in need}, self.random, self.device)
        self._mods.append(mod)

        # static metadata from the graph (no shape inference run): requires_grad marks what gets gradients
        dev = self.device

        def example(r: Ref, grad: bool = True) -> torch.Tensor:
            spec = graph.spec(r)
            return torch.empty(spec.shape, dtype=spec.dtype, device=dev, requires_grad=grad)

        ins = tuple(example(r, s > 0) for r in inputs) if s > 0 else (torch.empty(self.batch // self.m, device=dev),)
        outs = (torch.empty((), device=dev),) if last else tuple(example(r) for r in outputs)
        self.stages.append(PipelineStage(mod, s, n_stages, dev or torch.device("cpu"), input_args=ins, output_args=outs,
                                         group=self.group))

    def _hold_own_parameters(self, home: dict[str, int], ranks: list) -> None:
        """Drop the parameters no stage of this rank reads (they would go stale: ``pipeline.state``);
        note those read on several ranks (their gradients are summed over the group)."""
        graph, model, values = self.graph, self.model, self.values
        params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        where: dict[int, set[int]] = {}
        for s in range(len(ranks)):
            for n in graph.nodes:
                if n.is_placeholder and n.name in graph.params.values() and any(
                        home.get(u) == s for u in graph.users()[n.name] if u in home):
                    where.setdefault(id(values[n.name]), set()).add(ranks[s])
        self.shared = {id(p) for p in params if len(where.get(id(p), ())) > 1}

        def keep(fqn: str) -> bool:  # read here, read by no stage, or never updated (no gradient)
            p = model.get_parameter(fqn)
            return not p.requires_grad or self.rank in where.get(id(p), {self.rank})

        self._dropped = drop_parameters(model, keep)
        self.params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        held = {id(p) for p in model.parameters()}  # (and no reference to the dropped ones is kept here)
        self.values = {k: v for k, v in values.items() if not isinstance(v, torch.nn.Parameter) or id(v) in held}

    def train(self, mode: bool = True) -> "PipelinedModule":
        """Set training mode on this module and the model (whose root is not a child of it)."""
        super().train(mode)
        self.model.training = mode
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` by the single-device model's names; the entries of parameters
        other pipeline ranks hold are checked and skipped (``runtime.pipeline.state``); ``RANDOM_KEY``
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
        if self.device is not None:  # the user's inputs, on the stages' device
            self.store[:] = [{k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                              for k, v in mb.items()} for mb in self.store]
        self.weights[:] = loss_weights(self.graph, self.store, self.values, self.device)
        for mod in self._mods:
            mod.calls = 0
        dummy = torch.zeros(self.batch, device=self.device)
        target = torch.zeros(self.batch, device=self.device)
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
        total = torch.stack([x.detach() for x in losses]).sum() if last else torch.zeros((), device=self.device)
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


__all__ = ["PipelinedModule", "check_alone"]
