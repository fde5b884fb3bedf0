"""Mixed precision: the dtype every value of a lowered program holds, and where casts go.

Autocast cannot run a lowered program in mixed precision: the captured graph is made of low-level
aten ops (``native_layer_norm``, ``autopar.attention``, the decomposed
log-softmax, ...) that its policies do not cover, and a sharded program must move the bytes its
plan priced. So the lowering casts explicitly, FSDP/AMP style, following one ``CastPolicy`` that
the cost model (``transfer_bytes``) and the lowering both read:

- floating parameters (the fp32 master weights the optimizer updates) and floating inputs are cast
  to the compute dtype where they enter the program, *before* any resharding: parameter gathers
  move bf16 (``Precision.gather_bytes``);
- ops compute in the compute dtype: an op reading any compute-dtype value casts its other floating
  inputs to it, and floating ``dtype=`` arguments (``full``, ``_to_copy``, ``sum``, ...) follow;
- full precision (the captured dtype, normally fp32) is kept where it is cheap and matters:
  *the loss region* — the forward ops from the first op after the last matmul-like op up to the
  loss (the decomposed log-softmax, ``nll_loss``, the mean's division; any elementwise loss such as
  MSE) — and every op outside the layers whose floating inputs are all full precision:
  the loss's backward (seeded by the fp32 tangent) up to the first matmul, buffers (kept in their
  own dtype, as FSDP does: rotary tables, norm statistics), values made from integers
  (``arange(...).float()``, masks). A compute-dtype op reading such a value casts it down where it
  reads it. Inside a layer instance (``ir.layers``: ``blocks.3`` and the ops run between its weights,
  as ``fold`` folds them) every op with a floating input computes in the compute dtype, so all
  instances of a layer are alike and the planner's one price for a folded layer holds for each;
- kernel outputs that are always fp32 (attention's log-sum-exp) keep it and are never cast: the
  backward kernels require it;
- explicit conversions of a floating value to another floating dtype (a model's own ``.float()``)
  are kept as written;
- every parameter gradient is cast to the gradient dtype (fp32 under ``*-mixed``) *before* its
  reduction (all-reduce and reduce-scatter buckets move fp32, ``Precision.grad_bytes``), and to its
  parameter's dtype after it.

Integer and bool tensors are never touched. ``fp16-mixed`` does no loss scaling: seed the
backward with a scaled loss (``torch.amp.GradScaler``) if gradients underflow.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from autopar.cost_model.precision import Precision, element_bytes
from autopar.ir.attention import ATTN_FWD
from autopar.ir.graph import Graph, Node, Ref, Role, TensorSpec
from autopar.ir.layers import layer_members
from autopar.ir.rules.base import OpCall

#: Precisions that cast: name -> (compute dtype, dtype gradients are reduced in).
CASTING: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "fp16-mixed": (torch.float16, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
}

#: Ops where the loss region stops (matmuls, convolutions, attention, embeddings, norms): they run in
#: the compute dtype, and the loss region starts after the last of them.
COMPUTE_OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.matmul.", "aten.linear.",
               "aten.convolution.", "aten._convolution.", "aten._scaled_dot_product", "autopar.attention", "aten.embedding.",
               "aten.native_layer_norm.", "aten.native_batch_norm.", "aten._native_batch_norm_legit",
               "aten.native_group_norm.", "aten._fused_rms_norm.", "aten._grouped_mm.")

#: Outputs (by index) that kernels compute in fp32 whatever their inputs: left as they are.
KERNEL_FP32_OUTPUTS: dict[str, tuple[int, ...]] = {
    ATTN_FWD: (1,),
    "aten._scaled_dot_product_flash_attention_for_cpu.default": (1,),
    "aten._scaled_dot_product_flash_attention.default": (1,),
    "aten._scaled_dot_product_efficient_attention.default": (1,),
    "aten._scaled_dot_product_cudnn_attention.default": (1,),
}

_CONVERSIONS = ("aten._to_copy.default", "aten.to.dtype", "prims.convert_element_type.default")


def _is_float(spec: Optional[TensorSpec]) -> bool:
    return spec is not None and spec.dtype.is_floating_point


@dataclass(frozen=True)
class CastPolicy:
    """Where a program lowered at precision ``name`` casts (see the module docstring)."""

    name: str
    compute: torch.dtype
    grad: torch.dtype
    modes: dict[str, Optional[torch.dtype]]  # op -> dtype its floating inputs are cast to (None: captured)
    dtypes: dict[Ref, torch.dtype]  # every floating value -> the dtype it holds in the program
    exempt: frozenset[Ref]  # kernel fp32 outputs: never cast
    loss_region: frozenset[str]  # forward ops kept in full precision around the loss

    def dtype(self, graph: Graph, ref: Ref) -> torch.dtype:
        """The dtype ``ref`` holds in the program (where it is produced, and when it is resharded)."""
        return self.dtypes.get(ref, graph.spec(ref).dtype)

    def entry_cast(self, graph: Graph, ref: Ref) -> Optional[torch.dtype]:
        """For a parameter or input: the dtype it is cast to before anything reads (or gathers) it."""
        node = graph.node(ref.node)
        if not node.is_placeholder:
            return None
        got = self.dtypes.get(ref)
        return got if got is not None and got != node.out.dtype else None

    def input_dtype(self, graph: Graph, node: Node, ref: Ref) -> Optional[torch.dtype]:
        """The dtype ``node`` reads ``ref`` in, when that needs a cast (None: read as it is)."""
        if not _is_float(graph.spec(ref)) or ref in self.exempt:
            return None
        want = self.modes.get(node.name) or graph.spec(ref).dtype
        return want if want != self.dtype(graph, ref) else None

    def op_call(self, graph: Graph, node: Node, call: OpCall) -> OpCall:
        """``call`` as the op runs here: specs in program dtypes, floating ``dtype=`` arguments in the
        compute dtype when the op computes in it."""
        mode = self.modes.get(node.name)
        if mode is None:
            return call
        in_specs = [dataclasses.replace(s, dtype=self._read(graph, node, r)) if _is_float(s) else s
                    for s, r in zip(call.in_specs, node.inputs)]
        out_specs = [dataclasses.replace(s, dtype=self.dtypes.get(Ref(node.name, j), s.dtype)) if _is_float(s) else s
                     for j, s in enumerate(call.out_specs)]
        kwargs = dict(call.kwargs)
        if isinstance(kwargs.get("dtype"), torch.dtype) and kwargs["dtype"].is_floating_point:
            kwargs["dtype"] = mode
        return dataclasses.replace(call, in_specs=in_specs, out_specs=out_specs, kwargs=kwargs)

    def _read(self, graph: Graph, node: Node, ref: Ref) -> torch.dtype:
        return self.input_dtype(graph, node, ref) or self.dtype(graph, ref)


def loss_region(graph: Graph, layers: frozenset[str] = frozenset()) -> frozenset[str]:
    """The forward ops the loss is computed by after the last matmul-like op (``COMPUTE_OPS``):
    walking back from the loss through producers, stopping at those ops, at placeholders and at
    the ops of layer instances (``layers``)."""
    if graph.loss is None:
        return frozenset()
    seen: set[str] = set()
    todo = [graph.loss.node]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        node = graph.node(name)
        if node.is_placeholder or node.op == "get_attr" or node.op.startswith(COMPUTE_OPS) or name in layers:
            continue
        seen.add(name)
        todo.extend(r.node for r in node.inputs)
    return frozenset(seen)


def _explicit_conversion(graph: Graph, node: Node) -> bool:
    """A model's own cast of a floating value to another floating dtype (kept as written)."""
    if node.op not in _CONVERSIONS or not node.inputs:
        return False
    src, dst = graph.spec(node.inputs[0]).dtype, node.outputs[0].dtype if node.outputs[0] else None
    return src.is_floating_point and dst is not None and dst.is_floating_point and dst != src


