"""Emitting one rank's program: from a ``Resolved`` plan (``resolve.py``) to a ``Program``.

``lower`` writes, for one device of the mesh, two ``fx.GraphModule``s:

- ``forward(*params, *buffers, *inputs) -> (*outputs, *saved)``: the forward ops on local blocks,
  with the loss (or the inference outputs) and buffer updates as outputs, followed by the values
  the backward reads;
- ``backward(*saved, tangent) -> grads``: the backward ops, each gradient resharded to its
  parameter's placement.

Every op runs its rule's local implementation: the aten op itself with shape arguments rewritten
to local sizes, or (for rules whose local code needs this device's offsets) a ``LocalOp`` module.
Wherever a producer's placement differs from what a consumer's strategy reads, the tensor is
resharded by the cost model's own steps (``reshard_steps``), so the collectives that run are the
ones the plan priced. A tensor is resharded once per target placement and phase and shared by
every consumer that needs it; an activation resharded in forward is saved for the backward,
while parameters are gathered again in the backward (as FSDP does, so gathered weights are not
held between the two), except those of a layer instance that keeps its gathers
(``plan.kept_gathers``, ``Resolved.kept``): the backward reuses the forward's gathered block. A checkpointed layer instance's forward ops (``Resolved.recomputed``) are
not saved: the backward runs them again where their values are first needed, collectives included.
Under a mixed or 16-bit precision the program casts as ``cost_model.casting``
decides: parameters before their gathers, op inputs after their resharding, gradients before
their reduction.
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence

import torch
import torch.fx as fx

from autopar import _torch_compat as tc
from autopar.errors import LoweringError
from autopar.ir.graph import Node, Phase, Ref
from autopar.ir.placement import B, Placements, local_shape
from autopar.ir.rules.base import LocalCtx, has_local, local_args
from autopar.ir.rules.dimmap import Strategy
from autopar.ir.rules.random_attention import is_random_call, key_node
from autopar.ir.views import param_views
from autopar.passes.lower.gathers import grouped_gather, plan_groups
from autopar.passes.lower.grads import bucketed_grads, pack_as_made, pack_when_ready
from autopar.passes.lower.plain_local import Input, PlainCall, plain_call
from autopar.passes.lower.reshard import reshard
from autopar.passes.lower.resolve import Resolved, placeholder_key
from autopar.passes.lower.schedule import mark_recomputation, schedule
from autopar.passes.lower.simplify import drop_identities
from autopar.passes.search.strategies import input_placement, output_placement
from autopar.program.collectives import all_to_all_v
from autopar.program.program import LocalOp, Program, RandomOp, RandomState, Slot

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
_RESHAPE = torch.ops.aten.reshape.default


# -- matching the plan -----------------------------------------------------------------------------

# -- emitting one rank's program ---------------------------------------------------------------------

class Emitter:
    """Writes the forward and backward fx graphs of one rank."""

    def __init__(self, res: Resolved, coords: Sequence[int], device: Optional[torch.device], precision: str):
        self.res = res
        self.casts = res.cast(precision)  # what this program casts
        self.priced = res.cast(res.precision.name)  # the casts the plan priced its collectives with
        self.g = res.graph
        self.coords = tuple(coords)
        self.mesh_shape = res.mesh.shape
        self.device = None if device is None else torch.device(device)
        self.root = torch.nn.Module()
        self.fg, self.bg = fx.Graph(), fx.Graph()
        # base[ref] = (fx node, phase graph, placements) of a value where it was produced
        self.base: dict[Ref, tuple[fx.Node, fx.Graph, Placements]] = {}
        # cache[(graph, ref, placements)] = fx node holding the value at those placements
        self.cache: dict[tuple[int, Ref, Placements], fx.Node] = {}
        self.saved: list[fx.Node] = []  # forward values the backward reads, in order
        self.saved_in: dict[fx.Node, fx.Node] = {}  # forward node -> its backward placeholder
        # rebase[ref] = (backward fx node, backward, placements) of a recomputed forward value
        self.rebase: dict[Ref, tuple[fx.Node, fx.Graph, Placements]] = {}
        # (value, placement) a re-run op reads: resharded again in the backward from what is saved,
        # never saved resharded, so the saved set and the collectives are those the plan priced
        self.reread = {(r, input_placement(res.strategies[n], k))
                       for n in res.recomputed for k, r in enumerate(self.g.node(n).inputs)}
        # parameters and layout views of them: resharded per phase, never saved gathered (as FSDP)
        self.params = param_views(self.g)
        self.used_names: set[str] = set()
        self.emitted: set[str] = set()  # graph nodes emitted (a group's gather may emit a view early)
        # parameter gathers that share one collective (``gathers.py``): key -> the group's members
        self.gather_groups = plan_groups(self)
        # the key of the program's random draws (seed and step set by the driver): one per program
        self.random = RandomState() if any(is_random_call(n.op, n.args, n.kwargs) for n in self.g.ops()) else None

    # values ---------------------------------------------------------------------------------------
    def value(self, ref: Ref, want: Placements, where: fx.Graph, dtype: Optional[torch.dtype] = None) -> fx.Node:
        """``ref`` at placements ``want`` in phase ``where``; cast to ``dtype`` after resharding."""
        if dtype is not None:
            key = (id(where), ref, want, dtype)
            if key not in self.cache:
                self.cache[key] = self.cast(self.value(ref, want, where), dtype, where)
            return self.cache[key]
        key = (id(where), ref, want)
        if key in self.cache:
            return self.cache[key]
        is_param = ref.node in self.params
        if is_param and where is self.bg and (ref, tuple(want)) in self.res.kept:
            out = self._kept(ref, tuple(want))
            self.cache[key] = out
            return out
        if is_param:
            grouped = grouped_gather(self, ref, want, where)
            if grouped is not None:
                return grouped
        if where is self.bg and ref.node in self.res.recomputed:
            node, home, have = self._recomputed(ref)  # re-run in the backward, never saved
        else:
            node, home, have = self.base[ref]
        if where is self.bg and home is self.fg and not is_param and (ref, want) not in self.reread:
            fkey = (id(self.fg), ref, want)
            if fkey in self.cache:  # resharded in forward already: save it
                out = self.import_value(self.cache[fkey])
                self.cache[key] = out
                return out
        if where is not home:
            node = self.import_value(node)
        entry = self.casts.entry_cast(self.g, ref) if self.casts is not None else None
        if entry is not None:  # before any gather: one cast per resharding, moved with it by ``schedule``
            node = self.cast(node, entry, where)
        out = self._reshard(node, ref, have, want, where)
        self.cache[key] = out
        return out

    @staticmethod
    def cast(x: fx.Node, dtype: torch.dtype, where: fx.Graph) -> fx.Node:
        """``x`` cast to ``dtype`` in program ``where``, marked for ``schedule``."""
        out = where.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": dtype})
        out.meta["autopar_cast"] = True  # ``schedule`` moves it with the collective it feeds
        return out

    def import_value(self, fnode: fx.Node) -> fx.Node:
        """Forward value ``fnode`` in the backward: saved by the forward, a backward placeholder."""
        if fnode not in self.saved_in:
            self.saved.append(fnode)
            ph = self.bg.placeholder(f"saved_{fnode.name}")
            ph.meta.update(fnode.meta)
            self.saved_in[fnode] = ph
        return self.saved_in[fnode]

    def _reshard(self, x: fx.Node, ref: Ref, src: Placements, dst: Placements, where: fx.Graph) -> fx.Node:
        return reshard(self, x, ref, src, dst, where)

    # nodes ---------------------------------------------------------------------------------------
    def emit(self) -> None:
        """Emit every node of the graph into the forward or backward program, in graph order."""
        for node in self.g.nodes:
            if node.name not in self.emitted:
                self._emit_node(node)

    def ensure_emitted(self, name: str) -> None:
        """Emit node ``name`` now if it was not yet (with the nodes it reads): a view of a parameter
        whose group's gather runs before the view's own place in the graph."""
        if name in self.emitted:
            return
        node = self.g.node(name)
        for r in node.inputs:
            self.ensure_emitted(r.node)
        self._emit_node(node)

    def _emit_node(self, node: Node) -> None:
        self.emitted.add(node.name)
        strat = self.res.strategies[node.name]
        if node.is_placeholder:
            self._placeholder(node, strat)
        elif node.op == "get_attr":
            self._constant(node, strat)
        else:
            self._op(node, strat)

    def fresh_name(self, text: str) -> str:
        """A program-wide unique, identifier-safe name made from ``text``."""
        base = "".join(ch if ch.isalnum() else "_" for ch in text).strip("_") or "x"
        if base[0].isdigit():
            base = "_" + base
        name, k = base, 1
        while name in self.used_names:
            k += 1
            name = f"{base}_{k}"
        self.used_names.add(name)
        return name

    def _placeholder(self, node: Node, strat: Strategy) -> None:
        key = placeholder_key(self.g, node)
        where = self.bg if key is None else self.fg
        ph = where.placeholder(self.fresh_name("tangent" if key is None else key[1]))
        self.base[Ref(node.name, 0)] = (ph, where, output_placement(strat, 0))

    def _constant(self, node: Node, strat: Strategy) -> None:
        name = self.fresh_name(f"const_{node.name}")
        value = getattr(self.g.gm, node.target)
        if self.device is not None and isinstance(value, torch.Tensor):
            value = value.to(self.device)  # a captured constant (HF's ``_tensor_constant*``) lives on the CPU
        setattr(self.root, name, value)
        where = self.fg if node.phase == Phase.FORWARD else self.bg
        self.base[Ref(node.name, 0)] = (where.get_attr(name), where, output_placement(strat, 0))

    def _recomputed(self, ref: Ref) -> tuple[fx.Node, fx.Graph, Placements]:
        """Forward value ``ref`` of a checkpointed instance, made again in the backward where it is
        first needed: its op re-runs on values that are saved or themselves recomputed, with the
        reshardings (and so the collectives) between them (``plan.checkpointing``)."""
        if ref not in self.rebase:
            node = self.g.node(ref.node)
            self._op(node, self.res.strategies[node.name], self.bg, self.rebase)
        return self.rebase[ref]

    def _kept(self, ref: Ref, want: Placements) -> fx.Node:
        """Parameter (view) ``ref`` at ``want`` in the backward from the block the forward gathered
        and kept (``plan.kept_gathers``): saved by the forward, the layout views between them run
        again on it, then local slicing only; no collective."""
        d = self.res.kept[(ref, want)]
        x = self.import_value(self.value(d.source, d.placed, self.fg))
        cur = d.placed
        for name, strat in d.replay:
            node = self.g.node(name)
            ctx = LocalCtx(self.res.calls[name], strat, self.mesh_shape, self.coords, device=self.device,
                           exchange=all_to_all_v)
            if has_local(node.op):
                mod_name = self.fresh_name(f"{name}_kept_local")
                self.root.add_module(mod_name, LocalOp(ctx))
                x = self.bg.call_module(mod_name, (x,))
            else:
                args, kwargs = local_args(ctx, [x])
                x = self.bg.call_function(_RESHAPE if node.target in _VIEWS else node.target, tuple(args), dict(kwargs))
            cur = tuple(output_placement(strat, 0))
        return self._reshard(x, ref, cur, want, self.bg) if cur != want else x

    def _op(self, node: Node, strat: Strategy, where: Optional[fx.Graph] = None,
            table: Optional[dict] = None) -> None:
        """Emit ``node`` into its phase's program (or ``where``), its outputs recorded in ``self.base``
        (or ``table``)."""
        if where is None:
            where = self.fg if node.phase == Phase.FORWARD or not self.g.training else self.bg
        table = self.base if table is None else table
        casts, call = self.casts, self.res.calls[node.name]
        ins = [self.value(r, input_placement(strat, k), where, casts and casts.input_dtype(self.g, node, r))
               for k, r in enumerate(node.inputs)]
        if casts is not None:
            call = casts.op_call(self.g, node, call)
        ctx = LocalCtx(call, strat, self.mesh_shape, self.coords, device=self.device, exchange=all_to_all_v)
        random = is_random_call(node.op, node.args, node.kwargs)
        plain = self._plain_local(node, strat, ctx) if has_local(node.op) and not random else None
        if random:  # this device's block of the whole tensor's draw (``ir.rules.random_ops``)
            assert self.random is not None
            mod_name = self.fresh_name(f"{node.name}_random")
            self.root.add_module(mod_name, RandomOp(ctx, key_node(self.g, node), self.random))
            out = where.call_module(mod_name, tuple(ins))
        elif plain is not None:  # the rule's local code runs one plain op on this device: call it
            out = where.call_function(plain.target, *_fill_inputs(plain, ins))
        elif has_local(node.op):
            mod_name = self.fresh_name(f"{node.name}_local")
            self.root.add_module(mod_name, LocalOp(ctx))
            out = where.call_module(mod_name, tuple(ins))
        else:
            args, kwargs = local_args(ctx, ins)
            if self.device is not None and "device" in kwargs:
                kwargs = dict(kwargs, device=self.device)
            # a view recorded on fake tensors may rely on strides the local blocks do not share
            # (attention's output follows the query's layout; a sliced, collected block is dense)
            target = _RESHAPE if node.target in _VIEWS else node.target
            out = where.call_function(target, tuple(args), dict(kwargs))
        self.used_names.add(tc.rename_node(out, self.fresh_name(node.name)))
        out.meta["autopar_module"] = node.module_path
        if table is self.rebase:
            out.meta["autopar_recomputed"] = True  # a checkpointed instance's forward op, run again
        tensors = [j for j, spec in enumerate(node.outputs) if spec is not None]
        multi = len(node.outputs) > 1
        for j in tensors:
            val = where.call_function(operator.getitem, (out, j)) if multi else out
            table[Ref(node.name, j)] = (val, where, output_placement(strat, j))

    def _plain_local(self, node: Node, strat: Strategy, ctx: LocalCtx) -> Optional[PlainCall]:
        """The one plain op ``node``'s local implementation runs on this device, if that is all it
        does (``passes.plain_local``); None keeps the ``LocalOp``. Not on an accelerator: the
        probe runs on fake CPU tensors."""
        if self.device is not None and self.device.type != "cpu":
            return None
        shapes = [local_shape(self.g.spec(r).shape, input_placement(strat, k), self.mesh_shape, self.coords)
                  for k, r in enumerate(node.inputs)]
        return plain_call(ctx, shapes)

    def grad_source(self, fqn: str, src: Placements) -> fx.Node:
        """Parameter ``fqn``'s gradient where the backward produced it, in the gradient dtype (cast
        before its reduction)."""
        want = self.casts.grad if self.casts is not None else None
        r = self.g.grads[fqn]
        return self.value(r, src, self.bg, want if want != self._dtype(r) else None)

    def _grad(self, fqn: str, bucketed: dict[str, fx.Node]) -> fx.Node:
        """Parameter ``fqn``'s gradient, reduced to its parameter's placement, in its dtype."""
        g, r = self.g, self.g.grads[fqn]
        pl = output_placement(self.res.strategies[g.params[fqn]], 0)
        if fqn in bucketed:
            out = bucketed[fqn]
        else:
            src = self.base[r][2]
            out = self._reshard(self.grad_source(fqn, src), r, src, pl, self.bg)
        have = self.casts.grad if self.casts is not None else g.spec(r).dtype
        return out if have == g.spec(r).dtype else self.cast(out, g.spec(r).dtype, self.bg)

    def _dtype(self, ref: Ref) -> torch.dtype:
        return self.casts.dtype(self.g, ref) if self.casts is not None else self.g.spec(ref).dtype

    def local_shape_of(self, ref: Ref) -> tuple[int, ...]:
        """This device's block shape of ``ref`` where it was produced."""
        return local_shape(self.g.spec(ref).shape, self.base[ref][2], self.mesh_shape, self.coords)

    # the program's outputs ---------------------------------------------------------------------------
    def finish(self) -> Program:
        """Reduce and place the gradients, tidy and schedule both programs, and return the ``Program``."""
        g, res = self.g, self.res
        slots_in = []
        for node in g.nodes:
            key = placeholder_key(g, node) if node.is_placeholder else None
            if key is not None:
                slots_in.append(Slot(key[0], key[1], output_placement(res.strategies[node.name], 0), node.out))
        outs, slots_out = [], []
        if g.training:
            if g.loss is not None:
                full = tuple(B for _ in self.mesh_shape)
                outs.append(self.value(g.loss, full, self.fg))
                slots_out.append(Slot("loss", "loss", full, g.spec(g.loss)))
            for k, r in enumerate(g.extras, 1):  # the model's other outputs, where they were made, in their dtype
                pl = self.base[r][2]
                outs.append(self.value(r, pl, self.fg, g.spec(r).dtype if self._dtype(r) != g.spec(r).dtype else None))
                slots_out.append(Slot("output", str(k), pl, g.spec(r)))
        else:
            for i, r in enumerate(g.outputs):
                if r is None or r in g.mutations.values():
                    continue
                pl = self.base[r][2]
                outs.append(self.value(r, pl, self.fg))
                slots_out.append(Slot("output", str(i), pl, g.spec(r)))
        for fqn, r in sorted(g.mutations.items()):
            pl = output_placement(res.strategies[g.buffers[fqn]], 0)
            where = self.base[r][1]
            if where is not self.fg:
                raise LoweringError(f"buffer {fqn!r} is updated in the backward: autopar cannot lower that yet")
            outs.append(self.value(r, pl, self.fg))
            slots_out.append(Slot("mutation", fqn, pl, g.spec(r)))
        grads, grad_slots = [], []
        bucketed = bucketed_grads(self) if g.training else {}
        for fqn, r in sorted(g.grads.items()):
            grads.append(self._grad(fqn, bucketed))
            grad_slots.append(Slot("grad", fqn, output_placement(res.strategies[g.params[fqn]], 0), g.spec(r)))
        self.fg.output(tuple(outs) + tuple(self.saved))
        forward = fx.GraphModule(self.root, self.fg, "forward")
        backward = None
        if g.training:
            self.bg.output(tuple(grads))
            # placeholders must come first: saved values were added as they were needed
            _hoist_placeholders(self.bg)
            backward = fx.GraphModule(self.root, self.bg, "backward")
        for gm in (forward, backward):
            if gm is not None:
                drop_identities(gm.graph)
                if gm is backward:
                    pack_as_made(gm.graph)
                    pack_when_ready(gm.graph)
                schedule(gm.graph)
                if gm is backward:
                    mark_recomputation(gm.graph)
                gm.graph.lint()
                gm.recompile()
        return Program(self.coords, self.mesh_shape, tuple(res.mesh.names), forward, slots_in, slots_out,
                       len(self.saved), backward, grad_slots, self.random)


