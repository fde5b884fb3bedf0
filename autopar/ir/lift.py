"""Lift an exported fx graph (with AOTAutograd descriptors) into the IR ``Graph``.

One IR Node per placeholder and per ``call_function``; ``operator.getitem`` nodes are folded into
``Ref(node, index)``; the output node becomes ``Graph.outputs``. Module paths come from
``node.meta["custom"]["autopar_module"]`` (set by capture's hooks); nodes without one (gradient
accumulation adds) take the common module of their inputs.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch.fx.node import map_arg

from autopar import _torch_compat as tc
from autopar.errors import CaptureError
from autopar.ir.graph import Graph, Hint, Node, Phase, Ref, Role, TensorSpec
from autopar.ir.hint import hint as _hint  # noqa: F401  (registers autopar::hint)

__all__ = ["lift", "spec_of", "drop_constant_inputs", "merge_tied"]

aten = torch.ops.aten


def spec_of(val: Any) -> Optional[TensorSpec]:
    """The ``TensorSpec`` of a fake or real tensor value (None for a non-tensor)."""
    if isinstance(val, torch.Tensor):
        return TensorSpec(tuple(map(int, val.shape)), val.dtype)  # static shapes: plain ints
    return None


def _common_module(paths: list[str]) -> str:
    if not paths:
        return ""
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        common.append(level[0])
    return ".".join(common)


def _phase(n: torch.fx.Node) -> Phase:
    return Phase.BACKWARD if n.meta.get("partitioner_tag") == "is_backward" else Phase.FORWARD


# ---------------------------------------------------------------------------------------------
# fx rewrites that make the exported graph's inputs mean one thing each (run before lifting)


def drop_constant_inputs(gm: torch.fx.GraphModule, const_idx: list[int]) -> None:
    """Remove the placeholders of non-tensor inputs: their values are baked into the graph."""
    drop = set(const_idx)
    for n in list(gm.graph.nodes):
        desc = n.meta.get("desc")
        if n.op == "placeholder" and isinstance(desc, tc.PlainAOTInput) and desc.idx in drop:
            if n.users:
                raise CaptureError(f"the non-tensor input #{desc.idx} is read by the graph; pass it as a tensor")
            gm.graph.erase_node(n)


def merge_tied(gm: torch.fx.GraphModule, mc: torch.nn.Module) -> dict[str, str]:
    """Tied parameters (one tensor under several FQNs) arrive as one placeholder per FQN: keep the
    first FQN's placeholder, read it everywhere, and sum the gradients. Returns alias -> canonical."""
    canon: dict[str, str] = {}
    for named in (mc.named_parameters(remove_duplicate=False), mc.named_buffers(remove_duplicate=False)):
        first: dict[int, str] = {}
        for fqn, t in named:
            canon[fqn] = first.setdefault(id(t), fqn)
    aliases = {a: c for a, c in canon.items() if a != c}
    if not aliases:
        return {}
    ph = {n.meta["desc"].target: n for n in gm.graph.nodes if n.op == "placeholder"
          and isinstance(n.meta.get("desc"), (tc.ParamAOTInput, tc.BufferAOTInput))}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs, descs = list(out.args[0]), list(out.meta["desc"])
    grad_pos = {d.grad_of.target: i for i, d in enumerate(descs) if isinstance(d, tc.GradAOTOutput)}
    drop = []
    for alias, c in aliases.items():
        if alias not in ph or c not in ph:
            continue
        ph[alias].replace_all_uses_with(ph[c])
        gm.graph.erase_node(ph[alias])
        if alias in grad_pos and c in grad_pos:
            ga, gc = outs[grad_pos[alias]], outs[grad_pos[c]]
            if ga is not None and gc is not None:
                with gm.graph.inserting_before(out):
                    total = gm.graph.call_function(aten.add.Tensor, (gc, ga))
                total.meta.update(val=gc.meta["val"], partitioner_tag="is_backward")
                outs[grad_pos[c]] = total
            elif gc is None:
                outs[grad_pos[c]] = ga
            drop.append(grad_pos[alias])
    out.args = (tuple(o for i, o in enumerate(outs) if i not in drop),)
    out.meta["desc"] = [d for i, d in enumerate(descs) if i not in drop]
    return aliases


# ---------------------------------------------------------------------------------------------
# Lifting


