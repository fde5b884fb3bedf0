"""The rule registry and the objects rules work on.

A rule turns one op instance (an ``OpCall``: the op, its non-tensor arguments, its tensor shapes)
into a ``DimMap`` (the data), optionally adds special signatures, and optionally gives a rank-aware
local implementation. ``signatures`` / ``strategies`` / ``run_local`` are what passes and the
simulator call.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch.fx.node import map_aggregate

from autopar.ir.graph import Graph, Node, Ref, TensorSpec
from autopar.ir.placement import Balanced, Placement, Split, blocks_fit, local_range, local_shape
from autopar.ir.rules.dimmap import (
    DimMap,
    Signature,
    Strategy,
    balanced_compose_ok,
    balanced_signatures,
    compose_ok,
    enumerate_signatures,
    replicate_signature,
)


@dataclass
class OpCall:
    """One op instance as rules see it: tensors are ``Ref``s in ``args``; their specs are listed."""

    op: str
    target: Any
    args: tuple
    kwargs: dict
    in_specs: list[TensorSpec]
    out_specs: list[Optional[TensorSpec]]
    module_path: str = ""

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """A non-tensor argument by position or keyword."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)

    def where(self) -> str:
        """The op and its module path, for messages."""
        return f"{self.op} in module {self.module_path or '<root>'!r}"


def op_call(graph: Graph, node: Node) -> OpCall:
    """The ``OpCall`` a rule sees for graph node ``node``: op, target, arguments and tensor specs."""
    return OpCall(
        op=node.op,
        target=node.target,
        args=node.args,
        kwargs=node.kwargs,
        in_specs=[graph.spec(r) for r in node.inputs],
        out_specs=list(node.outputs),
        module_path=node.module_path,
    )


@dataclass
class LocalCtx:
    """What a rank-aware local implementation knows: the strategy and this device's coordinates."""

    call: OpCall
    strategy: Strategy
    mesh_shape: tuple[int, ...]
    coords: tuple[int, ...]
    #: 1 normally; the mutation test sets 0 to check that offsets are really needed (and checked).
    offset_scale: int = 1
    #: the program's device: where local code creates tensors that no input places (None: torch's default)
    device: Optional[torch.device] = None
    #: ``permute(x, axis, dest)``: point-to-point exchange on a mesh axis, for strategies that pass
    #: blocks between devices inside the op (ring attention); set by the program and the rule proof
    permute: Optional[Callable[..., torch.Tensor]] = None
    #: ``exchange(x, axis, send, recv)``: the rows of ``x`` exchanged in run-time pieces on a mesh axis
    #: (``program.collectives.all_to_all_v``), for local code that moves rows (``rules.expert``)
    exchange: Optional[Callable] = None

    def in_placements(self, i: int) -> tuple[Placement, ...]:
        """This op's input placements on every mesh axis, per input."""
        return tuple(sig.inputs[i] for sig in self.strategy)

    def out_placements(self, j: int) -> tuple[Placement, ...]:
        """This op's output placements on every mesh axis, per output."""
        return tuple(sig.outputs[j] for sig in self.strategy)  # type: ignore[misc]

    def in_range(self, i: int, dim: int) -> tuple[int, int]:
        """``(start, length)`` of this device's block of input ``i`` along ``dim``."""
        spec = self.call.in_specs[i]
        _no_balanced(self, self.in_placements(i), dim)
        start, length = local_range(spec.shape, self.in_placements(i), self.mesh_shape, self.coords)[dim]
        return self._offset(start), length

    def out_range(self, j: int, dim: int) -> tuple[int, int]:
        """The ``[start, stop)`` of output ``j``'s dim ``dim`` that this device holds."""
        spec = self.call.out_specs[j]
        assert spec is not None
        _no_balanced(self, self.out_placements(j), dim)
        start, length = local_range(spec.shape, self.out_placements(j), self.mesh_shape, self.coords)[dim]
        return self._offset(start), length

    def _offset(self, start: int) -> int:
        if start and not torch.compiler.is_compiling():  # a count for the rule proof, never a compiled program's guard
            OFFSET_READS[0] += 1
        return start * self.offset_scale

    def out_shape(self, j: int = 0) -> tuple[int, ...]:
        """This device's block shape of output ``j``."""
        spec = self.call.out_specs[j]
        assert spec is not None
        return local_shape(spec.shape, self.out_placements(j), self.mesh_shape, self.coords)


def _no_balanced(ctx: LocalCtx, placements: Sequence[Placement], dim: int) -> None:
    """A device's block of a balanced split (``Z``) is two pieces: it has no one offset."""
    if any(isinstance(p, Balanced) and p.dim == dim for p in placements):
        raise RuntimeError(f"{ctx.call.where()}: local code read an offset along dim {dim}, which is laid out "
                           "balanced (Z); this op must not take the balanced layout")


