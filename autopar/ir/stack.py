"""Stacked capture: a deep stack of alike layers captured at a few layers, replicated to full depth.

Tracing is linear in depth and most of a plan's time on a deep model, while every layer of a stack
(a ``ModuleList``, ``ModuleDict`` or ``Sequential`` of one module class, walked in ``forward``)
traces to the same nodes. So ``capture`` traces shallow copies of the model that keep the first
``PROBE`` and ``PROBE + 1`` layers (the same modules: the user's model is never touched), and
builds the full-depth fx graph from the first by repeating its layer 1: forward and backward ops,
parameter placeholders and gradient outputs, each copy wired to its neighbours, its module paths,
parameter names, autograd sequence numbers and fx node names those a full trace gives layer
``1 + c``. fx names a node ``op_N`` with a counter per op name, in trace order, so every name and
sequence number moves by a fixed step per layer; the second trace measures the step of each.

The proof, before any of it is used (otherwise the full trace runs, and a ``UserWarning`` says
why): layers 1 to the last have one structure (parameters, buffers, submodules, plain settings
such as ``sliding_window``; layer 0 is traced, so it may differ); layers 1 and 2 of the shallow
capture agree node by node by the fold's agreement rule (``ir.layers``, ``ir.agreement``; where the
last of ``PROBE`` layers differs, ``PROBE + 1`` and ``PROBE + 2`` are traced instead); and the
graph built with one added layer is the deeper trace's, node for node (names, ops, arguments,
outputs, roles, phases, module paths, the order of sequence numbers, the graph's tables). Layers
that differ by index (alternating attention kinds, a MoE's first dense layers, per-layer shapes)
fail it; a forward that treats layers by index beyond the probes' depth is not seen.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.fx.node import map_arg

from autopar import _torch_compat as tc
from autopar._torch_compat.graph_module import lazy_graph_module
from autopar._torch_compat.nn import submodule_table, with_submodules
from autopar.errors import CaptureError
from autopar.ir.graph import Graph
from autopar.ir.layers import layers

__all__ = ["MIN_DEPTH", "PROBE", "Stack", "capture_stacked", "find_stack"]

#: the depth of the shallow capture that is replicated (layer 1 is repeated; 2 checks it agrees)
PROBE = 3
#: stacks shallower than this are traced in full (replicating saves too little)
MIN_DEPTH = 6

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
#: fx's names with a counter, and where it is (the last group)
_NAMES = ((re.compile(r"^_tensor_constant(\d+)$"), "_tensor_constant{}"), (re.compile(r"^arg(\d+)_1$"), "arg{}_1"),
          (re.compile(r"^(.*)_(\d+)$"), "{}_{}"))


@dataclass(frozen=True)
class Stack:
    """The layer stack of a model: the container's module path and its children's keys, in order."""

    path: str
    keys: tuple[str, ...]

    @property
    def depth(self) -> int:
        """How many layers the stack has."""
        return len(self.keys)


class _NoStack(Exception):
    """Why a stacked capture cannot stand for the full one (the warning's text)."""


def find_stack(model: torch.nn.Module) -> tuple[Optional[Stack], str]:
    """The model's largest layer stack (at least ``MIN_DEPTH`` children numbered 0, 1, ..., most of
    them blocks of one class) and, where it cannot be replicated, why (else ``""``); ``(None, "")``
    without one."""
    best: Optional[tuple[int, str, torch.nn.Module]] = None
    for path, mod in model.named_modules():
        if not isinstance(mod, _CONTAINERS) or len(mod) < MIN_DEPTH:
            continue
        children = list(mod.named_children())
        if [k for k, _ in children] != [str(i) for i in range(len(mod))]:
            continue
        kinds = Counter(type(c) for _, c in children)
        kind, count = kinds.most_common(1)[0]
        if 2 * count <= len(children) or not any(True for c in children if type(c[1]) is kind and any(c[1].children())):
            continue  # not a stack of blocks (a Sequential of linears and activations, say)
        size = sum(p.numel() for p in mod.parameters())
        if size and (best is None or size > best[0]):
            best = (size, path, mod)
    if best is None:
        return None, ""
    _, path, mod = best
    stack = Stack(path, tuple(k for k, _ in mod.named_children()))
    return stack, _structure_differs(model, stack, mod)


def _structure_differs(model: torch.nn.Module, stack: Stack, mod: torch.nn.Module) -> str:
    """Why the layers cannot be replicated from one another (``""`` when they can): the parameters,
    buffers or submodules of layers 1 to the last differ in name, shape, dtype or trainability (layer
    0 is traced whatever it holds), a tensor is shared between layers, or a layer is also reachable
    outside the stack."""
    def structure(layer: torch.nn.Module) -> tuple:
        return (tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()),
                tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers()),
                tuple((n, type(m).__name__) for n, m in layer.named_modules()))

    where = f"{stack.path!r}" if stack.path else "the model's top level"
    children = dict(mod.named_children())
    kind = Counter(type(c) for c in children.values()).most_common(1)[0][0]
    odd = [k for k in stack.keys[1:] if type(children[k]) is not kind]
    if odd:
        return (f"layer(s) {', '.join(odd[:4])} of {where} are {type(children[odd[0]]).__name__}, the others "
                f"{kind.__name__}")
    first = structure(children["1"])  # layer 0 may differ (it is traced, as are layers 1 and 2)
    seen: set[int] = set()
    for key in stack.keys:
        layer = children[key]
        if key != "0" and structure(layer) != first:
            return f"layer {key} of {where} has other parameters, buffers or submodules than layer 1"
        tensors = {id(t) for t in list(layer.parameters()) + list(layer.buffers())}
        if tensors & seen:
            return f"layers of {where} share a parameter or buffer"
        seen |= tensors
    settings = [_settings(children[k]) for k in stack.keys[1:]]
    for name in sorted(set().union(*settings)):
        values = [got.get(name, _NoStack) for got in settings]
        if all(v == values[0] for v in values):
            continue
        if all(type(v) is int for v in values) and len({v - i for i, v in enumerate(values)}) == 1:
            continue  # the layer's index (``layer_idx``), which only names it
        key = stack.keys[1 + next(i for i, v in enumerate(values) if v != values[0])]
        return f"layer {key} of {where} is set otherwise than layer 1 ({name})"
    inside, ids = (f"{stack.path}." if stack.path else ""), {id(c) for c in children.values()}
    for path, m in model.named_modules(remove_duplicate=False):
        if id(m) in ids and not (path.startswith(inside) and path[len(inside):].isdigit()):
            return f"layer module {path!r} of {where} is also reachable outside the stack"
    return ""