def lift(
    gm: torch.fx.GraphModule,
    *,
    training: bool,
    input_names: list[str],
    constants: dict[str, Any],
    aliases: dict[str, str],
) -> Graph:
    """The IR of ``gm``. ``input_names[i]`` names the input with descriptor ``PlainAOTInput(i)``."""
    hint_op = torch.ops.autopar.hint.default
    nodes: list[Node] = []
    by_name: dict[str, Node] = {}
    ref_of: dict[torch.fx.Node, Ref] = {}
    params: dict[str, str] = {}
    buffers: dict[str, str] = {}
    inputs: dict[str, str] = {}
    hints: list[Hint] = []
    out_node = None
    op_names: dict[int, str] = {}  # id(target) -> its name (the targets live on through the call)

    for n in gm.graph.nodes:
        if n.op == "output":
            out_node = n
            continue
        if n.op == "call_function" and n.target is operator.getitem:
            src = n.args[0]
            base = ref_of[src]
            if base.index != 0 or not isinstance(src.meta.get("val"), (tuple, list)):
                raise CaptureError(f"cannot lift a nested tuple output of {src.target} in the captured graph; please "
                                   "report it with the model")
            ref_of[n] = Ref(base.node, n.args[1])
            continue
        outs_val = n.meta.get("val")
        outputs = [spec_of(v) for v in outs_val] if isinstance(outs_val, (tuple, list)) else [spec_of(outs_val)]
        roles = [Role.ACTIVATION] * len(outputs)
        if n.op == "placeholder":
            desc = n.meta.get("desc")
            module_path = ""
            if isinstance(desc, (tc.ParamAOTInput, tc.BufferAOTInput)):
                is_param = isinstance(desc, tc.ParamAOTInput)
                (params if is_param else buffers)[desc.target] = n.name
                roles = [Role.PARAMETER if is_param else Role.BUFFER]
                module_path = desc.target.rpartition(".")[0]
            elif isinstance(desc, tc.PlainAOTInput):
                inputs[input_names[desc.idx]] = n.name
                roles = [Role.INPUT]
            elif isinstance(desc, tc.TangentAOTInput):
                roles = [Role.TANGENT]
            else:
                raise CaptureError(f"capture does not understand an input of the traced graph ({desc!r}); please "
                                   "report it with the model")
            node = Node(n.name, "placeholder", None, (), {}, [], outputs, roles, _phase(n), module_path, n)
        elif n.op == "call_function":
            ins: list[Ref] = []

            def to_ref(a: torch.fx.Node) -> Ref:
                r = ref_of[a]
                ins.append(r)
                return r

            args = tuple(map_arg(n.args, to_ref))
            kwargs = dict(map_arg(n.kwargs, to_ref))
            custom = n.meta.get("custom") or {}
            if "autopar_module" in custom:
                module_path = custom["autopar_module"]
            else:
                module_path = _common_module(
                    [by_name[r.node].module_path for r in ins if not by_name[r.node].is_placeholder]
                )
            op = op_names.get(id(n.target))
            if op is None:
                op = op_names[id(n.target)] = str(n.target)
            node = Node(n.name, op, n.target, args, kwargs, ins, outputs, roles, _phase(n), module_path, n)
            if n.target is hint_op:
                hints.append(Hint(Ref(n.name, 0), n.args[1], module_path))
        elif n.op == "get_attr":  # a tensor constant created in forward (e.g. torch.tensor([...]))
            val = getattr(gm, n.target)
            outputs = [spec_of(val)]
            users = [(u.meta.get("custom") or {}).get("autopar_module", "") for u in n.users]
            node = Node(n.name, "get_attr", n.target, (), {}, [], outputs, roles, _phase(n), _common_module(users), n)
        else:
            raise CaptureError(f"unexpected {n.op} node ({n.target}) in the captured graph; please report it "
                               "with the model")
        nodes.append(node)
        by_name[n.name] = node
        ref_of[n] = Ref(n.name, 0)

    assert out_node is not None
    descs = out_node.meta.get("desc") or [None] * len(out_node.args[0])
    outputs: list[Optional[Ref]] = []
    grads: dict[str, Ref] = {}
    mutations: dict[str, Ref] = {}
    loss: Optional[Ref] = None
    extras: dict[int, Ref] = {}
    for o, d in zip(out_node.args[0], descs):
        r = ref_of[o] if isinstance(o, torch.fx.Node) else None
        outputs.append(r)
        if r is None:
            continue
        if isinstance(d, tc.GradAOTOutput):
            grads[d.grad_of.target] = r
            by_name[r.node].roles[r.index] = Role.GRADIENT
        elif isinstance(d, tc.InputMutationAOTOutput):
            mutations[getattr(d.mutated_input, "target", str(d.mutated_input))] = r
        elif isinstance(d, tc.PlainAOTOutput) and training and d.idx == 0:
            loss = r
            by_name[r.node].roles[r.index] = Role.LOSS
        elif isinstance(d, tc.PlainAOTOutput) and training:
            extras[d.idx] = r  # the model's other outputs (capture(outputs=True))

    return Graph(
        nodes=nodes,
        training=training,
        params=params,
        buffers=buffers,
        inputs=inputs,
        constants=dict(constants),
        grads=grads,
        loss=loss,
        outputs=outputs,
        hints=hints,
        gm=gm,
        aliases=dict(aliases),
        mutations=mutations,
        extras=[extras[i] for i in sorted(extras)],
    )
