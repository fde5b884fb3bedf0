"""The one place that touches private torch APIs (torch 2.13).

Capture needs a few internals that have no public equivalent yet: AOTAutograd's joint export with
input/output descriptors (and, for the one-pass joint trace, ``make_fx`` with the helpers
AOTAutograd itself uses around it), ``FakeTensorMode`` and its exceptions, and fx's node-metadata
annotation.
Everything else in autopar imports them from here, so a torch upgrade is fixed in one file.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
import torch.fx.traceback as _fx_traceback
import torch.utils._pytree as pytree
from torch._decomp import get_decompositions
from torch._functorch._aot_autograd import descriptors as _desc
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "ParamAOTInput",
    "BufferAOTInput",
    "PlainAOTInput",
    "TangentAOTInput",
    "PlainAOTOutput",
    "GradAOTOutput",
    "InputMutationAOTOutput",
    "DATA_DEPENDENT_ERRORS",
    "annotate",
    "preserve_node_meta",
    "export_joint",
    "decompositions",
    "data_dependent_op",
    "use_flat_calling_convention",
    "pytree",
    "strided_shard",
    "install_strided_checkpointing",
]

ParamAOTInput = _desc.ParamAOTInput
BufferAOTInput = _desc.BufferAOTInput
PlainAOTInput = _desc.PlainAOTInput
TangentAOTInput = _desc.TangentAOTInput
PlainAOTOutput = _desc.PlainAOTOutput
GradAOTOutput = _desc.GradAOTOutput
InputMutationAOTOutput = _desc.InputMutationAOTOutput

#: Exceptions fake tensors raise on an op whose output shape or value depends on tensor data.
DATA_DEPENDENT_ERRORS = (DynamicOutputShapeException, DataDependentOutputException, GuardOnDataDependentSymNode)

annotate = _fx_traceback.annotate
preserve_node_meta = _fx_traceback.preserve_node_meta


def decompositions(ops: list) -> dict:
    """torch's decompositions for ``ops`` (OpOverloads or packets)."""
    return get_decompositions(ops)


#: Try the one-pass joint trace first (``_export_joint_fast``); False: always AOTAutograd's export.
FAST_JOINT = True
#: How many exports took each path (tests check the fast path is the one that runs).
JOINT_PATHS = {"fast": 0, "aot": 0}


class _NotFast(Exception):
    """The one-pass joint trace does not apply: use AOTAutograd's functionalized export."""


def export_joint(module: torch.nn.Module, args: tuple, kwargs: dict, decomps: dict) -> torch.fx.GraphModule:
    """The joint forward+backward graph of ``module(*args, **kwargs)`` (placeholders and the output
    node carry ``meta["desc"]``). The export's context stack is closed before returning: we only keep
    the graph, never compile through AOTAutograd's state.

    A training step of a module that mutates nothing is traced in one pass (``_export_joint_fast``,
    about 1.6x faster, the same graph); anything else, and any failure of that pass, goes through
    AOTAutograd's export, which also reports genuine capture errors."""
    if FAST_JOINT and torch.is_grad_enabled():
        try:
            gm = _export_joint_fast(module, args, kwargs, decomps)
            JOINT_PATHS["fast"] += 1
            return gm
        except Exception:  # noqa: BLE001 - AOTAutograd's export decides (and reports errors)
            pass
    JOINT_PATHS["aot"] += 1
    # imported here: AOTAutograd pulls in dynamo (~1.5 s), which plan files and the CLI's show,
    # explain and diff never need
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    with contextlib.ExitStack() as stack, _use_lazy_graph_module(True):
        # lazy: the Python code of a 7k-node graph is generated once, on first call, not per rewrite
        jd = aot_export_joint_with_descriptors(stack, module, args, kwargs, decompositions=decomps)
        return jd.graph_module


@contextlib.contextmanager
def _saved_tensors_hooks_tracing():
    """As AOTAutograd: saved-tensor hooks (activation checkpointing) are not traced."""
    prior = torch._C._autograd._saved_tensors_hooks_set_tracing(True)
    try:
        yield
    finally:
        torch._C._autograd._saved_tensors_hooks_set_tracing(prior)