def _settings(layer: torch.nn.Module) -> dict[str, object]:
    """A layer's plain settings by path, on every submodule: bool, int, float, str, None and tuples
    of them (``self_attn.sliding_window``, ``training``, ``layer_idx``)."""
    plain = (bool, int, float, str, type(None))
    out: dict[str, object] = {}
    for path, mod in layer.named_modules():
        for name, value in vars(mod).items():
            if not name.startswith("_") and (isinstance(value, plain) or (
                    isinstance(value, tuple) and all(isinstance(v, plain) for v in value))):
                out[f"{path}.{name}" if path else name] = value
    return out


def shallow(model: torch.nn.Module, stack: Stack, count: int) -> torch.nn.Module:
    """A shallow copy of ``model`` whose stack holds its first ``count`` layers (the same module
    objects; the modules on the path to the stack are copied, nothing else)."""
    parts = stack.path.split(".") if stack.path else []

    def rebuild(mod: torch.nn.Module, depth: int) -> torch.nn.Module:
        table = submodule_table(mod)
        if depth == len(parts):
            return with_submodules(mod, {k: table[k] for k in stack.keys[:count]})
        return with_submodules(mod, {**table, parts[depth]: rebuild(table[parts[depth]], depth + 1)})

    return rebuild(model, 0)


