"""Programs lowered for a CUDA device, checked on this CPU-only machine.

The plans of GPT (with dropout), LLaMA and MoE (``autopar.models``), the torchtitan-style Llama and
Hugging Face's LLaMA (default dropout rates: its attention dropout is drawn) on a (2, 2) mesh are
lowered for ``cuda:0``. Then:

- every op the four programs dispatch (the fx graphs' ops and what their ``LocalOp``/``RandomOp``
  modules run) has a CUDA kernel in torch's own op registry: the ``native_functions.yaml`` the wheel
  ships (a CPU wheel has no CUDA kernels registered to ask the dispatcher about), autopar's own ops by
  their registered ``cuda`` kernel, and the aten ops that kernel calls from the yaml;
- every rank's forward and backward runs on fake CUDA tensors, its collectives through
  ``ProcessGroupComm`` (autopar's process-group backend) on torch's ``"fake"`` process group and a
  ``cuda`` DeviceMesh, and every output and gradient comes back on ``cuda:0`` (a device mismatch
  anywhere raises);
- the same plan lowered for the CPU runs in the simulator and matches the single-device model.

A CPU build cannot run three Tensor methods on fake CUDA tensors (they take a CUDA device guard
first): ``contiguous`` on a non-contiguous tensor, ``copy_`` and ``__getitem__``. While the ranks
run they are routed to the aten ops they call, which fake tensors run; nothing of autopar changes.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.plans import SCHEMA_VERSION
from autopar import _torch_compat as tc
from autopar._torch_compat import sdpa
from autopar.ir.capture import capture
from autopar.passes.lower import lower
from autopar.passes.lower.resolve import resolve
from autopar.program import collectives as C
from autopar.runtime.collectives import ProcessGroupComm
from autopar.runtime.threads import run_step
from autopar.ir.placement import local_shape
from autopar.ir.rules.proof.interp import device_coords
import _corpus

CUDA = torch.device("cuda", 0)
MESH = {"dp": 2, "tp": 2}
#: ops with no kernel per device: collectives (run by the process group's backend) and the
#: metadata queries of ``prim`` (``prim.device``: a tensor's device, read without a kernel)
_DEVICE_GENERIC = ("_c10d_functional.", "prim.device.", "prim.dtype.", "prim.layout.")


def _models():
    from autopar.models import make

    yield "gpt", (*make("gpt", "tiny", batch=4, seq=16, dropout=0.1), {})
    yield "llama", (*make("llama", "tiny", batch=4, seq=16), {})
    yield "moe", (*make("moe", "tiny", batch=4, seq=16), {})
    yield "titan_llama", _corpus.build("titan_llama")
    yield "hf_llama", _corpus.build("hf_llama", dropout=True)


# -- torch's registry of CUDA kernels ---------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _registry() -> dict[str, set]:
    """aten op (``"aten.add.Tensor"``) -> its dispatch keys in the wheel's ``native_functions.yaml``
    (``"delegate:<op>"`` for a structured op's out-variant, ``"ufunc"`` for a ufunc-generated kernel)."""
    import torchgen
    import yaml

    path = pathlib.Path(torchgen.__file__).parent / "packaged" / "ATen" / "native" / "native_functions.yaml"
    table: dict[str, set] = {}
    for e in yaml.load(path.read_text(), Loader=yaml.CSafeLoader):
        name = e["func"].split("(")[0]
        keys: set = set()
        for k in (e.get("dispatch") or {}):
            keys |= {x.strip() for x in k.split(",")}
        if "ufunc_inner_loop" in e:
            keys.add("ufunc")
        if "structured_delegate" in e:
            keys.add("delegate:" + e["structured_delegate"])
        if not keys:
            keys.add("CompositeImplicitAutograd")  # what an op without a dispatch table gets
        table[_aten(name)] = keys
        for auto in str(e.get("autogen", "")).split(","):
            if auto.strip():
                table[_aten(auto.strip())] = {"CompositeExplicitAutogradNonFunctional"}
    return table


def _aten(name: str) -> str:
    return f"aten.{name}" if "." in name else f"aten.{name}.default"


def _has_cuda_kernel(op: str, seen=()) -> bool:
    if op.startswith(_DEVICE_GENERIC):
        return True
    if op.startswith("autopar."):
        ns, name, overload = op.split(".")
        qualified = f"{ns}::{name}" + ("" if overload == "default" else f".{overload}")
        return torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CUDA")
    keys = _registry().get(op)
    if keys is None:
        return False
    if any("CUDA" in k or k.startswith("Composite") or k == "ufunc" for k in keys):
        return True
    return any(k.startswith("delegate:") and op not in seen and _has_cuda_kernel(_aten(k[9:]), seen + (op,))
               for k in keys)


def test_the_registry_flags_the_cpu_only_attention():
    """The check below can fail: the CPU kernel of attention has no CUDA kernel, the CUDA ones do."""
    assert not _has_cuda_kernel("aten._scaled_dot_product_flash_attention_for_cpu.default")
    assert not _has_cuda_kernel("aten._scaled_dot_product_flash_attention_for_cpu_backward.default")
    assert all(_has_cuda_kernel(op) for op in sdpa.CUDA_OPS)
    assert _has_cuda_kernel("aten.mm.default") and _has_cuda_kernel("aten.add.Tensor")
    assert _has_cuda_kernel("autopar.attention.default") and _has_cuda_kernel("autopar.attention_backward.default")


# -- running a rank on fake CUDA tensors ------------------------------------------------------------

@contextlib.contextmanager
def _fake_group():
    """torch's ``"fake"`` process group of the mesh's size and a ``cuda`` DeviceMesh over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cuda", tuple(MESH.values()), mesh_dim_names=tuple(MESH))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _aten_methods():
    """``contiguous``, ``copy_`` and ``__getitem__`` by the aten ops they run (see the module docstring)."""
    aten = torch.ops.aten
    saved = {k: getattr(torch.Tensor, k) for k in ("contiguous", "copy_", "__getitem__")}

    def contiguous(x, memory_format=torch.contiguous_format):
        return x if x.is_contiguous(memory_format=memory_format) else aten.clone.default(x, memory_format=memory_format)

    def getitem(x, index):
        if x.device.type != "cuda":
            return saved["__getitem__"](x, index)
        index = index if isinstance(index, tuple) else (index,)
        out, dim = x, 0
        for i in index:
            if i is Ellipsis:
                dim = out.ndim - (len(index) - 1 - index.index(Ellipsis)) + dim - index.index(Ellipsis)
            elif isinstance(i, slice) and i.step in (None, 1):
                out = aten.slice.Tensor(out, dim, i.start, i.stop)
                dim += 1
            elif isinstance(i, int):
                out = aten.select.int(out, dim, i)
            elif i is None:
                out = aten.unsqueeze.default(out, dim)
                dim += 1
            else:
                raise NotImplementedError(f"fake CUDA indexing with {index!r}")
        return out

    torch.Tensor.contiguous = contiguous
    torch.Tensor.copy_ = lambda x, src, non_blocking=False: aten.copy_.default(x, src, non_blocking)
    torch.Tensor.__getitem__ = getitem
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(torch.Tensor, k, v)


def _lower_and_run_on_fake_cuda(res, coords, precision: str, dmesh, dispatched: set) -> None:
    """Rank ``coords``'s program lowered for ``cuda:0`` (under the fake mode, which turns the tensor
    constants it moves to the device into fake CUDA tensors), and its forward and backward run on
    fake CUDA tensors; the ops it dispatched go to ``dispatched``."""
    comm = ProcessGroupComm([dmesh.get_group(i) for i in range(dmesh.ndim)], list(MESH))
    on_op = lambda func, args, kwargs, out: dispatched.add(str(func))  # noqa: E731
    with tc.FakeTensorMode(allow_non_fake_inputs=True):
        program = lower(res, coords, CUDA, precision)
        if program.random is not None:
            program.random.seed = 1234
        for gm in (program.forward, program.backward):
            dispatched |= {str(n.target) for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)}
        values = [torch.empty(local_shape(s.spec.shape, s.placements, program.mesh_shape, program.coords),
                              dtype=s.spec.dtype, device=CUDA) for s in program.inputs]
        with _aten_methods(), C.use_backend(comm), tc.record_dispatch(on_op):
            outs, grads = run_step(program, values, precision=precision)
    assert outs and all(t.device == CUDA for t in outs + grads if isinstance(t, torch.Tensor))
    assert len(grads) == len(program.grads)


@pytest.fixture(scope="module")
def planned():
    """Each model with its (2, 2) plan (h100 preset: bf16-mixed) and graph."""
    out = {}
    for name, (model, args, kwargs) in _models():
        model.train()
        graph = capture(model, args, kwargs)
        plan = autopar.plan(model, autopar.Mesh(MESH, device="h100"), args, kwargs, graph=graph)
        out[name] = (model, args, kwargs, graph, plan)
    return out


@pytest.mark.parametrize("name", ["gpt", "llama", "moe", "titan_llama", "hf_llama"])
def test_programs_lowered_for_cuda_have_cuda_kernels_and_run_on_fake_cuda(planned, name):
    model, args, kwargs, graph, plan = planned[name]
    res = resolve(graph, plan)
    dispatched: set = set()
    # torchtitan's RoPE runs view_as_complex on what it casts to fp32, which bf16-mixed feeds bf16
    precision = "fp32" if name == "titan_llama" else "bf16-mixed"
    with _fake_group() as dmesh:
        for coords in device_coords(res.mesh.shape):
            _lower_and_run_on_fake_cuda(res, coords, precision, dmesh, dispatched)
    if name in ("llama", "titan_llama"):  # attention without dropout: the device-neutral op
        assert {"autopar.attention.default", "autopar.attention_backward.default"} <= dispatched
    missing = sorted(op for op in dispatched if not _has_cuda_kernel(op))
    assert not missing, f"{name}: ops without a CUDA kernel: {missing}"
    assert not any("_for_cpu" in op for op in dispatched)


@pytest.mark.parametrize("name", ["llama", "titan_llama"])
def test_the_same_plan_runs_on_cpu(planned, name):
    """The plans lowered for CUDA above also lower for the CPU, where they match the model."""
    model, args, kwargs, graph, plan = planned[name]
    want = model(*args, **kwargs)
    got, grads = autopar.simulate(model, plan, args, kwargs, graph=graph, device="cpu")
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    want.backward()
    for fqn, p in model.named_parameters():
        torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-4, atol=1e-6)


def test_a_plan_saved_naming_the_cpu_attention_op_loads_and_lowers():
    """``tests/data/plan_v7_gpt_dropout_dp2_tp2.json`` was made by autopar at plan schema version 7,
    which named attention by the CPU kernel captured: it loads as version 8 with the device-neutral
    ops, lowers, and draws and computes what a plan made now does. It also records the loss's
    backward with an extra ``B`` input, as plans of version 9 and earlier do (``resolve._legacy_text``)."""
    from autopar.models import make
    from autopar.plans import load_plan

    path = pathlib.Path(__file__).parent / "data" / "plan_v7_gpt_dropout_dp2_tp2.json"
    text = path.read_text()
    assert '"schema_version": 7' in text and "_scaled_dot_product_flash_attention_for_cpu" in text
    assert '"(B, S(0), S(0), B, B) -> (S(0))"' in text  # nll_loss_backward's five inputs
    old = load_plan(path)
    assert old.schema_version == SCHEMA_VERSION and not any("_for_cpu" in n["op"] for n in old.nodes)
    assert sorted(n["op"] for n in old.nodes if "attention" in n["op"]) == [
        "autopar.attention.default", "autopar.attention_backward.default"]
    torch.manual_seed(0)
    model, args = make("gpt", "tiny", batch=4, seq=16, dropout=0.1, n_layer=1)
    new = autopar.plan(model, autopar.Mesh(MESH, device="cpu"), args)
    assert [n["name"] for n in old.nodes] == [n["name"] for n in new.nodes]
    runs = []
    for plan in (old, new):
        torch.manual_seed(5)  # the dropout seed
        runs.append(autopar.simulate(model, plan, args))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=0, atol=0)
    for fqn, g in runs[1][1].items():
        torch.testing.assert_close(runs[0][1][fqn], g, rtol=1e-6, atol=1e-7)
