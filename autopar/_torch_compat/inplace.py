"""In-place ops on intermediates, made functional on a traced fx graph (torch 2.13 op schemas,
fake-tensor storages through ``torch.multiprocessing.reductions.StorageWeakRef``).

The one-pass joint trace (``aot._export_joint_fast``) runs ``make_fx`` without functionalization,
so ``h += x``, ``x.mul_(s)`` or ``F.silu(x, inplace=True)`` on a tensor the model computed appear
as ``add_``/``mul_``/``silu_`` nodes. ``make_fx`` points later uses of the mutated tensor at the
in-place node, so such a node can become its out-of-place op (``add``, ``mul``, ``silu``) whenever
no other alias of the mutated memory is read after it: what functionalization would produce, for a
fraction of its cost. Mutations of inputs, parameters, buffers or constants, of memory that an
earlier view still reads afterwards, and ops without a same-signature functional variant are left
alone and reported, so that the caller falls back to AOTAutograd's functionalized export.

On a torch upgrade: check that ``make_fx`` still re-points a mutated tensor's proxy at the
in-place node (``tests/test_capture_inplace.py`` compares against AOTAutograd's export and the
eager model), that fake tensors still expose ``untyped_storage()``, and that in-place overloads
keep their functional twin's name without the trailing underscore.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

aten = torch.ops.aten


def _storage(node: torch.fx.Node) -> Optional[StorageWeakRef]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested): no alias info
        return None


def _type_key(arg: Any) -> tuple:
    return (arg.name, str(arg.type), arg.kwarg_only)


def functional_twin(op: Any) -> Optional[torch._ops.OpOverload]:
    """The out-of-place overload of in-place ``op`` (``aten.add_.Tensor`` -> ``aten.add.Tensor``):
    same arguments, ``self`` not written; None if ``op`` is not a plain in-place op of ``self``."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    schema = op._schema
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if len(written) != 1 or not schema.arguments or schema.arguments[0] is not written[0] \
            or len(schema.returns) != 1 or schema.returns[0].alias_info is None:
        return None
    ns, _, name = schema.name.partition("::")
    if not name.endswith("_") or name.endswith("__"):
        return None
    packet = getattr(getattr(torch.ops, ns, None), name[:-1], None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    if not isinstance(twin, torch._ops.OpOverload) or twin._schema.is_mutable:
        return None
    if [_type_key(a) for a in twin._schema.arguments] != [_type_key(a) for a in schema.arguments]:
        return None
    return twin


def functionalize_intermediates(gm: torch.fx.GraphModule, fake_mode) -> tuple[int, Optional[str]]:
    """Rewrite every in-place op on an intermediate of ``gm`` as its functional twin.

    Returns ``(rewritten, reason)``: ``reason`` is None when the graph is now free of mutations
    this pass can see, else why it is not (the graph is then unchanged). Safe means: the mutated
    memory belongs to no placeholder or constant, and every node aliasing it that precedes the
    mutation is read no later than the mutation (eager code would otherwise read the new values
    through it)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    muts = [n for n in nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target._schema.is_mutable]
    if not muts:
        return 0, None
    members: dict[StorageWeakRef, list[torch.fx.Node]] = {}
    outer: set = set()  # memory the caller owns: inputs, parameters, buffers, constants
    for n in nodes:
        s = _storage(n)
        if s is None:
            continue
        members.setdefault(s, []).append(n)
        if n.op in ("placeholder", "get_attr"):
            outer.add(s)
    plan = []
    for m in muts:
        twin = functional_twin(m.target)
        if twin is None:
            return 0, f"op {m.target} mutates and has no functional twin"
        target = m.args[0] if m.args else None
        s = _storage(target) if isinstance(target, torch.fx.Node) else None
        if s is None or _storage(m) != s:
            return 0, f"op {m.target}: cannot tell which memory it mutates"
        if s in outer:
            return 0, f"op {m.target} mutates an input, parameter, buffer or constant"
        for x in members[s]:
            if pos[x] < pos[m] and any(pos[u] > pos[m] for u in x.users):
                return 0, f"op {m.target} mutates memory that {x.name} still reads afterwards"
        vals = torch.fx.node.map_arg(m.args, lambda a: a.meta["val"])
        kvals = torch.fx.node.map_arg(m.kwargs, lambda a: a.meta["val"])
        with fake_mode:
            new = twin(*vals, **kvals)
            # in place keeps self's dtype (bf16 += fp32 stays bf16), where the functional op promotes
            cast = new.to(m.meta["val"].dtype) if new.dtype != m.meta["val"].dtype else None
        if tuple(new.shape) != tuple(m.meta["val"].shape):
            return 0, f"op {m.target}: its functional twin gives shape {tuple(new.shape)}"
        plan.append((m, twin, new, cast))
    for m, twin, new, cast in plan:
        with graph.inserting_before(m):
            out = f = graph.call_function(twin, m.args, m.kwargs)
            f.meta.update(m.meta)
            f.meta["val"] = new
            if cast is not None:
                out = graph.call_function(aten._to_copy.default, (f,), {"dtype": cast.dtype})
                out.meta.update(m.meta)
                out.meta["val"] = cast
        m.replace_all_uses_with(out)
        graph.erase_node(m)
    return len(plan), None


__all__ = ["functional_twin", "functionalize_intermediates"]

