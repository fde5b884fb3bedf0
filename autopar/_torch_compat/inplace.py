"""In-place ops on intermediates, made functional on a traced fx graph (torch 2.13 op schemas,
fake-tensor storages through ``torch.multiprocessing.reductions.StorageWeakRef``).

The one-pass joint trace (``aot._export_joint_fast``) runs ``make_fx`` without functionalization,
so ``h += x``, ``x.mul_(s)`` or ``F.silu(x, inplace=True)`` on a tensor the model computed appear
as ``add_``/``mul_``/``silu_`` nodes. ``make_fx`` points later uses of the mutated tensor at the
in-place node, so such a node can become its out-of-place op (``add``, ``mul``, ``silu``) whenever
no other alias of the mutated memory is read after it: what functionalization would produce, for a
fraction of its cost. A write through views of a tensor (``view``, ``slice``, ``select``: T5's
``shifted[..., 1:] = ids[..., :-1]``, autograd's write-backs in the backward) becomes the
functional op written back into the tensor (a ``view`` back, ``slice_scatter``,
``select_scatter``) for its later readers. Mutations of inputs, parameters, buffers or constants,
writes through other views (transposes, ``as_strided``), of memory that an earlier view still
reads afterwards, and ops without a same-signature functional variant are reported, so that the
caller falls back to AOTAutograd's functionalized export.

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
    if not isinstance(twin, torch._ops.OpOverload) or twin._schema.is_mutable \
            or any(r.alias_info is not None for r in twin._schema.returns):  # unsqueeze_ -> a view: not here
        return None
    if [_type_key(a) for a in twin._schema.arguments] != [_type_key(a) for a in schema.arguments]:
        return None
    return twin


#: View ops a write through which is undone by a view back to the input's shape.
_RESHAPES = (aten.view.default, aten._unsafe_view.default)
#: View ops a write through which is embedded back into the input by a scatter (same arguments).
_SCATTERS = {aten.slice.Tensor: aten.slice_scatter.default, aten.select.int: aten.select_scatter.default}


def functionalize_intermediates(gm: torch.fx.GraphModule, fake_mode) -> tuple[int, Optional[str]]:
    """Rewrite every in-place op on an intermediate of ``gm`` as its functional twin.

    Returns ``(rewritten, reason)``: ``reason`` is None when the graph is free of mutations, else
    why a mutation could not be rewritten; the graph is then partly rewritten and must be
    discarded. A mutation of ``base`` or of a view of it (``view``, ``slice``, ``select``) is
    rewritten when the memory belongs to no placeholder or constant and no other alias of it is read
    after the mutation; later reads of ``base`` read the new value written back into it. Autograd's
    own write-backs into views of gradients (``CopySlices``) are of that form."""
    graph = gm.graph
    if not any(_mutable(n) for n in graph.nodes):
        return 0, None
    graph.eliminate_dead_code()  # views autograd replays and drops are not reads
    nodes = list(graph.nodes)
    pos = {n: float(i) for i, n in enumerate(nodes)}
    cls: dict[torch.fx.Node, StorageWeakRef] = {}
    members: dict[StorageWeakRef, list[torch.fx.Node]] = {}
    outer: set = set()  # memory the caller owns: inputs, parameters, buffers, constants
    for n in nodes:
        s = _storage(n)
        if s is None:
            continue
        cls[n] = s
        members.setdefault(s, []).append(n)
        if n.op in ("placeholder", "get_attr"):
            outer.add(s)
    fresh: set[torch.fx.Node] = set()  # the rewrite's own results: new memory
    count = 0
    for m in [n for n in nodes if _mutable(n)]:
        written = [a for a, spec in zip(m.args, m.target._schema.arguments)
                   if spec.alias_info is not None and spec.alias_info.is_write and isinstance(a, torch.fx.Node)]
        if any(cls.get(a) in outer for a in written):
            return count, f"op {m.target} mutates an input, parameter, buffer or constant"
        twin = functional_twin(m.target)
        if twin is None:
            return count, f"op {m.target} mutates and has no functional twin"
        s = cls.get(m.args[0]) if isinstance(m.args[0], torch.fx.Node) else None
        if s is None or not _same(cls.get(m), s):
            return count, f"op {m.target}: cannot tell which memory it mutates"
        chain = [m.args[0]]  # base, views of it (reshapes, slices, selects), ..., the mutated tensor
        while chain[0] not in fresh:
            x = chain[0]
            if x.op == "call_function" and (x.target in _RESHAPES or x.target in _SCATTERS) \
                    and _same(cls.get(x.args[0]), s):
                chain.insert(0, x.args[0])
            elif x.op == "call_function" and any(_same(cls.get(i), s) for i in x.all_input_nodes):
                return count, f"op {m.target} writes through a view ({x.target}) of another tensor"
            else:
                break
        base = chain[0]
        for x in members[s]:
            if x is not base and pos[x] < pos[m] and any(pos[u] > pos[m] for u in x.users):
                return count, f"op {m.target} mutates memory that {x.name} still reads afterwards"
        later = [u for u in base.users if pos[u] > pos[m]]
        try:
            made = _rewrite(graph, m, twin, chain, fake_mode)
        except _Unsupported as e:
            return count, f"op {m.target}: {e}"
        for k, n in enumerate(made):
            pos[n] = pos[m] + (k + 1) / (len(made) + 1)
            cls[n] = s
            members[s].append(n)
            fresh.add(n)
        for u in later:  # eager code reads the new values through the base
            u.replace_input_with(base, made[-1])
        m.replace_all_uses_with(made[-1 - (len(chain) - 1)])
        graph.erase_node(m)
        members[s].remove(m)
        count += 1
    return count, None


class _Unsupported(Exception):
    pass


def _same(a: Optional[StorageWeakRef], b: StorageWeakRef) -> bool:
    """Whether ``a`` (None for a node that holds no tensor, e.g. an integer ``sym_size``) is the
    storage ``b``: ``StorageWeakRef`` cannot be compared with None."""
    return a is not None and a == b


_PREV = object()  # in a step's arguments: the node the previous step made


def _mutable(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable


def _rewrite(graph, m, twin, chain, fake_mode) -> list[torch.fx.Node]:
    """Insert ``twin(*m.args)`` before ``m`` (cast to the mutated dtype if the twin promotes), then,
    for each view in ``chain`` from the mutated tensor up, the op that writes the new value back
    into the view's input (a ``view`` back, a ``slice_scatter``, a ``select_scatter``): the nodes
    made, the new base last."""
    old = m.meta["val"]
    # (target, args, kwargs, value); _PREV in args stands for the previous step's node
    with fake_mode:
        new = twin(*torch.fx.node.map_arg(m.args, lambda a: a.meta["val"]),
                   **torch.fx.node.map_arg(m.kwargs, lambda a: a.meta["val"]))
        if tuple(new.shape) != tuple(old.shape):
            raise _Unsupported(f"its functional twin gives shape {tuple(new.shape)}")
        steps = [(twin, m.args, m.kwargs, new)]
        if new.dtype != old.dtype:  # in place keeps self's dtype (bf16 += fp32 stays bf16); the twin promotes
            new = new.to(old.dtype)
            steps.append((aten._to_copy.default, (_PREV,), {"dtype": old.dtype}, new))
        for link in reversed(chain[1:]):  # write the new value back into each view's input
            parent = link.args[0]
            if link.target in _SCATTERS:
                scatter = _SCATTERS[link.target]
                new = scatter(parent.meta["val"], new, *link.args[1:], **link.kwargs)
                steps.append((scatter, (parent, _PREV, *link.args[1:]), dict(link.kwargs), new))
                continue
            shape = list(parent.meta["val"].shape)
            try:
                new = new.view(shape)
            except RuntimeError as e:
                raise _Unsupported(f"cannot view the new value back as {shape}") from e
            steps.append((aten.view.default, (_PREV, shape), {}, new))
    made: list[torch.fx.Node] = []
    with graph.inserting_before(m):
        for target, args, kwargs, val in steps:
            args = tuple(made[-1] if a is _PREV else a for a in args)
            n = graph.call_function(target, args, kwargs)
            n.meta.update(m.meta)
            n.meta["val"] = val
            made.append(n)
    return made


__all__ = ["functional_twin", "functionalize_intermediates"]

