"""AOTAutograd's joint export (``torch._functorch``), and autopar's one-pass joint tracer built on
AOTAutograd's own helpers (torch 2.13).

Wraps: ``aot_export_joint_with_descriptors`` and the input/output descriptor classes
(``torch._functorch._aot_autograd.descriptors``), ``torch._decomp.get_decompositions``, and, for
``_export_joint_fast``, ``make_fx`` with the pieces AOTAutograd runs around it (python dispatcher,
saved-tensor-hooks tracing, partitioner tags, stack-trace hooks, ``copy_fwd_metadata_to_bw_nodes``,
``_reparametrize_module``, ``_use_lazy_graph_module``).

On a torch upgrade: check those import paths and signatures, and run ``tests/test_capture_paths.py``:
it compares the one-pass trace with AOTAutograd's export node by node (names, arguments,
descriptors, ``partitioner_tag``, ``custom`` metadata). ``_export_joint_fast`` is 100 lines of
autopar's own tracing, not a thin wrapper: when AOTAutograd changes what its export does around
``make_fx``, this is where to follow it (or set ``FAST_JOINT = False``).
"""

from __future__ import annotations

import contextlib
import logging
import operator

import torch
import torch.fx.traceback as _fx_traceback
import torch.utils._pytree as pytree
from torch._decomp import get_decompositions
from torch._functorch._aot_autograd import descriptors as _desc
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from autopar._torch_compat.inplace import functionalize_intermediates

_log = logging.getLogger(__name__)

ParamAOTInput = _desc.ParamAOTInput
BufferAOTInput = _desc.BufferAOTInput
PlainAOTInput = _desc.PlainAOTInput
TangentAOTInput = _desc.TangentAOTInput
PlainAOTOutput = _desc.PlainAOTOutput
GradAOTOutput = _desc.GradAOTOutput
InputMutationAOTOutput = _desc.InputMutationAOTOutput


def decompositions(ops: list) -> dict:
    """torch's decompositions for ``ops`` (OpOverloads or packets)."""
    return get_decompositions(ops)


#: How many exports took each path (tests check the fast path is the one that runs).
JOINT_PATHS = {"fast": 0, "aot": 0}


def _fast_joint() -> bool:
    """``autopar._torch_compat.FAST_JOINT``: the switch lives on the package, where callers set it."""
    from autopar import _torch_compat

    return _torch_compat.FAST_JOINT


class _NotFast(Exception):
    """The one-pass joint trace does not apply: use AOTAutograd's functionalized export."""


def export_joint(module: torch.nn.Module, args: tuple, kwargs: dict, decomps: dict) -> torch.fx.GraphModule:
    """The joint forward+backward graph of ``module(*args, **kwargs)`` (placeholders and the output
    node carry ``meta["desc"]``). The export's context stack is closed before returning: we only keep
    the graph, never compile through AOTAutograd's state.

    A training step of a module that mutates nothing is traced in one pass (``_export_joint_fast``,
    about 1.6x faster, the same graph); anything else, and any failure of that pass, goes through
    AOTAutograd's export, which also reports genuine capture errors."""
    if _fast_joint() and torch.is_grad_enabled():
        try:
            gm = _export_joint_fast(module, args, kwargs, decomps)
            JOINT_PATHS["fast"] += 1
            return gm
        except Exception as e:  # noqa: BLE001 - AOTAutograd's export decides (and reports errors)
            _log.debug("one-pass joint trace of %s fell back to AOTAutograd's export: %s: %s",
                       type(module).__name__, type(e).__name__, e)
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
    returns a scalar loss (or a tuple of the loss and tensors that need no gradient) and mutates
    no input, traced in one pass: make_fx of forward + ``torch.autograd.grad`` on the fake inputs,
    without functionalization and without AOTAutograd's metadata pre-pass. Raises _NotFast where
    AOTAutograd's export is needed."""
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
    n_extra = [0]  # the module's outputs after the loss (returned as they are, no gradient flows from them)

    def joint(primals, tangents):
        a, k = pytree.tree_unflatten(list(primals[n_state:]), in_spec)
        # like AOTAutograd's functional_call: with tied weights, every FQN is swapped in (the last wins)
        with _reparametrize_module(module, dict(zip([*params, *buffers], primals[:n_state]))) if aliases \
                else contextlib.nullcontext():
            res = module(*a, **k)
        loss, extras = (res[0], list(res[1:])) if isinstance(res, tuple) and res else (res, [])
        if any(not isinstance(t, torch.Tensor) for t in extras):
            raise _NotFast("an output after the loss is not a tensor")
        n_extra[0] = len(extras)
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
        return [loss, *extras, *(next(grads) if n else None for n in needs)]

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
    _, reason = functionalize_intermediates(gm, fake_mode)  # x += y, relu_ on intermediates
    if reason is not None:
        raise _NotFast(reason)
    for n in graph.nodes:  # what is left mutating (none, after the rewrite) or is not an aten op falls back
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
    out.meta["desc"] = [*(PlainAOTOutput(i) for i in range(1 + n_extra[0])),
                        *(GradAOTOutput(d) if n else None for d, n in zip(descs, needs))]
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


__all__ = ["BufferAOTInput", "GradAOTOutput", "InputMutationAOTOutput", "JOINT_PATHS", "ParamAOTInput",
           "PlainAOTInput", "PlainAOTOutput", "TangentAOTInput", "decompositions", "export_joint"]