#: How many non-zero offsets local implementations have read (lets the mutation test know which
#: signatures depend on offsets at all).
OFFSET_READS = [0]

LocalFn = Callable[[LocalCtx, list], Any]


@dataclass
class OpRule:
    """How to shard one op. ``dimmap`` is the data; ``extra`` adds signatures a DimMap cannot say
    (vocab-split embedding); ``local`` replaces the plain op on local shards where the local
    computation needs this device's offsets (``None``: the op itself, with size arguments
    rewritten to local sizes by ``size_args``)."""

    dimmap: Callable[[OpCall], DimMap]
    extra: Optional[Callable[[OpCall, DimMap], list[Signature]]] = None
    local: Optional[LocalFn] = None
    size_args: tuple[tuple[int, str, int], ...] = ()  # (arg index, arg name, output index) holding a shape
    # rewrites other size arguments (in place, on the args list and kwargs) to this device's sizes
    arg_fix: Optional[Callable[[LocalCtx, list, dict], None]] = None
    # the ``local`` implementation reads no offset of a dim of equal blocks (its DimMap keeps such
    # dims whole where it would), so the DimMap's block-by-block splits stay valid
    blocks_ok: bool = False
    # keeps only the composed strategies that hold together on the mesh (a special signature that
    # may take one axis only, or needs sizes its pieces divide); None: every composition
    compose: Optional[Callable[[OpCall, list, Sequence[int]], list]] = None
    # the ``local`` implementation reads offsets only of dims no balanced split (``Z``) reaches (the
    # embedding's vocabulary), so the op takes ``Z`` as an op without ``local`` does
    balanced_ok: bool = False


RULES: dict[str, OpRule] = {}
_warned: set[tuple[str, str]] = set()


def register(*ops: str, **kw) -> Callable:
    """Decorator: register a DimMap builder for ``ops`` (names as ``str(OpOverload)``)."""

    def deco(fn: Callable[[OpCall], DimMap]) -> Callable[[OpCall], DimMap]:
        for op in ops:
            RULES[op] = OpRule(dimmap=fn, **kw)
        return fn

    return deco


def has_rule(op: str) -> bool:
    """Whether ``op`` has a sharding rule (ops without one run replicated)."""
    return op in RULES


def _has_blocks(call: OpCall) -> bool:
    return any(s is not None and s.blocks for s in list(call.in_specs) + list(call.out_specs))


def _build(rule: OpRule, call: OpCall) -> DimMap:
    """The rule's DimMap, told which of the call's tensor dims are equal blocks."""
    dm = rule.dimmap(call)
    if _has_blocks(call):
        dm.in_blocks = [dict(s.blocks) for s in call.in_specs]
        dm.out_blocks = [dict(s.blocks) if s is not None else {} for s in call.out_specs]
    return dm


def dimmap(call: OpCall) -> Optional[DimMap]:
    """The DimMap of the call's rule (None for an op without a rule)."""
    rule = RULES.get(call.op)
    return _build(rule, call) if rule else None


def _splits_blocks(call: OpCall, sig: Signature) -> bool:
    """Whether ``sig`` splits a dim of equal blocks (which only DimMap signatures understand)."""
    for spec, p in list(zip(call.in_specs, sig.inputs)) + list(zip(call.out_specs, sig.outputs)):
        if spec is not None and spec.blocks and isinstance(p, Split) and spec.block_count(p.dim) > 1:
            return True
    return False


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.3g} KiB"


def no_rule_message(call: OpCall) -> str:
    """What an op without a sharding rule means for the user: where it is, what running it
    replicated costs, and what they can do about it."""
    ins = [s for s in call.in_specs if s is not None]
    outs = [s for s in call.out_specs if s is not None]
    shapes = ", ".join(str(tuple(s.shape)) for s in ins) or "no tensors"
    gathered = sum(s.nbytes for s in ins)
    held = sum(s.nbytes for s in outs)
    return (
        f"autopar: {call.op} in module {call.module_path or '<root>'!r} (inputs {shapes}) has no sharding "
        f"rule, so every device runs it whole: its inputs are gathered in full on every device first "
        f"(up to {_mib(gathered)} of communication per call where they were split) and every device computes "
        f"and holds all of it ({_mib(held)} of output), which also keeps the ops around it from splitting. "
        "To avoid it: write that code with more common tensor ops, or ask autopar's maintainers for a rule "
        "for this op (quote this message)."
    )


