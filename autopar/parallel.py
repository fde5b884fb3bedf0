"""``autopar.compile``: a model, a mesh and a plan become a ``ParallelModule`` on torch.distributed.

Every rank calls ``compile`` with the same arguments. Rank 0 plans (or loads the given plan) and
broadcasts it; every rank captures the model, and all ranks compare their graph fingerprints
before any collective of the program runs, so ranks that disagree fail loudly instead of hanging.
Each rank lowers the plan for its own mesh coordinates. Parameters and buffers become ``DTensor``s
with the plan's placements, so optimizers, ``state_dict`` and ``torch.distributed.checkpoint``
work on them unchanged; ``forward`` runs the lowered forward program and the loss's backward runs
the lowered backward program, whose gradients arrive as DTensors placed like their parameters.
Random ops draw from rank 0's seed and a per-forward step (``state_dict``: ``RANDOM_KEY``). A pipelined
plan's module runs its stages (``runtime.pipeline``): the driver captures one micro-batch, lowers and
cuts the program into stages (``passes.lower.stages``), and hands the runtime the staged program."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from autopar import _torch_compat as tc
from autopar.cost_model.mesh import Mesh, require_mesh
from autopar.errors import CompileError
from autopar.ir.graph import Graph
from autopar.ir.placement import format_placements, from_dtensor, local_block
from autopar.passes.lower import lower, resolve
from autopar.plans import Plan
from autopar.program import collectives as C
from autopar.program.program import Program, Slot, compile_backend
from autopar.program.staged import compile_cut
from autopar.runtime import faults
from autopar.runtime.collectives import (ProcessGroupComm, axis_label, joint_groups, joint_pairs, record_executed,
                                        single_worker_gloo_groups)
from autopar.runtime.memory import MemoryTracker, optimizer_state
from autopar.runtime.consensus import check_plan_mesh, check_same_capture, chosen_mesh, share_plan, warn_node_layout
from autopar.runtime.outputs import OUTPUT_MODES, placed_output, step_result
from autopar.runtime.precision import EXECUTABLE_PRECISIONS, execution_precision
from autopar.runtime.random_state import RANDOM_KEY, add_random_entry, at_step, share_seed, take_random_entry
from autopar.runtime.step import Step
from autopar.runtime.state import as_blocks, distribute_state, state_slots
from autopar.validate import check_choice, check_kwargs, check_model, check_path


def _match_group_timeouts(dmesh) -> Optional[float]:
    """Give the mesh's groups the default group's collective timeout (``init_device_mesh`` gives the
    groups it makes torch's 30-minute default) -> that timeout in seconds, or None if unknown."""
    td = tc.group_timeout()
    if td is None:
        return None
    for i in range(dmesh.ndim):
        group = dmesh.get_group(i)
        if tc.group_timeout(group) != td:
            tc.set_group_timeout(group, td)
    return td.total_seconds()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local block, without ``to_local``'s autograd node (programs run without grad)."""
    return tc.local_tensor(t)


class ParallelModule(torch.nn.Module):
    """The user's model, run as its plan's sharded program on this rank (see ``autopar.compile``).

    Its parameters, buffers and submodules are the model's, under the model's own names:
    ``state_dict()`` keys match the single-device model's, so a single-device state dict loads by
    name (``load_state_dict``; tensors are resharded into the DTensors' blocks) and back. The model
    itself is ``.module``."""

    def __init__(self, model: torch.nn.Module, plan: Plan, graph: Graph, dmesh, program: Program,
                 precision: str, groups: Optional[Sequence] = None, outputs: str = "dtensor",
                 device: Optional[torch.device] = None, joint: Optional[dict] = None):
        super().__init__()
        # the model's own tables become this module's (tc.share_tables, at the end): state_dict,
        # named_parameters and load_state_dict use the single-device model's names, no "module." prefix.
        # ``module`` is a plain attribute, not a submodule, so it adds no name of its own.
        object.__setattr__(self, "module", model)
        self.plan = plan
        self.graph = graph
        self.device_mesh = dmesh
        self.program = program
        self.precision = precision
        #: the program's device, where inputs are moved (None: they run where they are)
        self._device = device
        self._collective_timeout_s = _match_group_timeouts(dmesh)
        #: Forward calls so far: the step number failure messages give (``autopar.runtime.faults``).
        self.steps = 0
        faults.note_step(None)  # a new program: no step of an earlier one is reported for it
        # the program's own groups (``compile``: one gloo worker each), else the device mesh's
        groups = list(groups) if groups is not None else [dmesh.get_group(i) for i in range(dmesh.ndim)]
        # ``joint``: the groups over several axes the program's joint all-to-alls run on (``compile``)
        self._comm = ProcessGroupComm(groups, plan.axis_names, joint)
        self._axis_of_group = {g.group_name: name for g, name in zip(groups, plan.axis_names)}
        self._axis_of_group.update({g.group_name: axis_label(plan.axis_names, a) for a, g in (joint or {}).items()})
        self._recording: Optional[list] = None
        self._outputs = outputs  # how the model's other outputs come back (``runtime.outputs.OUTPUT_MODES``)
        self._memory: Optional[MemoryTracker] = None
        self._memory_optimizer: Optional[torch.optim.Optimizer] = None
        self._param_slots = [s for s in program.inputs if s.kind == "param"]
        self._grad_index = {s.key: i for i, s in enumerate(program.grads)}
        # (owning module, attribute) of every parameter and buffer slot: looked up every step
        # (a parameter may be replaced), without walking module paths each time
        self._owners = {}
        for s in program.inputs:
            if s.kind in ("param", "buffer"):
                owner, _, name = s.key.rpartition(".")
                self._owners[s.key] = (model.get_submodule(owner), name)
        tc.share_tables(self, model)  # last: from here on, attributes named like the model's children clash

    def train(self, mode: bool = True) -> "ParallelModule":
        """Set training mode on this module and the model (whose root is not a child of it)."""
        super().train(mode)
        self.module.training = mode
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` by the single-device model's names; a plain tensor (from a
        single-device state dict, whole on every rank) is cut into this rank's block of the DTensor
        of the same name first, without communication. DTensors load as they are."""
        state_dict = take_random_entry(self.program, state_dict)  # seed and step of the random draws
        values = as_blocks(state_dict, state_slots(self.graph, self.program), self.program, self.device_mesh,
                           self._state)
        # the model's own method: its hooks, ``_load_from_state_dict`` overrides and version run
        return self.module.load_state_dict(values, strict=strict, assign=assign)

    def state_dict(self, *args, **kwargs):
        """The model's ``state_dict`` (its own hooks and overrides run): the single-device names, each
        parameter and buffer a DTensor placed as the plan says; with random ops also ``RANDOM_KEY``
        (seed and step, so a restored run draws the masks the saved one would have drawn next)."""
        return add_random_entry(self.module.state_dict(*args, **kwargs), self.program, self.device_mesh,
                                kwargs.get("prefix", ""))

    def _state(self, slot: Slot) -> torch.Tensor:
        return self._param(slot.key) if slot.kind == "param" else self._buffer(slot.key)

    # -- what users look at ---------------------------------------------------------------------
    @property
    def code(self) -> str:
        """The Python source of this rank's lowered program."""
        return self.program.code

    @contextlib.contextmanager
    def record_collectives(self) -> Iterator[list]:
        """Lists the collectives that actually run inside the block (``Executed``: kind, mesh axis,
        bytes as the axis group sees them), intercepted at torch's collective ops."""
        out: list = []
        self._recording = out
        try:
            yield out
        finally:
            self._recording = None

    def track_memory(self, optimizer: Optional[torch.optim.Optimizer] = None, enabled: bool = True) -> "ParallelModule":
        """Measure each step's memory on this rank from the next forward on (``memory_stats``);
        ``optimizer`` is the one that steps this module (its state is counted as ``optimizer``).
        Measuring costs time (every op is watched): switch it off with ``enabled=False``."""
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise CompileError(f"track_memory: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        object.__setattr__(self, "_memory", MemoryTracker(self._device) if enabled else None)
        object.__setattr__(self, "_memory_optimizer", optimizer if enabled else None)
        return self

    def memory_stats(self) -> dict[str, int]:
        """This rank's measured memory in the last step (forward and backward) since
        ``track_memory``, in bytes: ``peak``, the peak of the distinct storages live during the
        step, and what they held at that moment: ``params`` (parameters and buffers), ``grads``,
        ``optimizer`` (the state of the optimizer given to ``track_memory``), ``activations``
        (what the forward saved for the backward) and ``temporaries`` (the rest: values between
        ops, collective and bucket buffers); ``step``, the steps measured so far. On CUDA also
        ``cuda_allocated_peak`` and ``cuda_reserved_peak``: the caching allocator's peaks in the
        step (``runtime.memory``). Compare with ``plan.memory`` from the second step on, once the
        optimizer holds its state."""
        if self._memory is None:
            raise CompileError("memory_stats: memory is not being measured: call pmodel.track_memory(optimizer) "
                               "before the steps to measure")
        if self._memory.last is None:
            raise CompileError("memory_stats: no step has finished since track_memory: run a forward and backward first")
        return dict(self._memory.last)

    # -- running -------------------------------------------------------------------------------
    def _begin_memory(self, params: Sequence[torch.Tensor], rest: Sequence[torch.Tensor]) -> None:
        """Start measuring a step: what lives before it is the state, the optimizer's and the inputs."""
        buffers = [self._buffer(s.key) for s in self.program.inputs if s.kind == "buffer"]
        grads = [p.grad for p in params if p.grad is not None]
        self._memory.begin(params=list(params) + buffers, optimizer=optimizer_state(self._memory_optimizer),
                           grads=grads, inputs=[r for r in rest if isinstance(r, torch.Tensor)])

    def _context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(C.use_backend(self._comm))
        stack.enter_context(torch.no_grad())
        if self._recording is not None:
            stack.enter_context(record_executed(self._axis_of_group, self._recording))
        if self._memory is not None:
            stack.enter_context(self._memory.watching())
        return stack

    def _failed(self, exc: BaseException, what: str) -> BaseException:
        """``exc`` as a ``CollectiveError`` naming this rank, the step and the likely culprit when it is a
        failed collective (a peer died, hung or raised); ``exc`` itself otherwise."""
        return faults.report_collective_failure(exc, what, self._collective_timeout_s) or exc

    def _run_forward(self, local_inputs: list) -> tuple[list, list]:
        try:
            with self._context():
                outs, saved = self.program.run_forward(*local_inputs)
        except Exception as exc:
            err = self._failed(exc, "the forward")
            if err is exc:
                raise
            raise err from exc
        if self.program.random is not None:  # the next forward draws new numbers
            self.program.random.step += 1
        named = dict(zip(self.program.outputs, outs))
        for slot, value in named.items():
            if slot.kind == "mutation":
                self._buffer_local(slot.key).copy_(value)
        return [v for s, v in named.items() if s.kind in ("loss", "output")], saved

    def _run_backward(self, saved: list, grad_loss: torch.Tensor, step: Optional[int] = None) -> list:
        try:
            with at_step(self.program, step), self._context():  # the forward's step, not the one after it
                grads = self.program.run_backward(
                    *saved, grad_loss.to(self.program.grads[0].spec.dtype) if self.program.grads else grad_loss)
        except Exception as exc:
            err = self._failed(exc, "the backward")
            if err is exc:
                raise
            raise err from exc
        return [grads[self._grad_index[s.key]] for s in self._param_slots]

    def _param(self, fqn: str):
        mod, name = self._owners[fqn]
        return tc.parameter_table(mod)[name]

    def _buffer(self, fqn: str):
        mod, name = self._owners[fqn]
        return tc.buffer_table(mod)[name]

    def _buffer_local(self, fqn: str) -> torch.Tensor:
        return _local(self._buffer(fqn))

    def _local_input(self, slot: Slot, value: Any) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            got = from_dtensor(value.placements)
            # on an axis of size 1 any placement is the whole tensor (the plan says B there)
            if any(a != b and n > 1 for a, b, n in zip(got, slot.placements, self.program.mesh_shape)):
                raise CompileError(
                    f"input {slot.key!r} is a DTensor placed {format_placements(got)!r}, but the plan places it "
                    f"{format_placements(slot.placements)!r}: redistribute it, or pass the whole tensor")
            return value.to_local()
        if not isinstance(value, torch.Tensor):
            raise CompileError(f"input {slot.key!r} must be a tensor, got {type(value).__name__}")
        if tuple(value.shape) != tuple(slot.spec.shape):
            raise CompileError(f"input {slot.key!r} has shape {tuple(value.shape)}, but the program was compiled for "
                               f"{slot.spec}: compile again for this shape")
        coords = tuple(self.program.coords)
        block = local_block(value, slot.placements, self.program.mesh_shape, coords, slot.spec.blocks)
        return block if self._device is None else block.to(self._device, non_blocking=True)

    def forward(self, *args, **kwargs):
        """Run the lowered forward program on this rank's blocks (the backward runs at ``loss.backward()``);
        returns what the model returns (``runtime.outputs.step_result``)."""
        # not ``self.steps += 1``: nn.Module's setter would refuse an int where the model has a
        # parameter, buffer or child named ``steps`` (the tables are the model's)
        object.__setattr__(self, "steps", self.steps + 1)
        faults.note_step(self.steps)
        values = []
        training = self.program.backward is not None
        for slot in self.program.inputs:
            if slot.kind == "param":  # the DTensor itself when training: Step takes its local block
                values.append(self._param(slot.key) if training else _local(self._param(slot.key)))
            elif slot.kind == "buffer":
                values.append(self._buffer_local(slot.key))
            elif slot.key.startswith("input:"):
                values.append(self._local_input(slot, args[int(slot.key.split(":")[1])]))
            else:
                values.append(self._local_input(slot, kwargs[slot.key]))
        loss = None
        if training:
            n = len(self._param_slots)
            # parameters first: Step returns their gradients in the same order
            order = [i for i, s in enumerate(self.program.inputs) if s.kind == "param"]
            rest = [i for i, s in enumerate(self.program.inputs) if s.kind != "param"]
            if order != list(range(n)):
                raise CompileError("the lowered program does not list parameters first")  # lowering invariant
            loss, *outs = Step.apply(self, n, *[values[i] for i in order + rest])
        else:
            if self._memory is not None:
                self._begin_memory([self._param(s.key) for s in self._param_slots], values)
            outs, _ = self._run_forward(values)
            if self._memory is not None:
                self._memory.finish()
        slots = [s for s in self.program.outputs if s.kind == "output"]
        placed = [placed_output(o, s, self.device_mesh, self._outputs) for o, s in zip(outs, slots)]
        return step_result(self.graph.output_tree, loss, placed)


# -- compile ----------------------------------------------------------------------------------------

def compile(model: torch.nn.Module, mesh: Mesh, example_inputs=(), example_kwargs: Optional[dict] = None, *,
            plan=None, precision: Optional[str] = None, loss_fn=None, outputs: str = "dtensor",
            compile: Union[bool, str] = False,  # noqa: A002
            **plan_kwargs) -> ParallelModule:
    """Plan (or take ``plan``: a Plan or a saved plan's path) and build this rank's ParallelModule.

    Call on every rank of a process group whose size is ``mesh.size`` (``autopar.launch`` or
    ``torchrun``). A ``Mesh.devices(n)`` mesh runs on the factorization the plan chose (the plan
    made here, or the ``plan`` given, which must be for n devices). The program computes at the
    plan's precision (``plan.precision``: "bf16-mixed" on the GPU presets, "fp32" on cpu) unless
    ``precision`` overrides it: "model" (each tensor in its own dtype), "fp32", "bf16-mixed", ...
    Under a mixed precision the parameters stay fp32 DTensors (the master weights the optimizer
    updates), are cast to bf16 before they are gathered, and their gradients are reduced and
    delivered in fp32 (see ``autopar.cost_model.casting``).
    ``compile=True`` (or a ``torch.compile`` backend's name, e.g. ``"aot_eager"``; True is
    ``"inductor"``) runs this rank's forward and backward programs through ``torch.compile``, with
    their functional collectives inside the compiled graphs (see ``Program.compile_with``); the first
    step pays the compilation. The other keywords are ``autopar.plan``'s. The model's parameters are
    replaced, in place, by DTensors holding this rank's blocks.

    The module returns what the model returns, the loss (``backward()``'s) in its place, its other
    tensors as ``outputs`` says: "dtensor" (the plan's placements), "full" (whole on every rank) or
    "local" (this rank's blocks). With ``loss_fn`` (``autopar.plan``'s) it takes ``target=`` and returns
    ``StepOutput(loss, output)``. A pipelined plan's returns the loss alone and takes neither."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.api import check_plan_args, plan_with
    from autopar.ir.capture import as_args
    from autopar.planner.captures import capture_for_plan
    from autopar.runtime.launch import ensure_process_group
    from autopar.runtime.nodes import start_from_environment
    from autopar.runtime.materialize import check_materializable

    # every rank checks its arguments before the first collective: a rank that raised after it would hang the others
    check_model(model, "autopar.compile: model")
    require_mesh(mesh)
    check_kwargs(example_kwargs, "autopar.compile: example_kwargs")
    check_choice(precision, ("plan",) + EXECUTABLE_PRECISIONS, "autopar.compile: precision", allow_none=True)
    torch_backend = compile_backend(compile, "autopar.compile")
    check_choice(outputs, OUTPUT_MODES, "autopar.compile: outputs")
    plan_kwargs = dict(plan_kwargs, loss_fn=loss_fn) if loss_fn is not None else plan_kwargs  # plan's keyword too
    if plan is not None and not isinstance(plan, Plan):
        check_path(plan, "autopar.compile: plan (a Plan, a saved plan's path, or None)")
    if torch_backend == "inductor" and plan is None:  # priced as Inductor runs it: pointwise chains fused
        plan_kwargs.setdefault("compiled", True)
    options = check_plan_args(model, mesh, example_kwargs, plan_kwargs, "autopar.compile")
    factorized = getattr(mesh, "factorize", None) is not None  # Mesh.devices(n): the plan says which axes
    if isinstance(plan, Plan) and factorized:  # a plan in hand is checked before any process-group work
        chosen_mesh(plan, mesh)
    elif isinstance(plan, Plan) and plan.pipeline is None:
        check_plan_mesh(plan, mesh)
    materializer = check_materializable(model)  # a meta tensor nothing can rebuild is named before planning
    start_from_environment()  # under torchrun, when the script started no group
    ensure_process_group(mesh.size, f"mesh {mesh.axes}")
    args = as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    given = plan is not None
    training = options.training if not given else None
    shared = share_plan(plan, lambda: plan_with(model, mesh, args, kwargs, options))
    warn_node_layout(shared)
    if factorized:
        mesh = chosen_mesh(shared, mesh)
    if shared.pipeline is not None:  # stages on the pp axis, each its slice of the program on the others
        if loss_fn is not None or outputs != "dtensor":
            raise CompileError("a pipelined plan returns the loss alone: the model returns its loss (no loss_fn=) "
                               "and outputs= does not apply; plan without a 'pp' axis for the model's other outputs")
        return _compile_pipelined(model, mesh, shared, args, kwargs, precision, materializer, torch_backend)
    check_plan_mesh(shared, mesh)  # on every rank alike (a plan file is read on rank 0 only)
    if training is not None and shared.training != training:
        raise CompileError("the plan's training mode differs from training=")
    graph = capture_for_plan(model, args, kwargs, training=shared.training, fingerprint=shared.fingerprint.get("graph"),
                             loss_fn=loss_fn)
    check_same_capture(graph)
    res = resolve(graph, shared)
    backend, device_type = _group_device_type()
    dmesh = init_device_mesh(device_type, mesh.shape, mesh_dim_names=tuple(mesh.names))
    coords = tuple(int(c) for c in dmesh.get_coordinate())
    device = _rank_device(device_type)
    prec = execution_precision(precision or "plan", shared.precision.get("name", "fp32"), device)
    program = lower(res, coords, device, prec)
    share_seed(program)  # with random ops: every rank draws with rank 0's seed
    if torch_backend is not None:
        program.compile_with(torch_backend)
    distribute_state(model, graph, program, dmesh, device, materializer)
    # gloo: the program's collectives get groups of their own with one worker thread each, since
    # torch 2.13's two workers corrupt the heap when two collectives finish together (see there)
    groups = single_worker_gloo_groups(dmesh.mesh, dist.get_rank()) if backend == "gloo" else None
    joint = joint_groups(dmesh.mesh, dist.get_rank(), joint_pairs(program), gloo=backend == "gloo")
    return ParallelModule(model, shared, graph, dmesh, program, prec, groups, outputs, device=device, joint=joint)


def _group_device_type() -> tuple[str, str]:
    """(the default process group's backend, the device type its programs run on): "cuda" under
    NCCL ("nccl" or "cpu:gloo,cuda:nccl"), else "cpu"."""
    backend = str(dist.get_backend())
    return backend, "cuda" if "nccl" in backend else "cpu"


def _rank_device(device_type: str) -> Optional[torch.device]:
    """This rank's device for ``lower`` and the runtimes: its GPU (set once the device mesh is made),
    or None for the CPU."""
    return torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else None


def _compile_pipelined(model, mesh: Mesh, plan: Plan, args, kwargs, precision, materializer, torch_backend=None):
    """This rank's module for a pipelined plan: ``api.pipelined``'s (pp alone), else its staged program's
    (its stages compiled with ``torch_backend`` when one is given)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.api import capture_micro, pipelined, stage_program
    from autopar.runtime.pipeline import MeshPipelinedModule, keep_stage_parameters

    pl = plan.pipeline
    if dict(mesh.axes) != (axes := dict(zip(pl.mesh_names, pl.mesh_shape))):
        raise CompileError(f"this pipelined plan was made for mesh {axes}, not {dict(mesh.axes)}")
    names, shape = list(pl.mesh_names), list(pl.mesh_shape)  # (compile checked the group's size)
    others = [n for n in names if n != pl.axis]
    # the device as ``compile`` takes it: the rank's GPU under NCCL (``ensure_process_group`` bound it)
    backend, device_type = _group_device_type()
    device = _rank_device(device_type)
    if all(s == 1 for n, s in zip(names, shape) if n != pl.axis):
        if torch_backend is not None:
            raise CompileError("autopar.compile: compile= runs the lowered program's stages, but a plan pipelined "
                               "over the pp axis alone runs the model's own ops stage by stage: leave compile= "
                               "out, or plan with another mesh axis (e.g. dp=1 is not enough: a size > 1)")
        return pipelined(model, plan, args, kwargs, device=device)
    graph, batch = capture_micro(model, plan, args, kwargs, plan.training, "autopar pipeline")
    check_same_capture(graph)
    dmesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    pp_rank = int(dmesh.get_coordinate()[names.index(pl.axis)])
    prec = execution_precision(precision or "plan", plan.precision.get("name", "fp32"), device)
    staged = stage_program(model, plan, graph, batch, args, kwargs,
                           coords=tuple(int(c) for c in dmesh[tuple(others)].get_coordinate()), precision=prec,
                           local=[s for s, r in enumerate(pl.stage_ranks) if int(r) == pp_rank], checked=False,
                           device=device)
    share_seed(staged.program)  # random ops (dropout): rank 0's seed on every rank
    if torch_backend is not None:
        compile_cut(staged.cut, torch_backend)
    keep_stage_parameters(model, staged)  # only its stages' parameters (others' would go stale: pipeline.state)
    distribute_state(model, graph, staged.program, dmesh[tuple(others)], device, materializer)
    # gloo: groups of one worker thread each (see ``compile``); otherwise the device mesh's
    groups = single_worker_gloo_groups(dmesh.mesh, dist.get_rank()) if backend == "gloo" else \
        [dmesh.get_group(n) for n in names]
    # the stage program's joint all-to-alls: groups over those axes of every pipeline rank (made by all)
    pairs = joint_pairs(staged.program)
    whole = [tuple(names.index(others[a]) for a in p) for p in pairs]
    made = joint_groups(dmesh.mesh, dist.get_rank(), whole, gloo=backend == "gloo")
    return MeshPipelinedModule(model, plan, staged, dmesh, [g for n, g in zip(names, groups) if n != pl.axis],
                               device=device, joint={p: made[w] for p, w in zip(pairs, whole)})


__all__ = ["RANDOM_KEY", "CompileError", "ParallelModule", "compile"]
