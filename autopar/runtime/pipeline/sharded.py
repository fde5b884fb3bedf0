"""Running a pipelined plan with other mesh axes (pp x dp, pp x tp, ...): each stage runs its part of
the plan's lowered sharded program on the stage mesh.

``autopar.compile`` builds it for a plan whose ``plan.pipeline`` has other axes than ``pp``: the
driver captures the model at the micro-batch's shape, lowers the plan (tagged) for this rank's
coordinates on the stage mesh (the mesh without ``pp``) and cuts the program into stages
(``passes.lower.stages``); this module runs the staged program (``program.staged.StagedProgram``).
Parameters and buffers become DTensors on the stage mesh with the plan's placements (as ``compile``
makes them: optimizers, ``state_dict`` and DCP work on them).

One step (``pmodel(*inputs)`` then ``loss.backward()``), every rank:

1. the static part (parameter gathers, casts, tables) runs once;
2. torch's ``PipelineStage`` and schedule (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble) run the micro-batches:
   each local stage is a module whose forward is one autograd op running that stage's forward
   slice of the program, and whose backward runs the stage's backward slice; boundary values cross
   between ranks of equal stage-mesh coordinates as this rank's local blocks; a gradient goes back
   in the slot of the forward boundary value of the same local shape; the unreduced parameter
   gradients are summed over the micro-batches; under ZBVZeroBubble a stage's backward is cut in
   two (``passes.lower.stages._split_backward``): its I action runs the input-gradient part (what goes to
   the previous stage), its W action (torch's ``dw_builder`` hook of ``PipelineStage``) the rest,
   which makes the unreduced parameter gradients; the plan's gradient reductions still run once per
   step, on the sums (below), as the price charges them;
3. the per-step part runs once on the sums: the plan's gradient reductions (its buckets, which a
   pipelined plan keeps within a stage) of the parameters this rank's stages read; the other
   gradients are zeros; a weight read in two stages (tied embedding and head) then has its two partial gradients summed
   over the pipeline group.

The loss is the whole batch's: each micro-batch's loss enters it with its weight
(``pipeline.loss.loss_weights``: 1/m, or for a cross-entropy mean its counted targets over the
batch's, so unequal ``ignore_index`` counts give the batch's mean, not the mean of means), returned
on every rank; gradients land in ``.grad`` as DTensors placed as
their parameters, on the ranks whose stages read them (None elsewhere).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from autopar import _torch_compat as tc
from autopar.errors import ArgumentError
from autopar.ir.placement import local_block
from autopar.ir.stages import forward_readers
from autopar.program import collectives as C
from autopar.program.collectives import Executed
from autopar.program.staged import SHAPE, StageCut, StagedProgram, boundary_pairs
from autopar.runtime.accounting import compare, pipelined_predicted, static_values
from autopar.runtime.collectives import ProcessGroupComm, axis_label, record_executed
from autopar.runtime.pipeline.loss import loss_weights
from autopar.runtime.pipeline.schedule import SCHEDULES, ScheduleStep, micro_slices, run_schedule, take_loss
from autopar.runtime.pipeline.state import local_state, without_dropped
from autopar.runtime.random_state import add_random_entry, pipelined_random, take_random_entry
from autopar.runtime.state import as_blocks, state_slots


class _StageFn(torch.autograd.Function):
    """One micro-batch of a stage: forward runs the stage's forward slice, backward its backward slice."""

    @staticmethod
    def forward(ctx, mod: "_Stage", anchor, *f_in):  # noqa: ARG004 - anchor: makes the outputs want gradients
        run, cut = mod.runner, mod.cut
        mb = mod.calls
        mod.calls += 1
        run.at_micro(mb)
        ins = [run.statics[i] for i in cut.f_statics] + [run.given[mb][k] for k in cut.f_given] + list(f_in)
        with run.context():
            outs = [C.wait(o) for o in cut.forward(*ins)]
        n = len(cut.f_out)
        ctx.mod, ctx.stash, ctx.mb = mod, outs[n:], mb
        ctx.shapes = [(tuple(x.shape), x.dtype) for x in f_in]
        res = [o.contiguous() for o in outs[:n]]
        return tuple(res) if len(res) > 1 else res[0]

    @staticmethod
    def backward(ctx, *grads):
        mod = ctx.mod
        run, cut = mod.runner, mod.cut
        g_in = [grads[k] for k in mod.pair_in]
        tangent = [grads[0]] if cut.tangent else []
        ins = list(ctx.stash) + [run.statics[i] for i in cut.b_statics] + g_in + tangent
        ctx.stash = None
        run.at_micro(ctx.mb)
        if cut.backward_input is not None:  # zero bubble: the weight part waits for the stage's W action
            with run.context():
                outs = [C.wait(o) for o in cut.backward_input(*ins)]
            g_out = outs[:len(cut.g_out)]
            mod.pending.append((ctx.mb, ins + outs[len(cut.g_out):]))
        else:
            with run.context():
                outs = [C.wait(o) for o in cut.backward(*ins)]
            g_out = outs[:len(cut.g_out)]
            mod.accumulate(outs[len(cut.g_out):])
        carriers = [torch.zeros(s, dtype=d, device=run.device) for s, d in ctx.shapes]
        for k, slot in enumerate(mod.pair_out):
            carriers[slot] = g_out[k].contiguous()
        return (None, None, *carriers)