def signatures(call: OpCall, min_size: int = 2) -> list[Signature]:
    """The op's one-axis signatures; an op without a rule gets all-``B`` and one warning."""
    rule = RULES.get(call.op)
    if call.op == "get_attr":  # a constant tensor of the graph: every device holds it
        return [replicate_signature(0, call.out_specs)]
    if rule is None:
        key = (call.op, call.module_path)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(no_rule_message(call), stacklevel=2)
        return [replicate_signature(len(call.in_specs), call.out_specs)]
    dm = _build(rule, call)
    sigs = enumerate_signatures(dm, min_size=min_size)
    extra = rule.extra(call, dm) if rule.extra is not None else []
    if _has_blocks(call):
        # special signatures and offset-reading local code know nothing of blocks (``blocks_ok``: the
        # local code keeps the DimMap's block splits valid; its special signatures still do not)
        if not rule.blocks_ok and (rule.local is not None or extra):
            sigs = [s for s in sigs if not _splits_blocks(call, s)]
        extra = [s for s in extra if not _splits_blocks(call, s)]
    return sigs + extra


def strategies(call: OpCall, mesh_shape: Sequence[int], min_size: int = 2,
               balanced: Sequence[int] = ()) -> list[Strategy]:
    """Every valid composition of one-axis signatures over the mesh's axes (axis order = mesh order).
    ``balanced``: sequence lengths whose splits also come load-balanced (``Z``; ``ir.rules.dimmap.
    balanced_signatures``), where the op runs as itself on its blocks."""
    sigs = signatures(call, min_size=min_size)
    rule = RULES.get(call.op)
    dm = _build(rule, call) if rule else None
    if balanced and dm is not None and (rule.local is None or rule.balanced_ok) and rule.arg_fix is None:
        sigs = sigs + balanced_signatures(dm, sigs, balanced)
    out = []
    for combo in itertools.product(sigs, repeat=len(mesh_shape)):
        if dm is None or (compose_ok(dm, combo, mesh_shape) and balanced_compose_ok(dm, combo, mesh_shape)):
            out.append(tuple(combo))
    if _has_blocks(call):
        out = [st for st in out if _blocks_fit(call, st, mesh_shape)]
    if rule is not None and rule.compose is not None:
        out = rule.compose(call, out, mesh_shape)
    return out


def _blocks_fit(call: OpCall, strategy: Strategy, mesh_shape: Sequence[int]) -> bool:
    """Every dim of equal blocks that the strategy splits is cut into equal pieces of each block."""
    for i, spec in enumerate(call.in_specs):
        if spec.blocks and not blocks_fit(spec.shape, [s.inputs[i] for s in strategy], mesh_shape, spec.blocks):
            return False
    for j, spec in enumerate(call.out_specs):
        if spec is not None and spec.blocks and not blocks_fit(
                spec.shape, [s.outputs[j] for s in strategy], mesh_shape, spec.blocks):
            return False
    return True


def substitute(call: OpCall, tensors: Sequence[Any]) -> tuple[tuple, dict]:
    """``call``'s args and kwargs with its Refs replaced, in order, by ``tensors``."""
    it = iter(tensors)

    def sub(a):
        return next(it) if isinstance(a, Ref) else a

    args = map_aggregate(call.args, sub)
    kwargs = map_aggregate(call.kwargs, sub)
    return tuple(args), dict(kwargs)


def as_list(result: Any) -> list:
    """``x`` as a list: a tuple or list as is, anything else as a one-element list."""
    if isinstance(result, (tuple, list)):
        return list(result)
    return [result]


def local_args(ctx: LocalCtx, local_inputs: Sequence[Any]) -> tuple[tuple, dict]:
    """The op's arguments on this device's blocks: tensors substituted, shape arguments
    (``size_args``) rewritten to the local output shape. Only for rules without a ``local``."""
    rule = RULES.get(ctx.call.op)
    args, kwargs = substitute(ctx.call, local_inputs)
    if rule is not None and (rule.size_args or rule.arg_fix):
        args, kwargs = list(args), dict(kwargs)
        for index, name, j in rule.size_args:
            if index < len(args):
                args[index] = list(ctx.out_shape(j))
            elif name in kwargs:
                kwargs[name] = list(ctx.out_shape(j))
        if rule.arg_fix is not None:
            rule.arg_fix(ctx, args, kwargs)
        args = tuple(args)
    return args, kwargs


def has_local(op: str) -> bool:
    """Whether ``op``'s rule replaces the op by a rank-aware local implementation."""
    rule = RULES.get(op)
    return rule is not None and rule.local is not None


def run_local(ctx: LocalCtx, local_inputs: Sequence[torch.Tensor]) -> list:
    """This device's outputs of ``ctx.call`` under ``ctx.strategy``, from its local input blocks."""
    rule = RULES.get(ctx.call.op)
    if rule is not None and rule.local is not None:
        return as_list(rule.local(ctx, list(local_inputs)))
    args, kwargs = local_args(ctx, local_inputs)
    return as_list(ctx.call.target(*args, **kwargs))


__all__ = [
    "DimMap",
    "LocalCtx",
    "OpCall",
    "OpRule",
    "RULES",
    "Signature",
    "Strategy",
    "has_local",
    "local_args",
    "no_rule_message",
    "op_call",
    "register",
    "run_local",
    "signatures",
    "strategies",
]
