"""Pipelined plans' staged programs lowered for a CUDA device, checked on this CPU-only machine.

``autopar.compile`` lowers a pipelined plan with other mesh axes for the device the process group
runs on (``cuda`` under NCCL), dry-runs it there and cuts it into stages (``api.stage_program``);
``runtime.pipeline.sharded`` runs the parts. Here the plans of LLaMA (pp=2 x tp=2, 1F1B) and GPT
with dropout (pp=2 x dp=2, ZBVZeroBubble: the backward split in its input and weight parts) are
staged for ``cuda:0`` on fake CUDA tensors, for every pipeline rank and stage-mesh device. Each
rank's parts then run as the runtime runs them: the static program once, its stages' forwards in
order and backwards in reverse (boundary values from a stage of another rank are fake CUDA tensors
of the shapes the runtime's examples have), the weight parts, and the per-step reductions, their
collectives through ``ProcessGroupComm`` on torch's ``"fake"`` process group and a ``cuda``
DeviceMesh. Every value comes back on ``cuda:0`` (a device mismatch anywhere raises), including the
reductions' zeros for gradients other ranks' stages make, and every op dispatched has a CUDA kernel.

torch's ``PipelineStage`` and schedules (the point-to-point transfers) are not run here: the fake
process group does not carry them; what they send are the values checked above.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import _torch_compat as tc
from autopar.api import capture_micro, stage_program
from autopar.ir.placement import local_shape
from autopar.ir.rules.proof.interp import device_coords
from autopar.passes.lower.resolve import resolve
from autopar.passes.lower.tagged import keeping_gathers
from autopar.program import collectives as C
from autopar.program.staged import local_shape as node_shape
from autopar.runtime.collectives import ProcessGroupComm
from autopar.runtime.pipeline.loss import loss_weights
from autopar.runtime.pipeline.schedule import micro_slices
from autopar.runtime.pipeline.state import local_state
from autopar.runtime.random_state import pipelined_random
from _pipeline_mesh_helpers import build
from test_device import _aten_methods, _has_cuda_kernel

CUDA = torch.device("cuda", 0)

CASES = [
    ("llama", "1F1B", {"pp": 2, "tp": 2}),
    ("gpt", "ZBVZeroBubble", {"pp": 2, "dp": 2}),
]


@contextlib.contextmanager
def _fake_group(axes: dict):
    """torch's ``"fake"`` process group of the mesh's size and a ``cuda`` DeviceMesh over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    size = 1
    for n in axes.values():
        size *= n
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield init_device_mesh("cuda", tuple(axes.values()), mesh_dim_names=tuple(axes))
    finally:
        dist.destroy_process_group()


def _empty(shape_dtype) -> torch.Tensor:
    shape, dtype = shape_dtype
    return torch.empty(shape, dtype=dtype, device=CUDA)


def _on_cuda(values) -> None:
    bad = [tuple(v.shape) for v in values if isinstance(v, torch.Tensor) and v.device != CUDA]
    assert not bad, f"values off cuda:0 of shapes {bad}"


