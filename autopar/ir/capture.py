"""Capture: a model and example inputs -> the IR ``Graph`` of one training (or inference) step.

Recipe (the reasons are measured, see DESIGN.md "Capture: traps measured on torch 2.13"):

1. Copy the model without copying its data: ``copy.deepcopy`` with a memo that maps every
   parameter and buffer to an empty *fake CPU* tensor of the same shape and dtype. Meta models are
   never exported as meta (torch then silently drops every gradient, and attention is decomposed
   into bmm + softmax); on fake CPU tensors SDPA stays fused as
   ``aten._scaled_dot_product_flash_attention_for_cpu``, which step 4 makes device-neutral
   (``autopar.ir.attention``). The user's model is never touched.
2. On the copy: forward-pre/forward hooks that annotate every traced node with the module path
   (``node.meta["custom"]["autopar_module"]``; backward nodes inherit it), and a ``forward`` that
   returns the loss (training; with ``outputs=True`` the model's other tensors after it, detached)
   or the flattened tensor outputs (inference); ``ir.outputs`` records where each goes back.
3. ``aot_export_joint_with_descriptors`` with ``_log_softmax`` (and its backward) decomposed, so a
   vocab-split cross-entropy is a sequence of reductions. Inference exports a copy whose parameters
   do not require grad, which gives a forward-only graph.
4. Rewrites on the fx graph: fused attention retargeted to the device-neutral ``autopar.attention``
   (+ backward), tied parameters merged into one placeholder (gradients summed),
   non-tensor inputs removed (they are constants), mean losses turned into sum / total_weight.
5. Lift to the IR (``autopar.ir.lift``) and check: every trainable parameter has a gradient.
"""

from __future__ import annotations

import copy
import functools
import operator
import os
import sys
import warnings
from typing import Any, Callable, Optional

import torch

from autopar import _torch_compat as tc
from autopar._torch_compat import pytree
from autopar.errors import CaptureError
from autopar.ir.attention import device_neutral
from autopar.ir.blocks import mark_blocks
from autopar.ir.graph import Graph
from autopar.ir.lift import drop_constant_inputs, lift, merge_tied
from autopar.ir.outputs import OutputTree, check_loss_fn, strip_output_detach, traced_forward
from autopar.ir.placement import PlacementError
from autopar.ir.stack import capture_stacked
from autopar.ir.rules.random_attention import fused_dropout_attention

__all__ = ["capture", "normalize_mean_losses"]

aten = torch.ops.aten

_DECOMPOSE = [aten._log_softmax.default, aten._log_softmax_backward_data.default]


