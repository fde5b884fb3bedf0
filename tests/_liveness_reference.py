"""The liveness walk of ``cost_model.liveness`` written plainly, op by op over the whole graph with
tuple moments and a per-moment sweep: the reference its fast path (``step_peak``) must equal, peak
for peak (``tests/test_liveness_fast.py``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable, Mapping, Optional

from autopar.cost_model.buckets import grad_buckets, grad_steps
from autopar.cost_model.liveness import PEAK_KINDS, Peak, _block_bytes, _moves, optimizer_scratch
from autopar.cost_model.liveness_program import issue_times
from autopar.cost_model.memory import local_numel
from autopar.cost_model.precision import Precision, element_bytes
from autopar.cost_model.ring import ring_inflight_bytes
from autopar.ir.graph import Graph, Phase, Ref, Role
from autopar.ir.placement import local_shape
from autopar.ir.rules import op_call
from autopar.ir.rules.ring import ring_axis
from autopar.ir.views import ALIASES, param_views


class _Walk:
    """Storages with their first and last moment and kind; moments are (time, order) pairs."""

    def __init__(self) -> None:
        self.start: dict = {}
        self.end: dict = {}
        self.size: dict = {}
        self.kind: dict = {}

    def make(self, key, t, nbytes: int, kind: Optional[str] = None) -> None:
        if key in self.start or nbytes <= 0:
            return
        self.start[key], self.end[key], self.size[key] = t, t, nbytes
        if kind is not None:
            self.kind[key] = kind

    def use(self, key, t) -> None:
        if key in self.end and t > self.end[key]:
            self.end[key] = t


def reference_peak(graph: Graph, strategy_of: Callable[[str], tuple], mesh, precision: Precision, *,
              recomputed: Iterable[str] = (), served: Iterable[tuple] = (),
              grad_stages: Optional[Mapping[str, frozenset]] = None) -> Peak:
    """The peak of one step of ``graph`` with every node running ``strategy_of(name)`` (see the
    module's docstring). ``recomputed``: the forward ops the backward runs again; ``served``: the
    ``(parameter view ref, placements)`` the backward reads from the forward's kept gathers (a
    mapping to the ``(ref, placements)`` of the forward gather that serves each)."""
    redo = frozenset(recomputed)
    kept = dict(served) if isinstance(served, Mapping) else {k: k for k in served}
    nodes = graph.nodes
    order = {n.name: i for i, n in enumerate(nodes)}
    views = param_views(graph)
    shape = tuple(mesh.shape)
    training = graph.training
    ws = _Walk()
    sizes: dict = {}

    def out_place(r: Ref):
        return tuple(s.outputs[r.index] for s in strategy_of(r.node))

    def in_place(name: str, k: int):
        return tuple(s.inputs[k] for s in strategy_of(name))

    def nbytes(r: Ref, place, role: str = "activation") -> int:
        key = (r, place, role)
        if key not in sizes:
            spec = graph.spec(r)
            sizes[key] = _block_bytes(tuple(spec.shape), spec.dtype, place, shape, role, precision)
        return sizes[key]

    # the moments: every graph node at its index; a re-run op just before its first backward reader
    back = [n for n in nodes if n.phase == Phase.BACKWARD and not n.is_placeholder] if training else []
    first_back = order[back[0].name] if back else len(nodes)
    end = (len(nodes), 1 << 30)  # the backward's return (its buckets reduce before, ``_grads``)
    reruns = _rerun_times(graph, redo, order) if training else {}
    execs = [((order[n.name], 0), n, False) for n in nodes if not n.is_placeholder]
    execs += [((t, -1), graph.node(name), True) for name, t in reruns.items()]
    execs.sort(key=lambda e: (e[0], order[e[1].name]))
    issue = issue_times(nodes, order, first_back)

    static = {"params": 0, "optimizer": 0}
    float_numel = 0
    storage: dict = {}  # ref -> its storage key (forward values; and the inputs)
    again: dict = {}  # ref -> its storage key, made again in the backward (recomputed)
    for n in nodes:
        if not n.is_placeholder or n.outputs[0] is None:
            continue
        r = Ref(n.name, 0)
        place = out_place(r)
        if n.name in graph.params.values() or n.roles[0] == Role.BUFFER:
            spec = graph.spec(r)
            numel = local_numel(spec.shape, place, shape)
            role = "param" if n.roles[0] != Role.BUFFER else "activation"
            static["params"] += numel * element_bytes(spec.dtype, role, precision)
            if training and n.roles[0] != Role.BUFFER and spec.dtype.is_floating_point:
                static["optimizer"] += numel * precision.optimizer_bytes
                float_numel += numel
            storage[r] = None  # always alive
        elif n.roles[0] == Role.TANGENT:
            storage[r] = None
        else:  # an input: the caller holds it through the step
            storage[r] = ("v", r)
            ws.make(("v", r), (0, 0), nbytes(r, place), None)
            ws.use(("v", r), end)

    reshards: dict = {}  # (ref, placements, "f"|"b") -> key of the resharded copy
    for t, n, rerun in execs:
        backward = rerun or n.phase == Phase.BACKWARD
        table = again if rerun else storage
        read_keys = []
        for k, r in enumerate(n.inputs):
            want = in_place(n.name, k)
            have = out_place(r)
            src = again.get(r, storage.get(r)) if backward and r in again else storage.get(r)
            if r.node in views and want != have:  # a parameter gather
                phase = "b" if backward else "f"
                key = ("g", r, want, phase)
                if backward and (r, want) in kept:  # the forward's kept gathered block serves it
                    key = ("g",) + tuple(kept[(r, want)]) + ("f",)
                if key not in ws.start:
                    at = min(issue.get((n.name, phase), t), t) if not rerun else t
                    size = nbytes(r, want)
                    ws.make(key, t, size, None)  # cut out of the flat buffer at its first reader
                    ws.make(("gf",) + key[1:], at, size, "temporaries")  # the flat buffer, in flight until then
                    ws.use(("gf",) + key[1:], t)
                ws.use(key, t)
                read_keys.append(key)
                continue
            if want == have:
                if src is not None:
                    ws.use(src, t)
                read_keys.append(src)
                continue
            # an activation resharded: once per placement and phase; the forward's copy is saved
            fkey = (r, want, "f")
            if backward and fkey in reshards and r not in again and not rerun:
                key = reshards[fkey]
            else:
                key = ("r", r, want, "b" if backward else "f", rerun)
                reshards.setdefault((r, want, "b" if backward else "f"), key)
                if key not in ws.start:
                    size = nbytes(r, want)
                    ws.make(key, t, size, None)
                    if _moves(have, want):  # the collective's own output, copied out for the readers
                        ws.make(("c",) + key, t, size, "temporaries")
                if src is not None:
                    ws.use(src, t)
            ws.use(key, t)
            read_keys.append(key)
        if ring_axis(strategy_of(n.name)) is not None:  # the blocks in flight while the op runs
            zero = (0,) * len(shape)
            ws.make(("ring", n.name, rerun), t, ring_inflight_bytes(
                op_call(graph, n), [local_shape(graph.spec(r).shape, in_place(n.name, k), shape, zero)
                                    for k, r in enumerate(n.inputs)], precision), "temporaries")
            ws.use(("ring", n.name, rerun), t)
        for j, spec in enumerate(n.outputs):
            if spec is None:
                continue
            r = Ref(n.name, j)
            if n.op in ALIASES and n.inputs:
                table[r] = read_keys[0]  # a view: its base's storage
                continue
            key = ("rc" if rerun else "v", r)
            table[r] = key
            ws.make(key, t, nbytes(r, out_place(r)), "activations" if rerun else None)
            ws.use(key, t)

    if training:
        # the runtime holds what the forward saved until the backward returns (the autograd
        # function's context and the simulator's list keep it): saved values live to the end
        for key, t0 in list(ws.start.items()):
            if t0 < (first_back, -1) <= ws.end[key] and ws.kind.get(key) is None:
                ws.use(key, end)
    if training and graph.loss is not None:
        ws.use(storage.get(graph.loss), end)
    if training:  # the model's other outputs (``Graph.extras``) live until the step returns them
        for r in graph.extras:
            ws.use(storage.get(r), end)
    if not training:
        for r in graph.outputs:
            if r is not None:
                ws.use(storage.get(r), end)
    grads_total = _grads(graph, ws, storage, out_place, nbytes, mesh, precision, grad_stages, end) if training else 0

    # the sweep: bytes by kind at every moment
    times = sorted(set(ws.start.values()) | set(ws.end.values()))
    index = {t: i for i, t in enumerate(times)}
    delta = defaultdict(lambda: [0] * (len(times) + 1))
    for key, t0 in ws.start.items():
        kind = ws.kind.get(key) or ("activations" if t0 < (first_back, -1) <= ws.end[key] else "temporaries")
        d = delta[kind]
        d[index[t0]] += ws.size[key]
        d[index[ws.end[key]] + 1] -= ws.size[key]
    base = static["params"] + static["optimizer"]
    best, best_at, running = -1, 0, {k: 0 for k in delta}
    totals = []
    for i in range(len(times)):
        for k, d in delta.items():
            running[k] += d[i]
        total = base + sum(running.values())
        totals.append(dict(running))
        if total > best:
            best, best_at = total, i
    parts = {k: 0 for k in PEAK_KINDS}
    parts["params"], parts["optimizer"] = static["params"], static["optimizer"]
    if times:
        for k, v in totals[best_at].items():
            parts[k] += v
    else:
        best = base
    t = times[best_at] if times else end
    at = nodes[t[0]].name if t[0] < len(nodes) else ""
    phase = "backward" if training and t[0] >= first_back else "forward"
    peak = Peak(int(best), parts, phase, at)
    if training:  # the optimizer step: the state, the reduced gradients, and its scratch
        scratch = optimizer_scratch(float_numel, precision)
        after = static["params"] + static["optimizer"] + grads_total + scratch
        if after > peak.peak:
            peak = Peak(after, {"params": static["params"], "grads": grads_total, "optimizer": static["optimizer"],
                                "activations": 0, "temporaries": scratch}, "optimizer step", "")
    return peak


def _rerun_times(graph: Graph, redo: frozenset, order: dict) -> dict:
    """The moment each recomputed op runs again: just before the first backward op (or re-run op)
    that reads what it makes; ops nothing in the backward reads are not run again."""
    readers: dict[str, list[str]] = defaultdict(list)
    for n in graph.nodes:
        for r in n.inputs:
            if r.node in redo:
                readers[r.node].append(n.name)
    out: dict[str, int] = {}
    for name in sorted(redo, key=lambda x: -order[x]):
        ts = [order[m] for m in readers.get(name, ()) if graph.node(m).phase == Phase.BACKWARD]
        ts += [out[m] for m in readers.get(name, ()) if m in out]
        if ts:
            out[name] = min(ts)
    return out


def _grads(graph: Graph, ws: _Walk, storage: dict, out_place, nbytes, mesh, precision, stages, end) -> int:
    """Every gradient's reduction (see the module's docstring); the reduced gradients' bytes."""
    steps, src_of, dst_of = {}, {}, {}
    for fqn, r in graph.grads.items():
        src, dst = out_place(r), out_place(Ref(graph.params[fqn], 0))
        src_of[fqn], dst_of[fqn] = src, dst
        if src != dst:
            steps[fqn] = grad_steps(graph, fqn, src, dst, mesh, precision)
    buckets: dict[int, list[str]] = defaultdict(list)
    for fqn, b in grad_buckets(graph, steps, stages).items():
        buckets[b].append(fqn)
    alone = [f for f in steps if not any(f in m and len(m) > 1 for m in buckets.values())]
    total = 0
    for fqn, r in graph.grads.items():
        key = storage.get(r)
        if fqn not in steps:  # no reduction: the backward's own value is the gradient
            if key is not None:
                ws.kind[key] = "grads"
                ws.use(key, end)
            total += nbytes(r, dst_of[fqn], "grad")
    for fqn in alone:  # held by its collective to the end of the backward
        r = graph.grads[fqn]
        ws.use(storage.get(r), end)
        size = nbytes(r, dst_of[fqn], "grad")
        ws.make(("grad", fqn), ws.start.get(storage.get(r), end), size, "grads")
        ws.use(("grad", fqn), end)
        total += size
    for b, fqns in buckets.items():
        if len(fqns) < 2:
            continue
        keys = [storage.get(graph.grads[f]) for f in fqns]
        made = [ws.start.get(k, end) for k in keys]
        last = max(made)
        packed = sum(nbytes(graph.grads[f], src_of[f], "grad") for f in fqns)
        size = sum(nbytes(graph.grads[f], dst_of[f], "grad") for f in fqns)
        if all(st.kind == "all_reduce" for st in steps[fqns[0]]):
            # packed as each is made into a buffer reduced in place: the gradients are its views
            ws.make(("grad", b), min(made), packed, "grads")
            ws.use(("grad", b), end)
            total += packed
            continue
        else:  # concatenated and reduced after the backward's ops, one bucket after another
            last = (end[0], 1 + b)
            for k in keys:
                ws.use(k, last)
            ws.make(("cat", b), last, packed, "temporaries")
        ws.make(("grad", b), last, size, "grads")
        ws.use(("grad", b), end)
        total += size
    return total