def cast_policy(graph: Graph, precision) -> Optional[CastPolicy]:
    """The casts a program of ``graph`` runs at ``precision`` (a name or a ``Precision``); None for
    precisions that run every tensor in its captured dtype ("model", "fp32", "fp64")."""
    name = precision.name if isinstance(precision, Precision) else str(precision)
    if name not in CASTING:
        return None
    # the cost model, the kept gathers and the lowering ask for it alike: made once per graph and precision
    made = _POLICIES.setdefault(graph, {})
    key = (name, len(graph.nodes))
    if key not in made:
        made[key] = _policy(graph, name)
    return made[key]


#: per graph: (precision name, its node count when made) -> its ``CastPolicy``
_POLICIES: "weakref.WeakKeyDictionary[Graph, dict]" = weakref.WeakKeyDictionary()


def _policy(graph: Graph, name: str) -> CastPolicy:
    compute, grad = CASTING[name]
    layers = layer_members(graph)
    region = loss_region(graph, layers)
    dtypes: dict[Ref, torch.dtype] = {}
    modes: dict[str, Optional[torch.dtype]] = {}
    exempt: set[Ref] = set()
    for node in graph.nodes:
        if node.is_placeholder:
            if _is_float(node.out) and node.roles[0] in (Role.PARAMETER, Role.INPUT):
                dtypes[Ref(node.name, 0)] = compute
            continue
        floats = [r for r in node.inputs if _is_float(graph.spec(r))]
        if node.name in layers:  # every instance of a layer alike (the planner prices one for all)
            keep = not floats
        else:
            keep = node.name in region or all(dtypes.get(r, graph.spec(r).dtype) == graph.spec(r).dtype for r in floats)
        mode = None if keep or _explicit_conversion(graph, node) else compute
        modes[node.name] = mode
        fixed = KERNEL_FP32_OUTPUTS.get(node.op, ())
        for j, spec in enumerate(node.outputs):
            if not _is_float(spec):
                continue
            ref = Ref(node.name, j)
            if j in fixed:
                exempt.add(ref)
            elif mode is not None:
                dtypes[ref] = mode
    return CastPolicy(name, compute, grad, modes, dtypes, frozenset(exempt), region)


#: The transfer role of each edge kind the cost model and the report price: a parameter's edge is a
#: gather, a gradient's a reduction, anything else an activation.
_ROLE_OF_KIND = {"param": "gather", "grad": "grad"}


def transfer_role(kind: str) -> str:
    """The role (``"gather"``, ``"grad"``, ``"activation"``) in which an edge of ``kind`` moves."""
    return _ROLE_OF_KIND.get(kind, "activation")


def transfer_bytes(graph: Graph, ref: Ref, role: str, precision: Precision, policy: Optional[CastPolicy]) -> int:
    """Bytes per element of ``ref`` when it is resharded in ``role`` (activation, gather, grad):
    an activation moves in the dtype the policy gives it (full precision in the loss region),
    parameters and gradients at the precision's gather and gradient sizes."""
    spec = graph.spec(ref)
    if policy is not None and role == "activation" and spec.dtype.is_floating_point:
        return policy.dtype(graph, ref).itemsize
    return element_bytes(spec.dtype, role, precision)


__all__ = ["CASTING", "COMPUTE_OPS", "CastPolicy", "KERNEL_FP32_OUTPUTS", "cast_policy",
           "loss_region", "transfer_bytes", "transfer_role"]