def _new_zeros(self, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    """``new_zeros`` as ``zeros``: its input only supplies the dtype and device, so the captured op
    reads nothing (a template, such as the gradient an indexing's backward scatters into zeros of
    its input's shape, is then never gathered to make it)."""
    return aten.zeros.default(size, dtype=self.dtype if dtype is None else dtype,
                              layout=self.layout if layout is None else layout,
                              device=self.device if device is None else device, pin_memory=pin_memory)
_CONSTANT_TYPES = (bool, int, float, str, type(None))
_SUPPORTED = (
    "tensors, (nested) lists/tuples/dicts of tensors (and None), or top-level int/float/bool/str/None constants"
)


def as_args(example_inputs) -> tuple:
    """A model's positional example inputs as a tuple: a lone tensor (or value) becomes a 1-tuple."""
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def capture(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: Optional[dict] = None,
    *,
    training: bool = True,
    outputs: bool = False,
    loss_fn: Optional[Callable] = None,
    stack: bool = True,
) -> Graph:
    """Capture ``model(*example_inputs, **example_kwargs)`` as an IR Graph of aten ops.

    ``training=True``: the joint forward+backward step; the model must return a loss (a scalar
    tensor, a dict, dataclass or named tuple with a ``loss`` entry, a tuple whose first element is
    a scalar float tensor, or exactly one scalar float tensor among its outputs), or ``loss_fn``
    computes it. With ``outputs=True`` the model's other tensor outputs are outputs of the step too
    (``Graph.extras``, no gradient flows from them); without, the step returns the loss alone.
    ``training=False``: the forward only, every tensor output kept. ``Graph.output_tree`` records
    where each output goes back in the model's result (``ir.outputs``).

    ``loss_fn(output, target)`` (or ``loss_fn(output)`` without a ``target`` keyword input): the
    loss of the model's output, captured into the step; the keyword input ``target`` goes to it,
    not to the model, and the step returns ``StepOutput(loss, output)``.

    The model's own mode (``train()``/``eval()``) is used as is. Inputs may live on any device, meta
    included: only their shapes and dtypes are used. Raises :class:`CaptureError` with a reason and
    a remedy.

    A deep stack of alike layers is captured at a few layers and replicated to full depth, the same
    Graph node for node (``ir.stack``); ``stack=False`` (or ``AUTOPAR_STACK_CAPTURE=0``) always
    traces every layer.
    """
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"capture expects a torch.nn.Module, got {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise CaptureError(
            f"{type(model).__name__} has no parameters: there is nothing to place or train. "
            "Register weights as nn.Parameter (buffers and plain tensor attributes are not parameters)."
        )
    if training and not any(p.requires_grad for p in model.parameters()):
        raise CaptureError(
            f"no parameter of {type(model).__name__} requires grad, so there is no training step to capture; "
            "capture with training=False for a forward-only graph"
        )
    args = as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    names, constants = _check_inputs(args, kwargs)
    if loss_fn is not None:
        check_loss_fn(loss_fn)
    if stack and os.environ.get("AUTOPAR_STACK_CAPTURE", "1") != "0":
        def finish(gm: torch.fx.GraphModule, like: Graph, full: bool) -> Graph:
            trainable = [fqn for fqn, p in model.named_parameters() if p.requires_grad] if full else []
            graph = _lifted(gm, like.output_tree, training, names, constants, like.aliases, trainable)
            if full:  # (said from capture's caller: finish < _replicated < capture_stacked < capture)
                _warn_attention_dropout(graph, stacklevel=6)
            return graph

        one = functools.partial(_capture_one, args=args, kwargs=kwargs, names=names, constants=constants,
                                training=training, outputs=outputs, loss_fn=loss_fn, warn=False)
        graph = capture_stacked(model, one, finish)
        if graph is not None:
            return graph
    return _capture_one(model, args, kwargs, names, constants, training, outputs, loss_fn)


def _capture_one(model: torch.nn.Module, args: tuple, kwargs: dict, names: list[str], constants: dict[str, Any],
                 training: bool, outputs: bool, loss_fn: Optional[Callable], warn: bool = True) -> Graph:
    """``capture``'s trace of every layer: the steps of the module docstring (``warn``: about the
    graph's unfused attention dropout, which a stacked capture says of the full graph instead)."""
    fm = tc.FakeTensorMode(allow_non_fake_inputs=True)
    mc = _fake_copy(model, fm, training)
    fargs, fkwargs = _fake_inputs(args, kwargs, fm)
    tracker = _ModuleTracker(mc)
    trees: list[OutputTree] = []  # the model's output structure, as the trace saw it
    mc.forward = traced_forward(mc.forward, training, outputs, loss_fn, trees)  # instance attribute: hooks still run
    decomps = {**tc.decompositions(_DECOMPOSE), aten.new_zeros.default: _new_zeros}
    grad_mode = torch.enable_grad() if training else torch.no_grad()
    # attention with dropout is recorded fused, with its dropout_p (ir.rules.random_attention)
    with grad_mode, tc.preserve_node_meta(), fused_dropout_attention():  # the tracker closes inside
        try:
            gm = tc.export_joint(mc, fargs, fkwargs, decomps)
        except Exception as e:  # noqa: BLE001 - re-raised as one clear message
            where = tracker.where(e)
            tracker.close()
            raise _capture_error(e, where) from e
        tracker.close()

    device_neutral(gm)
    const_idx = [i for i, n in enumerate(names) if n in constants]
    drop_constant_inputs(gm, const_idx)
    aliases = merge_tied(gm, mc)
    if training:
        strip_output_detach(gm)
    normalize_mean_losses(gm)
    tc.use_flat_calling_convention(gm)  # gm(*placeholders) -> tuple of outputs
    gm.graph.lint()
    gm.recompile()

    trainable = [fqn for fqn, p in mc.named_parameters() if p.requires_grad]
    graph = _lifted(gm, trees[-1] if trees else None, training, names, constants, aliases, trainable)
    _refuse_random_ops(graph)
    if warn:
        _warn_attention_dropout(graph, stacklevel=4)
    return graph