def capture_stacked(model: torch.nn.Module, capture_one: Callable[[torch.nn.Module], Graph],
                    finish: Callable[[torch.fx.GraphModule, Graph, bool], Graph]) -> Optional[Graph]:
    """The full-depth Graph of ``model`` built from shallow captures, or None where the model has no
    stack deep enough or the proof fails (with a ``UserWarning`` naming why). ``capture_one`` traces
    a model; ``finish(gm, like, full)`` lifts a built fx graph as ``like`` was lifted, with the full
    model's checks (its parameters' gradients, its warnings) when ``full``."""
    stack, why = find_stack(model)
    if stack is None:
        return None
    with warnings.catch_warnings(record=True) as said:  # the probes' own: said again on success only
        warnings.simplefilter("always")
        try:
            if why:
                raise _NoStack(why)
            graph = _replicated(model, stack, capture_one, finish)
        except _NoStack as e:
            graph, why = None, str(e)
    if graph is None:
        warnings.warn(f"capture: the {stack.depth} layers of {stack.path or 'the model'!r} are traced one by one, "
                      f"not replicated from a few: {why}", stacklevel=3)
        return None
    for w in said:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return graph


def _replicated(model: torch.nn.Module, stack: Stack, capture_one: Callable[[torch.nn.Module], Graph],
                finish: Callable[[torch.fx.GraphModule, Graph, bool], Graph]) -> Graph:
    """``capture_stacked``'s proof and build; raises ``_NoStack`` where the proof fails."""
    def traced(count: int) -> Graph:
        try:
            return capture_one(shallow(model, stack, count))
        except CaptureError as e:  # the full trace says it again if it is not the shallow copy's doing
            raise _NoStack(f"the {count}-layer trace failed ({str(e).splitlines()[0][:200]})") from e

    probe, check = traced(PROBE), traced(PROBE + 1)
    try:
        rep = _Replicator(probe, stack.path, PROBE)
    except _NoStack:  # the last of PROBE layers may differ from the middle ones: one layer more
        probe, check = check, traced(PROBE + 2)
        rep = _Replicator(probe, stack.path, PROBE + 1)
    rep.measure(check)
    differs = _difference(finish(rep.build(1), probe, False), check)
    if differs:
        raise _NoStack(f"one more layer built from layer 1 is not what tracing it gives ({differs})")
    return finish(rep.build(stack.depth - rep.depth), probe, True)


# ---------------------------------------------------------------------------------------------
# Building the deeper graph


def _number(name: str) -> tuple[str, int]:
    """fx's name of a node as a pattern and the counter in it: ``"mm_7"`` -> ``("mm_{}", 7)``,
    ``"mm"`` -> ``("mm_{}", 0)``, ``"_tensor_constant3"`` -> ``("_tensor_constant{}", 3)``, an
    inference graph's input ``"arg12_1"`` -> ``("arg{}_1", 12)``."""
    for pattern, template in _NAMES:
        m = pattern.match(name)
        if m:
            return template.format(*m.groups()[:-1], "{}"), int(m.groups()[-1])
    return name + "_{}", 0


def _named(template: str, num: int) -> str:
    return template[:-3] if num == 0 and template.endswith("_{}") else template.format(num)


def _phase_of(n: torch.fx.Node) -> bool:
    return n.meta.get("partitioner_tag") == "is_backward"