def _export_joint_fast(module, args, kwargs, decomps, loss_dtype=torch.float32):
    """The same joint graph as ``aot_export_joint_with_descriptors`` for a module whose forward
    returns a scalar loss and mutates no input, traced in one pass: make_fx of forward +
    ``torch.autograd.grad`` on the fake inputs, without functionalization and without AOTAutograd's
    metadata pre-pass. Raises _NotFast where AOTAutograd's export is needed."""
    import warnings

    from torch._dispatch.python import enable_python_dispatcher
    from torch._functorch._aot_autograd.graph_capture_wrappers import set_partitioner_tag_is_backward
    from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks
    from torch._functorch._aot_autograd.utils import copy_fwd_metadata_to_bw_nodes
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
    from torch.nn.utils.stateless import _reparametrize_module

    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    flat_in, in_spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    if any(not isinstance(t, FakeTensor) for t in [*params.values(), *buffers.values(), *flat_in]
           if isinstance(t, torch.Tensor)):
        raise _NotFast("non-fake input")
    fake_mode = detect_fake_mode([*params.values(), *buffers.values()])
    # tied weights (one tensor under several FQNs): AOTAutograd gives every FQN its own input; so do we
    seen: set[int] = set()
    aliases: dict[str, torch.Tensor] = {}
    for state in (params, buffers):
        for fqn, t in state.items():
            if id(t) in seen:
                with fake_mode:
                    fresh = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=t.device)
                fresh.requires_grad_(t.requires_grad)
                state[fqn] = aliases[fqn] = fresh
            seen.add(id(t))
    primals = [*params.values(), *buffers.values(), *flat_in]
    tensors = [p for p in primals if isinstance(p, torch.Tensor)]
    if len({id(t) for t in tensors}) != len(tensors):
        raise _NotFast("an input tensor is also a parameter or buffer, or appears twice")
    descs = [*(ParamAOTInput(n) for n in params), *(BufferAOTInput(n) for n in buffers),
             *(PlainAOTInput(i) for i in range(len(flat_in)))]
    with fake_mode:
        tangent = torch.empty((), dtype=loss_dtype, device="cpu")
    n_state = len(params) + len(buffers)
    needs = [isinstance(p, torch.Tensor) and p.requires_grad for p in primals]
    seen_dtype = []

    def joint(primals, tangents):
        a, k = pytree.tree_unflatten(list(primals[n_state:]), in_spec)
        # like AOTAutograd's functional_call: with tied weights, every FQN is swapped in (the last wins)
        with _reparametrize_module(module, dict(zip([*params, *buffers], primals[:n_state]))) if aliases \
                else contextlib.nullcontext():
            loss = module(*a, **k)
        if not isinstance(loss, torch.Tensor) or loss.shape != () or not loss.requires_grad:
            raise _NotFast("output is not a scalar loss that requires grad")
        if loss.dtype != tangents[0].dtype:
            seen_dtype.append(loss.dtype)
            raise _NotFast(f"loss dtype {loss.dtype}")
        for node in get_proxy_mode().tracer.graph.nodes:
            node.meta["partitioner_tag"] = "is_backward" if node.name.startswith("tangents") else "is_forward"
        setup_stacktrace_preservation_hooks([loss.grad_fn])
        with set_partitioner_tag_is_backward(), _fx_traceback.preserve_node_meta():
            grads = iter(torch.autograd.grad([loss], [p for p, n in zip(primals, needs) if n],
                                             grad_outputs=[tangents[0]], allow_unused=True))
        return [loss, *(next(grads) if n else None for n in needs)]

    try:
        with contextlib.ExitStack() as st:
            st.enter_context(_use_lazy_graph_module(True))
            st.enter_context(torch.autograd.set_multithreading_enabled(False))
            st.enter_context(fake_mode)
            st.enter_context(enable_python_dispatcher())
            st.enter_context(_saved_tensors_hooks_tracing())
            st.enter_context(_fx_traceback.preserve_node_meta())
            st.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", "Anomaly Detection has been enabled.")
            st.enter_context(torch.autograd.detect_anomaly(check_nan=False))
            gm = make_fx(joint, decomposition_table=decomps, record_module_stack=True,
                         _disable_torch_fn_metadata_mode=True)(primals, [tangent])
    except _NotFast:
        if seen_dtype and loss_dtype == torch.float32:
            return _export_joint_fast(module, args, kwargs, decomps, loss_dtype=seen_dtype[0])
        raise
    graph = gm.graph
    for n in graph.nodes:  # functionalization would have removed these: only pure graphs take this path
        if n.op == "call_function" and n.target is not operator.getitem and not (
                isinstance(n.target, torch._ops.OpOverload) and not n.target._schema.is_mutable):
            raise _NotFast(f"op {n.target} (mutating, or not an aten OpOverload)")
        if n.op == "call_function" and n.kwargs.get("attn_mask", 0) is None and "flash_attention" in str(n.target):
            n.kwargs = {k: v for k, v in n.kwargs.items() if k != "attn_mask"}
    copy_fwd_metadata_to_bw_nodes(gm)
    ph = [n for n in graph.nodes if n.op == "placeholder"]
    for n, d in zip(ph, [*descs, TangentAOTInput(PlainAOTOutput(0))]):
        n.meta["desc"] = d
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    out.meta["desc"] = [PlainAOTOutput(0), *(GradAOTOutput(d) if n else None for d, n in zip(descs, needs))]
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def use_flat_calling_convention(gm: torch.fx.GraphModule) -> None:
    """Make ``gm`` take its placeholders as flat positional arguments and return a flat tuple
    (the export's pytree in/out specs no longer hold once placeholders are removed)."""
    gm.graph._codegen = torch.fx.graph.CodeGen()