class _Stage(torch.nn.Module):
    """A pipeline stage as torch's ``PipelineStage`` runs it (see ``_StageFn``)."""

    def __init__(self, runner: "MeshPipelinedModule", cut: StageCut, last: bool):
        super().__init__()
        object.__setattr__(self, "runner", runner)
        self.cut, self.last, self.calls = cut, last, 0
        self.pair_in: list[int] = []
        self.pair_out: list[int] = []
        self.anchor = torch.zeros((), requires_grad=True, device=runner.device)
        self.pending: list = []  # zero bubble: inputs of weight parts whose W action has not run

    def accumulate(self, made: list) -> None:
        """Add one micro-batch's unreduced parameter gradients to the step's sums."""
        acc = self.runner.acc
        for fid, v in zip(self.cut.frontier, made):
            acc[fid] = v.clone() if acc[fid] is None else acc[fid].add_(v)

    def weight_runner(self):
        """torch's ``dw_builder``: called right after a micro-batch's input-gradient part, it takes
        that part's hand-over and returns what the stage's W action runs (the weight part)."""
        mb, ins = self.pending.pop()

        def run_weight() -> None:
            self.runner.at_micro(mb)
            with self.runner.context():
                self.accumulate([C.wait(o) for o in self.cut.backward_weight(*ins)])

        return run_weight

    def forward(self, *args):
        f_in = args if self.cut.f_in else ()
        mb = self.calls  # (counted by _StageFn.forward)
        out = _StageFn.apply(self, self.anchor, *f_in)
        return out * self.runner.weights[mb] if self.last else out