def _lifted(gm: torch.fx.GraphModule, tree: Optional[OutputTree], training: bool, names: list[str],
            constants: dict[str, Any], aliases: dict[str, str], trainable: list[str]) -> Graph:
    """The IR of the rewritten ``gm``, checked: every trainable parameter has a gradient."""
    graph = lift(gm, training=training, input_names=names, constants=constants, aliases=aliases)
    graph.output_tree = tree
    mark_blocks(graph)
    if training:
        _check_grads(graph, trainable)
    return graph


# ---------------------------------------------------------------------------------------------
# Inputs and the fake copy


def _check_inputs(args: tuple, kwargs: dict) -> tuple[list[str], dict[str, Any]]:
    """Names of the flattened inputs (``input:0``, ``input:1[2]``, ``labels``) and the constants.

    The order is pytree's flattening of ``(args, kwargs)``, which is the order of the export's
    ``PlainAOTInput(idx)`` descriptors."""
    for key, value in [(f"input:{i}", a) for i, a in enumerate(args)] + list(kwargs.items()):
        if isinstance(value, _CONSTANT_TYPES) or isinstance(value, torch.Tensor):
            continue
        if isinstance(value, (list, tuple, dict)):
            for path, leaf in pytree.tree_flatten_with_path(value)[0]:
                if not isinstance(leaf, torch.Tensor) and leaf is not None:
                    raise CaptureError(
                        f"example input {key!r} is a {type(value).__name__} holding a "
                        f"{type(leaf).__name__} at {pytree.keystr(path) or 'its top'}; supported inputs are "
                        f"{_SUPPORTED}. Pass non-tensor settings as separate top-level arguments."
                    )
            continue
        raise CaptureError(
            f"example input {key!r} has type {type(value).__module__}.{type(value).__qualname__}, which "
            f"capture cannot handle; supported inputs are {_SUPPORTED}"
            + (" (convert numpy arrays with torch.from_numpy)" if type(value).__module__ == "numpy" else "")
        )
    names, constants = [], {}
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        first = path[1]
        head = f"input:{first.idx}" if path[0].idx == 0 else str(first.key)
        name = head + pytree.keystr(path[2:])
        names.append(name)
        if not isinstance(leaf, torch.Tensor):
            constants[name] = leaf
    return names, constants


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``t``'s shape, strides and dtype on CPU (called under the fake mode)."""
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")