class _Replicator:
    """Layer 1 of a shallow capture, repeated ``k`` more times (``build``), with the per-layer
    steps of every name and sequence number measured on a capture one layer deeper (``measure``)."""

    def __init__(self, probe: Graph, prefix: str, depth: int):
        self.prefix, self.depth = prefix, depth
        #: per node: name counter, sequence number, their steps per added layer and to the copy (``measure``)
        self.steps: dict[torch.fx.Node, tuple[int, ...]] = {}
        found = layers(probe)
        keys = [(prefix, i) for i in range(depth)]
        if any(k not in found.instances for k in keys):
            raise _NoStack("the shallow capture does not show every layer as a layer of the graph")
        if not {1, 2} <= set(found.alike.get(prefix, ())) or (prefix, 1) in found.positions \
                or (prefix, 2) in found.positions:
            raise _NoStack("layers 1 and 2 of the shallow capture do not agree node by node")
        assert probe.gm is not None
        self.gm = probe.gm
        self.nodes = [n for n in probe.gm.graph.nodes if n.op != "output"]
        self.out = next(n for n in probe.gm.graph.nodes if n.op == "output")
        owner = {name: k[1] for name, k in found.owner.items() if k[0] == prefix}
        self.owner: dict[torch.fx.Node, int] = {}
        for n in self.nodes:
            src = n.args[0] if n.op == "call_function" and n.target is operator.getitem else n
            if src.name in owner:
                self.owner[n] = owner[src.name]
        if any(n.op == "get_attr" and n.target != n.name for n in self.nodes):
            raise _NoStack("a tensor constant of the trace is not named as its node")
        # instances 1 and 2 agree position by position: each node's counterpart in the other
        by_name = {n.name: n for n in self.nodes}
        getitems = {(n.args[0], n.args[1]): n for n in self.nodes if n.op == "call_function"
                    and n.target is operator.getitem}
        self.twin: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}
        for a, b in zip(found.instances[(prefix, 1)], found.instances[(prefix, 2)]):
            na, nb = by_name[a], by_name[b]
            self.twin[(na, 2)], self.twin[(nb, 1)] = nb, na
            for (src, idx), g in getitems.items():
                if src is na and (nb, idx) in getitems:
                    self.twin[(g, 2)], self.twin[(getitems[(nb, idx)], 1)] = getitems[(nb, idx)], g
            if na.op == "get_attr" and not _same_tensor(getattr(self.gm, na.target), getattr(self.gm, nb.target)):
                raise _NoStack(f"layers 1 and 2 make different tensor constants ({na.name}, {nb.name})")

    # -- order ---------------------------------------------------------------------------------

    def order(self, k: int) -> list[tuple[torch.fx.Node, int]]:
        """The nodes of the deeper graph as ``(node of the probe, copy)``, in graph order: each run
        of layer-1 nodes is followed by its copies 1..k in the forward, preceded by copies k..1 in
        the backward (autograd runs the later layers' backward first)."""
        out: list[tuple[torch.fx.Node, int]] = []
        run: list[torch.fx.Node] = []

        def flush() -> None:
            if not run:
                return
            backward = _phase_of(run[0])
            copies = range(k, 0, -1) if backward else range(1, k + 1)
            done = [(n, c) for c in copies for n in run]
            out.extend(done + [(n, 0) for n in run] if backward else [(n, 0) for n in run] + done)
            run.clear()

        for n in self.nodes:
            if self.owner.get(n) == 1:
                if run and _phase_of(run[0]) != _phase_of(n):
                    flush()
                run.append(n)
            else:
                flush()
                out.append((n, 0))
        flush()
        return out

    # -- steps ---------------------------------------------------------------------------------

    def measure(self, check: Graph) -> None:
        """Per probe node: its name's counter and its sequence number, their steps per added layer
        and (layer 1's nodes) from it to its copy, read off the trace one layer deeper."""
        assert check.gm is not None
        deeper = [n for n in check.gm.graph.nodes if n.op != "output"]
        order = self.order(1)
        if len(deeper) != len(order):
            raise _NoStack(f"one more layer adds {len(deeper) - len(self.nodes)} nodes to the trace, layer 1 has "
                           f"{sum(1 for n in self.nodes if self.owner.get(n) == 1)}")
        got: dict[tuple[torch.fx.Node, int], tuple[int, int]] = {}
        for (n, c), d in zip(order, deeper):
            template, num = _number(d.name)
            if n.op != d.op or template != _number(n.name)[0] or (
                    n.op not in ("placeholder", "get_attr") and n.target != d.target):
                raise _NoStack(f"the deeper trace has {d.name} ({d.target}) where the built graph has {n.name}")
            got[(n, c)] = (num, _seq(d))
        for n in self.nodes:
            (num0, seq0), (num, seq) = (_number(n.name)[1], _seq(n)), got[(n, 0)]
            copy = (got[(n, 1)][0] - num, got[(n, 1)][1] - seq) if (n, 1) in got else (0, 0)
            self.steps[n] = (num0, seq0, num - num0, seq - seq0, *copy)

    # -- build ---------------------------------------------------------------------------------

    def build(self, k: int) -> torch.fx.GraphModule:
        """The fx graph with ``k`` more copies of layer 1 (its nodes named as a trace names them)."""
        graph = torch.fx.Graph()
        constants: dict[str, torch.Tensor] = {}  # tensor constants made in forward, by their new names
        env: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}
        templates = {n: _number(n.name)[0] for n in self.nodes}
        for n, c in self.order(k):
            num0, seq0, dnum, dseq, lnum, lseq = self.steps[n]
            name = _named(templates[n], num0 + k * dnum + c * lnum)
            target = name if n.op in ("placeholder", "get_attr") else n.target
            if n.op == "get_attr":
                constants[name] = getattr(self.gm, n.target)
            # made bare, then wired: create_node's scan of arguments for symbolic values is most of its cost
            new = graph.create_node(n.op, target, name=name, type_expr=n.type)
            if new.name != name:
                raise _NoStack(f"the name {name} of a built node is taken twice")
            if n.args:
                new.args = map_arg(n.args, lambda a: self._input(a, n, c, k, env))
            if n.kwargs:
                new.kwargs = map_arg(n.kwargs, lambda a: self._input(a, n, c, k, env))
            new.meta.update(self._meta(n, c, k, seq0 + k * dseq + c * lseq))
            env[(n, c)] = new
        outs, descs = [], []
        entries = list(zip(self.out.args[0], self.out.meta.get("desc") or [None] * len(self.out.args[0])))
        at = 0
        while at < len(entries):  # layer 1's gradients (a run of them), then each copy's
            end = at + 1
            if self._fqn_layer(entries[at][1]) == 1:
                while end < len(entries) and self._fqn_layer(entries[end][1]) == 1:
                    end += 1
            for c in range(k + 1) if self._fqn_layer(entries[at][1]) == 1 else (0,):
                for v, d in entries[at:end]:
                    outs.append(env[(v, c)] if isinstance(v, torch.fx.Node) else v)
                    descs.append(self._desc(d, c, k))
            at = end
        out = graph.output(tuple(outs))
        out.meta = dict(self.out.meta, desc=descs)
        gm = lazy_graph_module(constants, graph)
        gm.meta.update(self.gm.meta)
        gm.graph.lint()
        return gm

    def _input(self, z: torch.fx.Node, reader: torch.fx.Node, c: int, k: int, env: dict) -> torch.fx.Node:
        """The node copy ``c`` of ``reader`` reads where the probe's reads ``z``: layer-relative."""
        mine, theirs = self.owner.get(reader), self.owner.get(z)
        if theirs is None or k == 0:
            return env[(z, 0)]
        if c == 0:
            if mine == 1 and theirs == 2:  # the backward of layer 1 reads that of the layer after it: copy 1
                return env[(self._twin(z, 1), 1)]
            if mine is not None and mine >= 2 and theirs == 1:  # the old later layers read the last copy
                return env[(z, k)]
            return env[(z, 0)]
        if theirs == 1:
            return env[(z, c)]
        if theirs == 2:
            return env[(z, 0)] if c == k else env[(self._twin(z, 1), c + 1)]
        if theirs == 0:  # what layer 1 reads of layer 0, copy c reads of copy c - 1: as layer 2 reads layer 1
            slot = reader.all_input_nodes.index(z)
            w = self._twin(reader, 2).all_input_nodes[slot]
            if self.owner.get(w) != 1:
                raise _NoStack(f"layer 2's {w.name} is not read from layer 1 as layer 1 reads layer 0")
            return env[(w, c - 1)]
        raise _NoStack(f"layer 1 reads layer {theirs}")

    def _twin(self, n: torch.fx.Node, instance: int) -> torch.fx.Node:
        got = self.twin.get((n, instance))
        if got is None:
            raise _NoStack(f"{n.name} has no counterpart in layer {instance}")
        return got

    # -- renaming ------------------------------------------------------------------------------

    def _split(self, path: Optional[str]) -> Optional[tuple[str, int, str]]:
        """``"layers.3.attn"`` -> ``("layers.", 3, ".attn")``; None outside the stack."""
        head = f"{self.prefix}." if self.prefix else ""
        if path is None or not path.startswith(head):
            return None
        index, dot, rest = path[len(head):].partition(".")
        return (head, int(index), dot + rest) if index.isdigit() else None

    def _path(self, path: str, c: int, k: int) -> str:
        """A module path or FQN of the probe as copy ``c`` of ``k`` has it (layers after 1 move up by ``k``)."""
        got = self._split(path)
        if got is None:
            return path
        head, index, rest = got
        return f"{head}{index + c if c else (index + k if index >= 2 else index)}{rest}"

    def _fqn_layer(self, desc) -> Optional[int]:
        got = self._split(_desc_target(desc))
        return got[1] if got else None

    def _desc(self, desc, c: int, k: int):
        if isinstance(desc, (tc.ParamAOTInput, tc.BufferAOTInput)):
            return dataclasses.replace(desc, target=self._path(desc.target, c, k))
        if isinstance(desc, tc.GradAOTOutput):
            return dataclasses.replace(desc, grad_of=self._desc(desc.grad_of, c, k))
        if isinstance(desc, tc.InputMutationAOTOutput):
            return dataclasses.replace(desc, mutated_input=self._desc(desc.mutated_input, c, k))
        return desc

    def _meta(self, n: torch.fx.Node, c: int, k: int, seq: int) -> dict:
        meta = dict(n.meta)
        custom = meta.get("custom")
        if custom and "autopar_module" in custom:
            meta["custom"] = dict(custom, autopar_module=self._path(custom["autopar_module"], c, k))
        if "seq_nr" in meta:
            meta["seq_nr"] = seq
        if "desc" in meta:
            meta["desc"] = self._desc(meta["desc"], c, k)
        return meta