def _run_rank(staged, local: list[int], m: int, split: bool) -> tuple[list, list]:
    """One pipeline rank's step of ``staged`` (its ``local`` stages), as ``runtime.pipeline.sharded``
    runs it, on fake CUDA tensors: -> (the reduced gradients, the kept gradients' positions)."""
    prog, ct = staged.program, staged.cut
    if prog.random is not None:
        prog.random.seed = 1234
        pipelined_random(prog, staged.graph, m, staged.batch // m)
        prog.random.micro = 0
    inputs = [_empty((local_shape(s.spec.shape, s.placements, prog.mesh_shape, prog.coords), s.spec.dtype))
              for s in prog.inputs]
    with torch.no_grad():
        statics = [C.wait(v) for v in ct.static(*[inputs[k] for k in ct.state_slots])]
        _on_cuda(statics)
        acc: list = [None] * len(ct.frontier_shapes)
        carry: list = []
        stash, pending = {}, []
        for s in local:
            st = ct.stages[s]
            f_in = carry if s - 1 in local else [_empty(node_shape(n)) for n in st.f_in]
            outs = [C.wait(o) for o in st.forward(*[statics[k] for k in st.f_statics],
                                                 *[inputs[k] for k in st.f_given], *f_in)]
            _on_cuda(outs)
            carry, stash[s] = outs[:len(st.f_out)], outs[len(st.f_out):]
        back: list = []
        for s in reversed(local):
            st = ct.stages[s]
            g_in = back if s + 1 in local else [_empty(node_shape(n)) for n in st.g_in]
            tangent = [torch.ones((), dtype=carry[0].dtype, device=CUDA)] if st.tangent else []
            ins = list(stash.pop(s)) + [statics[k] for k in st.b_statics] + g_in + tangent
            if split:
                outs = [C.wait(o) for o in st.backward_input(*ins)]
                pending.append((st, ins + outs[len(st.g_out):]))
                made: list = []
            else:
                outs = [C.wait(o) for o in st.backward(*ins)]
                made = outs[len(st.g_out):]
            _on_cuda(outs)
            back = outs[:len(st.g_out)]
            for fid, v in zip(st.frontier, made):
                acc[fid] = v
        for st, ins in pending:  # the zero-bubble schedule's W actions
            made = [C.wait(o) for o in st.backward_weight(*ins)]
            _on_cuda(made)
            for fid, v in zip(st.frontier, made):
                acc[fid] = v
        front = [a if a is not None else torch.zeros(s, dtype=d, device=CUDA)
                 for a, (s, d) in zip(acc, ct.frontier_shapes)]
        grads = [C.wait(g) for g in ct.reduce(*front)]
    _on_cuda(grads)
    return grads, list(ct.reduce.kept)


@pytest.mark.parametrize("name,schedule,axes", CASES, ids=[c[0] for c in CASES])
def test_staged_programs_lowered_for_cuda_run_on_fake_cuda(name, schedule, axes):
    from autopar.models import make

    torch.manual_seed(0)
    # GPT: dropout (the counter-based draw on the device, RandomOp); ZBV wants two layers per stage
    model, args = make("gpt", "tiny", batch=4, n_layer=4, dropout=0.1) if name == "gpt" else build(name, 2, 4)
    model.train()
    plan = autopar.plan(model, autopar.Mesh(axes, device="h100"), args,
                        pipeline={"schedule": schedule, "microbatches": 2}, progress=False)
    pl = plan.pipeline
    assert pl.schedule == schedule and plan.precision["name"] == "bf16-mixed"
    graph, batch = capture_micro(model, plan, args, {}, True, "test")
    res = keeping_gathers(resolve(graph, plan))
    dispatched: set = set()
    zeros_made = 0
    on_op = lambda func, a, k, out: dispatched.add(str(func))  # noqa: E731
    with _fake_group(axes) as dmesh, _aten_methods():
        comm = ProcessGroupComm([dmesh.get_group(n) for n in plan.axis_names], plan.axis_names)
        for pp_rank in range(pl.degree):
            local = [s for s, r in enumerate(pl.stage_ranks) if int(r) == pp_rank]
            for coords in device_coords(plan.mesh_shape):
                with tc.FakeTensorMode(allow_non_fake_inputs=True):
                    staged = stage_program(model, plan, graph, batch, args, {}, coords=coords,
                                           precision="bf16-mixed", local=local, resolved=res, checked=False,
                                           device=CUDA)
                    assert (staged.program.random is not None) == (name == "gpt")
                    with C.use_backend(comm), tc.record_dispatch(on_op):
                        grads, kept = _run_rank(staged, local, pl.microbatches, schedule == "ZBVZeroBubble")
                assert len(grads) == len(staged.program.grads)
                zeros_made += len(grads) - len(kept)
    assert zeros_made > 0  # the reductions made zeros for gradients of other ranks' stages (on cuda:0)
    missing = sorted(op for op in dispatched if not _has_cuda_kernel(op))
    assert not missing, f"{name}: ops without a CUDA kernel: {missing}"
    assert not any("_for_cpu" in op for op in dispatched)


def test_stand_ins_and_loss_weights_on_a_device():
    """A parameter another pipeline rank holds stands in as zeros on the device; the loss weights'
    target counts, computed with the inputs moved and the captured factory ops' ``device=`` set to a
    device (the CPU here: fake tensors have no values to count), are the weights computed as captured."""
    lin = torch.nn.Linear(3, 2)
    tc.parameter_table(lin)["weight"] = None
    with tc.FakeTensorMode(allow_non_fake_inputs=True):
        z = local_state(lin, "weight", "param", ((2, 3), torch.bfloat16), CUDA)
        assert z.device == CUDA and z.shape == (2, 3) and z.dtype == torch.bfloat16
    assert local_state(lin, "weight", "param", ((2, 3), torch.float32)).device.type == "cpu"

    model, (tokens, targets) = build("gpt", 2, 4)
    targets = targets.clone()
    targets[0, :-2] = -100  # the first micro-batch counts fewer targets: unequal weights
    plan = autopar.plan(model, autopar.Mesh({"pp": 2, "dp": 2}, device="cpu"), (tokens, targets),
                        pipeline={"schedule": "GPipe", "microbatches": 2}, progress=False)
    graph, batch = capture_micro(model, plan, (tokens, targets), {}, True, "test")
    micro = micro_slices((tokens, targets), {}, batch, 2)
    values = {name: model.get_parameter(fqn) for fqn, name in graph.params.items()}
    values.update({name: model.get_buffer(fqn) for fqn, name in graph.buffers.items()})
    want = loss_weights(graph, micro, values)
    assert want[0] < want[1]
    assert loss_weights(graph, micro, values, torch.device("cpu")) == want