def _fill_inputs(plain: PlainCall, ins: Sequence[fx.Node]) -> tuple[tuple, dict]:
    """``plain``'s arguments with its ``Input`` placeholders replaced by the op node's inputs."""
    from autopar._torch_compat import tree_map

    put = (lambda a: ins[a.k] if isinstance(a, Input) else a)
    return tuple(tree_map(put, list(plain.args))), dict(tree_map(put, dict(plain.kwargs)))


def _hoist_placeholders(graph: fx.Graph) -> None:
    """Move every placeholder before the first other node, keeping their order; the tangent last."""
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    tangent = [n for n in phs if n.name.startswith("tangent")]
    order = [n for n in phs if n not in tangent] + tangent
    anchor = None
    for n in order:
        if anchor is None:
            next(iter(graph.nodes)).prepend(n)
        else:
            anchor.append(n)
        anchor = n


def lower(res: Resolved, coords: Sequence[int], device: Optional[torch.device] = None,
          precision: str = "model") -> Program:
    """The program of the device at ``coords`` (row-major over the mesh), computing at ``precision``:
    "model" (every tensor in its captured dtype), "fp32"/"fp64" (the same), or a mixed or 16-bit
    precision, whose casts ``cost_model.casting`` decides."""
    if len(coords) != len(res.mesh.shape):
        raise LoweringError(f"coordinates {tuple(coords)} do not match the mesh {res.mesh.shape}")
    em = Emitter(res, coords, device, precision)
    em.emit()
    return em.finish()


__all__ = ["lower"]