def _seq(n: torch.fx.Node) -> int:
    """The node's autograd sequence number (-1: none)."""
    s = n.meta.get("seq_nr")
    return int(s) if s is not None else -1


def _desc_target(desc) -> Optional[str]:
    if isinstance(desc, (tc.ParamAOTInput, tc.BufferAOTInput)):
        return desc.target
    if isinstance(desc, tc.GradAOTOutput):
        return _desc_target(desc.grad_of)
    if isinstance(desc, tc.InputMutationAOTOutput):
        return _desc_target(desc.mutated_input)
    return None


# ---------------------------------------------------------------------------------------------
# The check


def _difference(built: Graph, traced: Graph) -> str:
    """The first difference between two graphs, node by node and table by table (``""``: none)."""
    if len(built.nodes) != len(traced.nodes):
        return f"{len(built.nodes)} nodes, not {len(traced.nodes)}"
    ranks = [_seq_ranks(g) for g in (built, traced)]
    for a, b in zip(built.nodes, traced.nodes):
        fa, fb = ((n.name, n.op, repr(n.args), repr(n.kwargs), n.outputs, n.roles, n.phase, n.module_path,
                   rank.get(n.name), n.fx_node.meta.get("is_gradient_acc") if n.fx_node is not None else None)
                  for n, rank in ((a, ranks[0]), (b, ranks[1])))
        if fa != fb:
            what = next(i for i, (x, y) in enumerate(zip(fa, fb)) if x != y)
            return f"node {b.name} ({b.where()}) differs: {fa[what]!r} != {fb[what]!r}"
    for a, b in zip(built.nodes, traced.nodes):
        if a.op == "get_attr" and not _same_tensor(getattr(built.gm, a.target), getattr(traced.gm, b.target)):
            return f"tensor constant {b.name} ({b.module_path}) differs"
    for table in ("params", "buffers", "inputs", "constants", "grads", "loss", "outputs", "extras", "mutations",
                  "hints", "aliases"):
        if getattr(built, table) != getattr(traced, table):
            return f"the graph's {table} differ"
    return ""


def _seq_ranks(graph: Graph) -> dict[str, int]:
    """Each node's autograd sequence number as its rank among the graph's: the numbers themselves
    count on across captures in a process, the order is what passes read (``ir.layers``)."""
    seqs = {n.name: _seq(n.fx_node) for n in graph.nodes if n.fx_node is not None and _seq(n.fx_node) >= 0}
    rank = {s: i for i, s in enumerate(sorted(set(seqs.values())))}
    return {name: rank[s] for name, s in seqs.items()}


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