def data_dependent_op(exc: BaseException) -> str | None:
    """The op named by a data-dependent fake-tensor exception, if it says."""
    func: Any = getattr(exc, "func", None)
    if func is not None:
        return str(func)
    return None



# ---------------------------------------------------------------------------------------------
# DTensor's ``_StridedShard``: dims of equal blocks (``TensorSpec.blocks``) split block by block


def strided_shard(dim: int, blocks: int):
    """DTensor's placement for a split of ``dim`` that cuts each of its ``blocks`` equal blocks
    alike (a device holds its piece of every block, in block order)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=blocks)


def _held_indices(size: int, dim: int, placements, mesh_shape, coords) -> list[int]:
    """The global indices along ``dim`` of a DTensor's local block, in local order (``Shard``
    takes its chunk; ``_StridedShard(sf)`` cuts the current block into ``sf`` equal blocks and
    takes its chunk of each: left to right over the mesh axes, as DTensor does)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    idx = list(range(size))
    for p, n, c in zip(placements, mesh_shape, coords):
        if isinstance(p, _StridedShard) and p.dim == dim:
            sf = int(p.split_factor)
            block = len(idx) // sf
            piece = -(-block // n)
            idx = [i for b in range(sf) for i in idx[b * block:(b + 1) * block][c * piece:(c + 1) * piece]]
        elif isinstance(p, Shard) and p.dim == dim:
            piece = -(-len(idx) // n)
            idx = idx[c * piece:(c + 1) * piece]
    return idx


def _strided_pieces(t) -> list | None:
    """A ``_StridedShard`` DTensor's local block as the contiguous pieces of the global tensor it is
    made of: ``[(global offsets, sizes, local starts)]``; None for any other DTensor."""
    import itertools

    from torch.distributed.tensor.placement_types import _StridedShard

    if not any(isinstance(p, _StridedShard) for p in t.placements):
        return None
    mesh, coords = t.device_mesh, t.device_mesh.get_coordinate()
    if coords is None:
        return []
    runs_per_dim = []
    for d, size in enumerate(t.shape):
        idx = _held_indices(size, d, t.placements, mesh.shape, coords)
        runs, start = [], 0  # (global start, local start, length) of each run of consecutive indices
        for k in range(1, len(idx) + 1):
            if k == len(idx) or idx[k] != idx[k - 1] + 1:
                runs.append((idx[start], start, k - start))
                start = k
        runs_per_dim.append(runs)
    return [(tuple(r[0] for r in combo), tuple(r[2] for r in combo), tuple(r[1] for r in combo))
            for combo in itertools.product(*runs_per_dim)]


def install_strided_checkpointing() -> None:
    """Teach ``torch.distributed.checkpoint`` the ``_StridedShard`` blocks autopar makes.

    DCP describes a DTensor's local block as one chunk at its first global offset; a block holding
    a piece of each of several blocks of the global tensor is several chunks, so torch 2.13 refuses
    to save it ("overlapping chunks") and would load the wrong rows into it. This describes it as
    one chunk per contiguous piece (DTensor's own checkpoint hooks, patched once; every other
    DTensor goes the original way)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.tensor import DTensor

    if getattr(DTensor, "_autopar_strided_checkpointing", False):
        return
    orig_write, orig_chunks, orig_shard = (DTensor.__create_write_items__, DTensor.__create_chunk_list__,
                                           DTensor.__get_tensor_shard__)

    def write_items(self, fqn, obj):
        pieces = _strided_pieces(self)
        if pieces is None:
            return orig_write(self, fqn, obj)
        props = TensorProperties.create_from_tensor(self.to_local())
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(off),
                                                                                 sizes=torch.Size(size)),
                                                      properties=props, size=self.size()))
                for off, size, _ in pieces]

    def chunk_list(self):
        pieces = _strided_pieces(self)
        if pieces is None:
            return orig_chunks(self)
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)) for off, size, _ in pieces]

    def tensor_shard(self, index):
        pieces = _strided_pieces(self)
        if pieces is None:
            return orig_shard(self, index)
        local = self.to_local()
        for off, size, start in pieces:
            if index.offset is not None and tuple(index.offset) == off:
                for d, (s, n) in enumerate(zip(start, size)):
                    local = local.narrow(d, s, n)
                return local  # a view: DCP loads into it in place
        raise ValueError(f"{index.fqn!r}: no piece of this rank's block starts at {index.offset}")

    DTensor.__create_write_items__ = write_items
    DTensor.__create_chunk_list__ = chunk_list
    DTensor.__get_tensor_shard__ = tensor_shard
    DTensor._autopar_strided_checkpointing = True