class _RecordedStage(PipelineStage):
    """torch's ``PipelineStage``, its point-to-point transfers (the boundary values and their
    gradients) recorded as ``Executed`` of kind ``send`` / ``recv`` on the pipeline axis while its
    module records (``record_collectives``): the functional-collective recorder does not see them."""

    def autopar_note(self, ops: list) -> list:
        out = self.autopar_owner._recording
        if out is not None:
            for op in ops:
                kind = "send" if op.op is dist.isend else "recv"
                out.append(Executed(kind, self.autopar_owner.plan.pipeline.axis,
                                    op.tensor.numel() * op.tensor.element_size()))
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        return self.autopar_note(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        return self.autopar_note(super().get_bwd_send_ops(bwd_chunk_id))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        return self.autopar_note(super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        return self.autopar_note(super().get_bwd_recv_ops(bwd_chunk_id))


class MeshPipelinedModule(torch.nn.Module):
    """``model`` run by a pipelined plan with other mesh axes on this rank (see the module docstring):
    ``staged`` is this rank's staged program, ``device_mesh`` the plan's whole mesh, ``groups`` the
    process groups of the stage mesh's axes (in ``plan.axis_names`` order) its collectives run on,
    ``device`` the one the program was lowered for (the process group's: ``compile``'s; None: the CPU),
    where the stages' examples, carriers, inputs and losses are made."""

    def __init__(self, model: torch.nn.Module, plan, staged: StagedProgram, device_mesh, groups: list,
                 device: Optional[torch.device] = None, joint: Optional[dict] = None):
        super().__init__()
        self.device = device
        graph, stage_of, program, cut = staged.graph, staged.stage_of, staged.program, staged.cut
        pl = plan.pipeline
        # random ops (dropout, the seed shared by the driver): each micro-batch draws its block of the batch's draw
        pipelined_random(program, graph, pl.microbatches, staged.batch // pl.microbatches)
        dmesh, batch = device_mesh, staged.batch
        stage_mesh = dmesh[tuple(n for n in pl.mesh_names if n != pl.axis)]
        self.graph, self.stage_of = graph, stage_of
        self.static_refs = static_values(graph)
        #: parameter FQN -> the stages whose forward ops read it (a tied embedding and head: two)
        self.param_stages = forward_readers(graph, stage_of)
        object.__setattr__(self, "module", model)
        self.plan, self.program, self.cutting = plan, program, cut
        self.device_mesh, self.stage_mesh = dmesh, stage_mesh
        self.m, self.batch = pl.microbatches, batch
        self.schedule_name = pl.schedule
        if self.schedule_name not in SCHEDULES:
            raise ArgumentError(f"autopar pipeline: the {self.schedule_name} schedule is not run with other mesh axes; "
                                f"plan with one of {sorted(SCHEDULES)}")
        if (self.schedule_name == "ZBVZeroBubble") != any(st.backward_weight is not None for st in cut.stages):
            raise ArgumentError("autopar pipeline: ZBVZeroBubble runs each stage's backward split in two "
                                "(passes.lower.stages.cut(..., split=True)); cut the program for the plan's schedule")
        self.pp_group = dmesh.get_group(pl.axis)
        self.pp_rank = dist.get_rank(self.pp_group)
        self.coords = tuple(int(c) for c in stage_mesh.get_coordinate())
        self._comm = ProcessGroupComm(groups, plan.axis_names, joint)  # joint: groups over stage-mesh axis tuples
        self._axis_of_group = {g.group_name: n for g, n in zip(groups, plan.axis_names)}
        stage_names = [n for n in pl.mesh_names if n != pl.axis]
        self._axis_of_group.update({g.group_name: axis_label(stage_names, a) for a, g in (joint or {}).items()})
        self._recording: Optional[list] = None
        ranks = list(pl.stage_ranks)
        n_stages = len(ranks)
        self.last_rank = ranks[-1]
        self.my_stages = [s for s in range(n_stages) if ranks[s] == self.pp_rank]
        # the parameters this rank holds: its stages' (the others' entries are None, runtime.pipeline.state)
        self.params, self._param_keys = [], []
        self._slots = state_slots(graph, program)
        #: name -> whole shape of the parameters other pipeline ranks hold (a state dict's entries skipped)
        self._dropped: dict[str, tuple] = {}
        for key, slot in self._slots.items():
            owner, _, name = key.rpartition(".")
            if slot.kind == "param" and tc.parameter_table(model.get_submodule(owner)).get(name) is None:
                self._dropped[key] = tuple(slot.spec.shape)
        for slot in program.inputs:
            if slot.kind == "param" and slot.key not in self._dropped:
                self._param_keys.append(slot.key)
                self.params.append(model.get_parameter(slot.key))
        grad_index = {s.key: i for i, s in enumerate(program.grads)}
        self._grad_of = [grad_index.get(k) for k in self._param_keys]
        self._state = []
        f_ph = [n for n in program.forward.graph.nodes if n.op == "placeholder"]
        for k in cut.state_slots:
            slot = program.inputs[k]
            owner, _, name = slot.key.rpartition(".")
            mod = model.get_submodule(owner)
            self._state.append((mod, name, slot.kind, f_ph[k].meta[SHAPE]))
        pairs = [boundary_pairs(cut.stages[s].f_out, cut.stages[s].g_in, f"stages {s} -> {s + 1}")
                 for s in range(n_stages - 1)]
        self.stages, mods = [], []
        for s in self.my_stages:
            sc = cut.stages[s]
            mod = _Stage(self, sc, s == n_stages - 1)
            mod.pair_in = pairs[s] if s < n_stages - 1 else []
            mod.pair_out = pairs[s - 1] if s > 0 else []
            mods.append(mod)

            def example(n, grad=True):
                shape, dtype = n.meta[SHAPE]
                return torch.empty(shape, dtype=dtype, device=device, requires_grad=grad and dtype.is_floating_point)

            ins = tuple(example(n) for n in sc.f_in) if s > 0 else (torch.empty(self.batch // self.m, device=device),)
            outs = (torch.empty((), device=device),) if s == n_stages - 1 else tuple(example(n) for n in sc.f_out)
            stage = _RecordedStage(mod, s, n_stages, device or torch.device("cpu"), input_args=ins, output_args=outs,
                                   group=self.pp_group, dw_builder=mod.weight_runner if sc.backward_weight else None)
            stage.autopar_owner = self
            self.stages.append(stage)
        self._mods = mods
        cls = SCHEDULES[self.schedule_name]
        single = self.schedule_name in ("GPipe", "1F1B")
        self.schedule = cls(self.stages[0] if single else self.stages, self.m, loss_fn=take_loss, scale_grads=False)
        self.weights: list = []  # per micro-batch, its loss's factor in the step's loss
        self.statics: list = []
        self.given: list = []
        self.acc: list = []
        self.steps = 0
        # last: the model's own tables become this module's (``parameters()``, ``state_dict()`` by the
        # model's names, as ``ParallelModule``); attributes set from here on go around nn.Module's setter
        tc.share_tables(self, model)

    def train(self, mode: bool = True) -> "MeshPipelinedModule":
        """Set training mode on this module and the model (whose root is not a child of it)."""
        super().train(mode)
        self.module.training = mode
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` by the single-device model's names: a plain tensor (a
        single-device state dict's, whole on every rank) is cut into this rank's block of the DTensor
        of that name; the entries of parameters other pipeline ranks hold are checked and skipped
        (``runtime.pipeline.state``). DTensors load as they are."""
        state_dict = take_random_entry(self.program, state_dict)  # seed and step of the random draws
        values = as_blocks(without_dropped(state_dict, self._dropped), self._slots, self.program, self.stage_mesh,
                           lambda slot: self.module.get_parameter(slot.key) if slot.kind == "param"
                           else self.module.get_buffer(slot.key))
        return self.module.load_state_dict(values, strict=strict, assign=assign)

    def state_dict(self, *args, **kwargs):
        """The held parameters and every buffer by the model's names; with random ops also ``RANDOM_KEY``
        (seed and step, replicated on every rank, as ``ParallelModule`` keeps it)."""
        return add_random_entry(super().state_dict(*args, **kwargs), self.program, self.device_mesh,
                                kwargs.get("prefix", ""))

    @contextlib.contextmanager
    def record_collectives(self):
        """The collectives that run inside the block (``Executed``), as ``ParallelModule`` records them,
        and the pipeline's point-to-point transfers (kinds ``send`` and ``recv``, on the pipeline axis)."""
        out: list = []
        object.__setattr__(self, "_recording", out)
        try:
            yield out
        finally:
            object.__setattr__(self, "_recording", None)

    def predicted(self) -> Counter:
        """Per (kind, axis, bytes): this rank's collectives and transfers in one step
        (``accounting.pipelined_predicted``)."""
        return pipelined_predicted(self)

    def differences(self, records) -> list[str]:
        """What differs between ``predicted`` and this rank's recorded collectives of one step (empty: equal)."""
        return compare(self.predicted(), records)

    def context(self):
        """The program's collectives on the stage mesh's groups, without autograd, recorded if asked."""
        stack = contextlib.ExitStack()
        stack.enter_context(C.use_backend(self._comm))
        stack.enter_context(torch.no_grad())
        if self._recording is not None:
            stack.enter_context(record_executed(self._axis_of_group, self._recording))
        return stack

    def _micro(self, args: tuple, kwargs: dict) -> list[dict[int, torch.Tensor]]:
        """Per micro-batch: input slot position -> this rank's block of the micro-batch's slice."""
        out: list[dict[int, torch.Tensor]] = [{} for _ in range(self.m)]
        for k, slot in enumerate(self.program.inputs):
            if slot.kind != "input":
                continue
            v = args[int(slot.key.split(":")[1])] if slot.key.startswith("input:") else kwargs[slot.key]
            parts = torch.tensor_split(v, self.m) if isinstance(v, torch.Tensor) and v.dim() >= 1 and \
                v.shape[0] == self.batch else [v] * self.m
            for i, part in enumerate(parts):
                if tuple(part.shape) != tuple(slot.spec.shape):
                    raise ArgumentError(f"autopar pipeline: input {slot.key!r}'s micro-batch has shape "
                                        f"{tuple(part.shape)}, the plan was made for {tuple(slot.spec.shape)}")
                block = local_block(part, slot.placements, self.program.mesh_shape, self.coords, slot.spec.blocks)
                out[i][k] = block if self.device is None else block.to(self.device, non_blocking=True)
        return out

    def run(self, inputs: tuple, backward: bool = True):
        """One step on ``inputs`` (every rank passes the whole batch): the loss on every rank and this
        rank's gradient per parameter (None for the parameters its stages do not read); without
        ``backward`` the forwards only (torch's ``eval`` of the schedule) and no gradients."""
        args, kwargs = inputs
        cut = self.cutting
        object.__setattr__(self, "given", self._micro(args, kwargs))
        model, graph = self.module, self.graph  # the tables as they are now (a loaded state may replace them)
        # the parameters this rank holds (others' are None: runtime.pipeline.state) and every buffer
        held = dict(model.named_parameters(remove_duplicate=False))
        values = {name: held[fqn] for fqn, name in graph.params.items() if fqn in held}
        values.update({name: model.get_buffer(fqn) for fqn, name in graph.buffers.items()})
        micro = micro_slices(args, kwargs, self.batch, self.m)
        object.__setattr__(self, "weights", loss_weights(graph, micro, values, self.device))
        state = [local_state(mod, name, kind, local, self.device) for mod, name, kind, local in self._state]
        with self.context():
            object.__setattr__(self, "statics", [C.wait(v) for v in cut.static(*state)])
        object.__setattr__(self, "acc", [None] * len(cut.frontier_shapes))
        for mod in self._mods:
            mod.calls = 0
        first = any(st.is_first for st in self.stages)
        last = any(st.is_last for st in self.stages)
        losses: list = []
        run_schedule(self.schedule, backward, *((torch.zeros(self.batch, device=self.device),) if first else ()),
                     target=torch.zeros(self.batch, device=self.device) if last else None,
                     losses=losses if last else None)
        if not backward:
            for name in ("statics", "given", "acc"):
                object.__setattr__(self, name, [])
            return self._loss(losses, last), []
        front = [a if a is not None else torch.zeros(s, dtype=d, device=self.device)
                 for a, (s, d) in zip(self.acc, cut.frontier_shapes)]
        with self.context():
            reduced = [C.wait(g) for g in cut.reduce(*front)]
        for name in ("statics", "given", "acc"):
            object.__setattr__(self, name, [])
        mine = set(self.my_stages)
        stage_rank = list(self.plan.pipeline.stage_ranks)
        grads = []
        for p, key, gi in zip(self.params, self._param_keys, self._grad_of):
            if gi is None:
                grads.append(None)
                continue
            where = self.param_stages.get(key, set())
            g = reduced[gi]
            if len({stage_rank[s] for s in where}) > 1:  # read on several ranks: the partial sums added
                g = g.contiguous()
                dist.all_reduce(g, group=self.pp_group)
            elif not (where & mine):
                grads.append(None)
                continue
            grads.append(tc.dtensor_from_spec(g, tc.dtensor_spec(p)))
        return self._loss(losses, last), grads

    def at_micro(self, mb: int) -> None:
        """Random ops (dropout) of what runs next draw micro-batch ``mb``'s block of the whole batch."""
        if self.program.random is not None:
            self.program.random.micro = mb

    def _loss(self, losses: list, last: bool) -> torch.Tensor:
        """The step's loss (the micro-batch losses, each times its weight, summed) on every rank."""
        total = torch.stack([x.detach() for x in losses]).sum() if last else torch.zeros((), device=self.device)
        total = total.to(self.graph.spec(self.graph.loss).dtype).clone()  # the model's loss dtype (float64 too)
        dist.broadcast(total, group_src=self.last_rank, group=self.pp_group)
        return total

    def forward(self, *args, **kwargs):
        """The whole step's forward and backward; returns the loss (``loss.backward()`` delivers the
        gradients). Under ``torch.no_grad()``: the forwards only, the loss."""
        object.__setattr__(self, "steps", self.steps + 1)
        try:
            return self._step(args, kwargs)
        finally:
            if self.program.random is not None:  # the next step draws new numbers (as ParallelModule)
                self.program.random.step += 1

    def _step(self, args: tuple, kwargs: dict):
        if not torch.is_grad_enabled():  # the forwards only (evaluation)
            return self.run((args, kwargs), backward=False)[0]
        return ScheduleStep.apply(self, (args, kwargs), *self.params)


__all__ = ["MeshPipelinedModule"]