def _fake_copy(model: torch.nn.Module, fm, training: bool) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are fake CPU tensors (no data copied)."""
    memo: dict[int, Any] = {}
    with fm:
        for _, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(_fake_like(p), requires_grad=training and p.requires_grad)
        for _, b in model.named_buffers(remove_duplicate=False):
            if id(b) not in memo:
                memo[id(b)] = _fake_like(b)
    odd = [f"{path + '.' if path else ''}{k} ({v.device.type})" for path, mod in model.named_modules()
           for k, v in vars(mod).items() if isinstance(v, torch.Tensor) and id(v) not in memo and v.device.type != "cpu"]
    if odd:  # a plain attribute is a constant of the graph: capture needs its value, on the CPU
        raise CaptureError(
            f"tensor attribute(s) {', '.join(odd[:5])} are neither parameters nor buffers and are not on the CPU; "
            "capture cannot turn them into graph inputs: register them with register_buffer(name, t, "
            "persistent=False)"
        )
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:  # noqa: BLE001
        raise CaptureError(
            f"could not copy {type(model).__name__} for capture ({type(e).__name__}: {e}); capture works on a "
            "copy so that your model stays untouched: make the module deep-copyable"
        ) from e


def _fake_inputs(args: tuple, kwargs: dict, fm) -> tuple[tuple, dict]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    with fm:
        leaves = [_fake_like(x) if isinstance(x, torch.Tensor) else x for x in leaves]
    return pytree.tree_unflatten(leaves, spec)


class _ModuleTracker:
    """Hooks on every submodule: annotate traced nodes with the module path, and remember in which
    module an exception was raised (for error messages).

    The forward hook is ``always_call``: it also runs when forward raises, so the annotation stack
    stays balanced even if the model catches its own exceptions. On that path it runs inside the
    ``except`` block of ``Module._call_impl``; the innermost module sees the exception first."""

    def __init__(self, root: torch.nn.Module):
        self.stack: list[Any] = []
        self.raised: list[tuple[BaseException, str, str]] = []
        self.handles = []
        for path, mod in root.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._pre(path)))
            self.handles.append(mod.register_forward_hook(self._post(path), always_call=True))

    def _pre(self, path: str):
        def hook(mod, args):
            ctx = tc.annotate({"autopar_module": path})
            ctx.__enter__()
            self.stack.append(ctx)

        return hook

    def _post(self, path: str):
        def hook(mod, args, out):
            exc = sys.exc_info()[1]
            if exc is not None and not any(exc is r[0] for r in self.raised):
                self.raised.append((exc, path, type(mod).__name__))
            if self.stack:
                self.stack.pop().__exit__(None, None, None)

        return hook

    def where(self, exc: BaseException) -> Optional[tuple[str, str]]:
        """Module path and class in which ``exc`` (or an exception it was raised from) was raised."""
        chain = []
        while exc is not None and exc not in chain:
            chain.append(exc)
            exc = exc.__cause__ or exc.__context__
        for e, path, cls in self.raised:
            if any(e is c for c in chain):
                return path, cls
        return None

    def close(self) -> None:
        while self.stack:  # restore fx's global annotation state whatever happened
            self.stack.pop().__exit__(None, None, None)
        for h in self.handles:
            h.remove()


# ---------------------------------------------------------------------------------------------
# Errors


def _capture_error(e: Exception, where: Optional[tuple[str, str]]) -> Exception:
    """One clear CaptureError for an exception raised while tracing."""
    chain, seen = [], set()
    cur: Optional[BaseException] = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for c in chain:
        if isinstance(c, (CaptureError, PlacementError)):  # ours, already clear: keep the type
            return c
    loc = "in the model's forward" if where is None else (
        f"in module {where[0]!r} ({where[1]})" if where[0] else f"in the model's forward ({where[1]})"
    )
    for c in chain:
        if isinstance(c, tc.DATA_DEPENDENT_ERRORS):
            op = tc.data_dependent_op(c)
            return CaptureError(
                f"capture failed {loc}: {'op ' + op if op else 'an op'} has an output shape or value that "
                "depends on tensor data (e.g. nonzero, boolean-mask indexing, .item(), .tolist()), which "
                "a static graph cannot express. Use a static-shape formulation: multiply masks in instead "
                "of indexing with them, route to a fixed capacity per expert, keep values as tensors. "
                f"({type(c).__name__}: {str(c).strip().splitlines()[0] if str(c).strip() else ''})"
            )
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return CaptureError(f"capture failed {loc}: {type(e).__name__}: {msg}")


# ---------------------------------------------------------------------------------------------
# Rewrites on the exported fx graph


def normalize_mean_losses(gm: torch.fx.GraphModule) -> int:
    """Rewrite every mean-reduced ``nll_loss_forward`` as a sum divided by its total weight.

    ``nll_loss_forward(x, t, w, reduction=1 (mean), ii)`` becomes ``nll_loss_forward(..., 2 (sum),
    ii)`` followed by ``div(loss, total_weight)``; readers of the old loss read the ``div``. The
    total weight (output 1) is the same under both reductions and ``nll_loss_backward`` with mean
    reduction already takes it as an input, so the backward is unchanged. Why: the mean over a
    batch-split target is not the sum of per-device means, but sum / total_weight is expressible
    as partial sums (``P``) divided once. The two sums are stacked into one tensor, which one
    ``unbind`` splits again for the division (and the backward, for the total weight): a
    batch-split loss then needs one all-reduce of two numbers, not one for each (and a single
    consumer of the stack lets the planner's local search see that). Returns the number of
    rewritten losses.
    """
    count = 0
    targets = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in targets or n.args[3] != 1:
            continue
        gets = {u.args[1]: u for u in n.users if u.target is operator.getitem}
        if 0 not in gets:
            continue
        n.args = (*n.args[:3], 2, *n.args[4:])
        if 1 not in gets:
            with gm.graph.inserting_after(gets[0]):
                tw = gm.graph.call_function(operator.getitem, (n, 1))
            tw.meta.update(n.meta, val=n.meta["val"][1])
            gets[1] = tw
        loss, tw = gets[0], gets[1]
        after = loss if list(gm.graph.nodes).index(loss) > list(gm.graph.nodes).index(tw) else tw
        keep = {k: v for k, v in n.meta.items() if k in ("custom", "partitioner_tag", "stack_trace")}
        val = loss.meta["val"]
        with gm.graph.inserting_after(after):
            both = gm.graph.call_function(aten.stack.default, ([loss, tw],))
        with gm.graph.inserting_after(both):
            parts = gm.graph.call_function(aten.unbind.int, (both,))
        with gm.graph.inserting_after(parts):
            sums = gm.graph.call_function(operator.getitem, (parts, 0))
        with gm.graph.inserting_after(sums):
            total = gm.graph.call_function(operator.getitem, (parts, 1))
        with gm.graph.inserting_after(total):
            div = gm.graph.call_function(aten.div.Tensor, (sums, total))
        loss.replace_all_uses_with(div, delete_user_cb=lambda u: u is not both)
        tw.replace_all_uses_with(total, delete_user_cb=lambda u: u is not both)
        for node, v in ((both, val.new_empty((2,))), (parts, [val, val]), (sums, val), (total, val), (div, val)):
            node.meta.update(keep)
            node.meta["val"] = v
        count += 1
    return count


# ---------------------------------------------------------------------------------------------
# Checks on the result


def _check_grads(graph: Graph, trainable: list[str]) -> None:
    missing = [fqn for fqn in trainable if fqn not in graph.grads]
    if missing:
        shown = ", ".join(missing[:10]) + (f", ... ({len(missing)} in all)" if len(missing) > 10 else "")
        raise CaptureError(
            f"the captured training step has no gradient for parameter(s) {shown}. Either forward does "
            "not use them (freeze them with requires_grad_(False) or remove them), or the loss does not "
            "depend on them, or the graph was exported on the meta device."
        )


_DROPOUT = ("aten.native_dropout", "aten.bernoulli")
_SOFTMAX = ("aten._safe_softmax.default", "aten._softmax.default")


def _refuse_random_ops(graph: Graph) -> None:
    """A ``CaptureError`` naming the random ops autopar cannot draw alike on every placement (before
    any planning): ``ir.rules.random_ops.SUPPORTED`` lists those it can."""
    from autopar.ir.rules.random_ops import SUPPORTED, unsupported_random

    bad = unsupported_random([n.op for n in graph.ops()])
    if bad:
        where = sorted({f"{n.op} in {n.module_path or '<root>'!r}" for n in graph.ops() if n.op in bad})
        raise CaptureError(
            f"the model draws random numbers with {', '.join(where)}; autopar draws only "
            f"{', '.join(SUPPORTED)} the same on every placement. Set that op's probability to 0, call "
            "model.eval(), or write it with dropout / bernoulli_(p) / rand_like"
        )


def _warn_attention_dropout(graph: Graph, stacklevel: int) -> None:
    """Attention written as softmax + dropout (not ``F.scaled_dot_product_attention``, which stays
    fused with its dropout) keeps batch*heads*seq^2 scores and masks in memory: say so."""
    drop = {n.module_path for n in graph.ops() if n.op.startswith(_DROPOUT)}
    soft = {n.module_path for n in graph.ops() if n.op in _SOFTMAX}
    both = sorted(drop & soft)
    if both:
        warnings.warn(
            f"attention in module(s) {', '.join(repr(m or '<root>') for m in both)} computes softmax + dropout "
            "unfused (batch*heads*seq^2 scores and masks in memory); it runs correctly, but "
            "F.scaled_dot_product_attention(..., dropout_p=p) would keep it one fused op, unless its attn_mask "
            "requires grad (a learned position bias, as T5's): the fused op has no gradient for the mask",
            stacklevel=stacklevel,
        )
