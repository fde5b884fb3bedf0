"""The step's memory peak as the program runs it: a liveness walk of one chosen plan.

``step_peak`` walks the forward and the backward op by op, in the order the lowering emits them,
on the device that holds the largest blocks (coordinates 0), and keeps every storage alive from the
op that makes it to its last reader:

- an op's output (a view op makes none: it keeps its base alive), whether saved for the backward
  (``activations``: made in the forward, read in the backward) or not (``temporaries``: logits-sized
  buffers of the loss, an attention's workspace outputs, values between ops);
- a resharded copy, from its first reader to its last, saved with the forward when the backward
  reads it at that placement (as the lowering does), and at the collective a second buffer of its
  size in flight (the collective's output before the copy its readers take);
- a gathered parameter: the flat buffer its group gathers into from its issue (a layer ahead of
  its layer, or the start of the phase for one outside the layers, as ``passes/lower/schedule``
  issues it) to its first reader, where it is cut into each parameter's block, which lives to its
  last reader in that phase; a gather a layer keeps for the backward (``served``) lives on into it;
- a checkpointed op (``recomputed``) made again in the backward where it is first needed;
- gradients: unreduced from the op that makes them until their bucket is reduced
  (``cost_model.buckets``: an all-reduce bucket packs each as it is made into one buffer, reduced
  in place, whose views the gradients are; a reduce-scatter bucket concatenates its gradients after
  the backward's ops, one bucket after another; a gradient
  reduced alone is held by its collective to the end of the backward), reduced (``grads``) to the
  end of the step;
- the parameters, buffers and optimizer state for the whole step; the inputs the caller holds.

After the backward comes the optimizer step: parameters, gradients, optimizer state and its
scratch. ``optimizer_scratch`` says what that scratch is assumed to be.
The peak is the larger of the two; ``Peak`` says what it consists of and where it is.

Given the folding (``alike``), a repeated layer stack is walked once: the walk of a short program
without the middle instances, whose storages are then those of every op's walk
(``liveness_periodic``); elsewhere, and wherever its proof fails, every op is walked.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional

import numpy as np

from autopar.cost_model import liveness_periodic as periodic
from autopar.cost_model.buckets import grad_buckets, grad_steps
from autopar.cost_model.liveness_program import LAST, W, at, program, rerun_times
from autopar.cost_model.memory import local_numel
from autopar.cost_model.precision import Precision, element_bytes
from autopar.cost_model.ring import ring_inflight_bytes
from autopar.ir.graph import Graph, Ref, Role
from autopar.ir.placement import B, local_shape
from autopar.ir.rules import op_call
from autopar.ir.rules.ring import ring_axis

#: What a step's peak is split into (``plan.memory``'s keys besides ``peak`` figures).
PEAK_KINDS = ("params", "grads", "optimizer", "activations", "temporaries")
#: the walk's own kind for gradients waiting for their reduction: temporaries in ``Peak.parts``, not
#: in ``Peak.between``
UNREDUCED = "unreduced"


@dataclass
class Peak:
    """The largest bytes alive at once on a device in one training (or inference) step."""

    peak: int
    #: bytes by kind (``PEAK_KINDS``) alive at the peak
    parts: dict[str, int] = field(default_factory=dict)
    #: "forward", "backward" or "optimizer step"
    phase: str = "forward"
    #: the graph node running at the peak ("" in the optimizer step)
    at: str = ""
    #: the most bytes of temporaries alive at any moment of the step, besides the gradients that wait
    #: for their reduction after the backward (what a pipeline stage holds as its accumulators); not
    #: the peak's own (``tests/_liveness_reference.py`` walks the peak alone)
    between: int = field(default=0, compare=False)


def optimizer_scratch(numel: int, precision: Precision) -> int:
    """Bytes the optimizer step allocates besides its state, for ``numel`` local parameter elements.

    Assumed: ``torch.optim.AdamW``/``Adam`` with ``foreach`` (torch's default for parameters on an
    accelerator), whose step makes one new tensor per parameter, ``exp_avg_sq.sqrt()``
    (``_foreach_sqrt``), for every parameter of a dtype group at once, then updates in place: one
    moment's bytes per element. The other updates (``lerp_``, ``addcmul_``, ``addcdiv_``, the decoupled
    weight decay) run in place. On CPU torch steps one parameter at a time (two blocks of one
    parameter at once), which this bounds from above. SGD (with or without momentum) updates in
    place: nothing."""
    if precision.optimizer not in ("adam", "adamw"):
        return 0
    return numel * (precision.optimizer_bytes // 2)


def step_peak(graph: Graph, strategy_of: Callable[[str], tuple], mesh, precision: Precision, *,
              recomputed: Iterable[str] = (), served: Iterable[tuple] = (),
              grad_stages: Optional[Mapping[str, frozenset]] = None, alike=None) -> Peak:
    """The peak of one step of ``graph`` with every node running ``strategy_of(name)`` (see the
    module's docstring). ``recomputed``: the forward ops the backward runs again; ``served``: the
    ``(parameter view ref, placements)`` the backward reads from the forward's kept gathers (a
    mapping to the ``(ref, placements)`` of the forward gather that serves each). ``alike``: a
    ``Folding`` (anything with ``representative(name)``) whose nodes of equal representatives run
    equal strategies: with it a repeated layer stack is walked once (``liveness_periodic``).

    Refs and placements are int codes in the walk (placements interned by value, so equal codes are
    equal placements), moments ints (``liveness_program.at``), the sweep over the moments in numpy."""
    prog = program(graph)
    redo = frozenset(recomputed)
    served = served if isinstance(served, Mapping) else tuple(served)  # (read by the window and the walk)
    win = periodic.window(graph, prog, alike, redo, served) if alike is not None else None
    if win is not None:
        try:
            return _walk(graph, prog, strategy_of, mesh, precision, redo, served, grad_stages, win)
        except periodic.Aperiodic:
            periodic.forget(prog, win)  # (not tried again on this graph: the walk of every op is exact)
    return _walk(graph, prog, strategy_of, mesh, precision, redo, served, grad_stages, None)


def _walk(graph: Graph, prog, strategy_of, mesh, precision: Precision, redo: frozenset, served, grad_stages,
          win: Optional[periodic.Window]) -> Peak:
    """``step_peak``'s walk: of every op (``win`` None), or of ``win``'s short program expanded."""
    run = win.prog if win is not None else prog  # the program walked
    nodes, code, refs = graph.nodes, prog.code, prog.refs
    shape = tuple(mesh.shape)
    training = graph.training
    first_back = prog.first_back
    end = at(run.length, LAST)  # the backward's return (its buckets reduce before, ``_grads``)
    saved_from = at(run.first_back, -1)

    strats: dict = {}  # node name -> its strategy (held: ids below stay theirs during the walk)
    # placement codes and block bytes are the same in every walk on this mesh and precision: shared
    places, interned, sizes = prog.sizes.setdefault((shape, precision), ([], {}, {}))
    by_id: dict = {}  # (id(strategy), "i"|"o", position) -> placement code

    def strat(name: str):
        got = strats.get(name)
        if got is None:
            got = strats[name] = strategy_of(name)
        return got

    def intern(place: tuple) -> int:
        got = interned.get(place)
        if got is None:
            got = interned[place] = len(places)
            places.append(place)
        return got

    def in_code(st, k: int) -> int:
        key = (id(st), "i", k)
        got = by_id.get(key)
        if got is None:
            got = by_id[key] = intern(tuple(s.inputs[k] for s in st))
        return got

    out_codes: dict = {}  # ref code -> placement code of its producer's output

    def out_code(rc: int) -> int:
        got = out_codes.get(rc)
        if got is None:
            r = refs[rc]
            st = strat(r.node)
            key = (id(st), "o", r.index)
            got = by_id.get(key)
            if got is None:
                got = by_id[key] = intern(tuple(s.outputs[r.index] for s in st))
            out_codes[rc] = got
        return got

    in_codes: dict = {}  # id(strategy) -> its inputs' placement codes (``in_code`` of every position)

    def in_codes_of(st, count: int) -> list:
        got = in_codes.get(id(st))
        if got is None or len(got) < count:
            got = in_codes[id(st)] = [in_code(st, k) for k in range(count)]
        return got

    def nbytes(rc: int, pc: int, role: str = "activation") -> int:
        key = (rc, pc, role)
        got = sizes.get(key)
        if got is None:
            spec = graph.spec(refs[rc])
            got = sizes[key] = _block_bytes(tuple(spec.shape), spec.dtype, places[pc], shape, role, precision)
        return got

    moves: dict = {}
    rings: dict = {}
    start: dict = {}  # storage key -> its first moment
    last: dict = {}  # storage key -> its last moment
    size: dict = {}
    kinds: dict = {}

    def make(key, t: int, nb: int, kind: Optional[str] = None) -> None:
        if key in start or nb <= 0:
            return
        start[key] = last[key] = t
        size[key] = nb
        if kind is not None:
            kinds[key] = kind

    kept = {}
    for k, v in (served.items() if isinstance(served, Mapping) else ((k, k) for k in served)):
        (r, want), (src, placed) = k, v
        kept[(_code(code, refs, r), intern(tuple(want)))] = (_code(code, refs, src), intern(tuple(placed)))

    # the moments: every op at its index; a re-run op just before its first backward reader
    execs = [(at(i), op, False) for op in run.ops for i in (op[0],)]
    if training and redo:
        mine = redo if win is None else frozenset(x for x in redo if x in run.order)
        reruns = rerun_times(graph, mine, run.order, run.reader_names())
        if reruns:
            byname = {op[1].name: op for op in run.ops}
            execs += [(at(t, -1), byname[name], True) for name, t in reruns.items()]
            execs.sort(key=lambda e: (e[0], e[1][0]))

    static = {"params": 0, "optimizer": 0}
    float_numel = 0
    storage: dict = {}  # ref code -> its storage key (forward values; and the inputs)
    again: dict = {}  # ref code -> its storage key, made again in the backward (recomputed)
    param_nodes = set(graph.params.values())
    for n, rc in prog.placeholders:
        times = win.weight(n.name) if win is not None else 1  # (a window's are copies of tau's)
        if not times:
            continue
        r = Ref(n.name, 0)
        pc = out_code(rc)
        if n.name in param_nodes or n.roles[0] == Role.BUFFER:
            spec = graph.spec(r)
            numel = local_numel(spec.shape, places[pc], shape) * times
            role = "param" if n.roles[0] != Role.BUFFER else "activation"
            static["params"] += numel * element_bytes(spec.dtype, role, precision)
            if training and n.roles[0] != Role.BUFFER and spec.dtype.is_floating_point:
                static["optimizer"] += numel * precision.optimizer_bytes
                float_numel += numel
            storage[rc] = None  # always alive
        elif n.roles[0] == Role.TANGENT:
            storage[rc] = None
        else:  # an input: the caller holds it through the step
            storage[rc] = ("v", rc)
            make(("v", rc), at(0), nbytes(rc, pc), None)
            if ("v", rc) in last and end > last[("v", rc)]:
                last[("v", rc)] = end

    reshards: dict = {}  # (ref, placements, "f"|"b") -> key of the resharded copy
    issue = run.issue
    for t, (_, n, in_back, ins, outs, alias), rerun in execs:
        name = n.name
        backward = rerun or in_back
        table = again if rerun else storage
        st = strats.get(name)
        if st is None:
            st = strat(name)
        wants = in_codes_of(st, len(ins))
        read_keys = []
        for k, rc, is_view in ins:
            want = wants[k]
            have = out_codes.get(rc)
            if have is None:
                have = out_code(rc)
            src = again[rc] if backward and rc in again else storage.get(rc)
            if is_view and want != have:  # a parameter gather
                phase = "b" if backward else "f"
                key = ("g", rc, want, phase)
                if backward and (rc, want) in kept:  # the forward's kept gathered block serves it
                    key = ("g",) + kept[(rc, want)] + ("f",)
                if key not in start:
                    issued = min(issue.get((name, phase), t), t) if not rerun else t
                    nb = nbytes(rc, want)
                    make(key, t, nb, None)  # cut out of the flat buffer at its first reader
                    flat = ("gf",) + key[1:]
                    make(flat, issued, nb, "temporaries")  # the flat buffer, in flight until then
                    if flat in last and t > last[flat]:
                        last[flat] = t
            elif want == have:
                if src is not None and t > last.get(src, t):
                    last[src] = t
                read_keys.append(src)
                continue
            else:  # an activation resharded: once per placement and phase; the forward's copy is saved
                fkey = (rc, want, "f")
                if backward and fkey in reshards and rc not in again and not rerun:
                    key = reshards[fkey]
                else:
                    ph = "b" if backward else "f"
                    key = ("r", rc, want, ph, rerun)
                    reshards.setdefault((rc, want, ph), key)
                    if key not in start:
                        nb = nbytes(rc, want)
                        make(key, t, nb, None)
                        mv = moves.get((have, want))
                        if mv is None:
                            mv = moves[(have, want)] = _moves(places[have], places[want])
                        if mv:  # the collective's own output, copied out for the readers
                            make(("c",) + key, t, nb, "temporaries")
                    if src is not None and src in last and t > last[src]:
                        last[src] = t
            if key in last and t > last[key]:
                last[key] = t
            read_keys.append(key)
        ring = rings.get(id(st))
        if ring is None:
            ring = rings[id(st)] = ring_axis(st) is not None
        if ring:  # the blocks in flight while the op runs
            zero = (0,) * len(shape)
            make(("ring", name, rerun), t, ring_inflight_bytes(
                op_call(graph, n), [local_shape(graph.spec(r).shape, places[in_code(st, k)], shape, zero)
                                    for k, r in enumerate(n.inputs)], precision), "temporaries")
        for j, rc in outs:
            if alias:
                table[rc] = read_keys[0]  # a view: its base's storage
                continue
            key = ("rc" if rerun else "v", rc)
            table[rc] = key
            oc = out_codes.get(rc)
            nb = sizes.get((rc, oc, "activation")) if oc is not None else None
            if nb is None:
                nb = nbytes(rc, out_code(rc))
            make(key, t, nb, "activations" if rerun else None)

    def use(key, t: int) -> None:
        if key in last and t > last[key]:
            last[key] = t

    if training:
        # the runtime holds what the forward saved until the backward returns (the autograd
        # function's context and the simulator's list keep it): saved values live to the end
        for key, t0 in start.items():
            if t0 < saved_from <= last[key] and key not in kinds:
                last[key] = end
    extra = None
    if win is not None:  # the full walk's storages, from the short program's
        full = periodic.expand(win, graph, prog, (start, last, size, kinds), storage, saved_from)
        start, last, size, kinds, storage = full.start, full.last, full.size, full.kinds, full.storage
        extra = (full.s, full.e, full.nb, full.kind)
        end, saved_from = at(prog.length, LAST), at(first_back, -1)
    if training and graph.loss is not None:
        use(storage.get(code.get(graph.loss)), end)
    if training:  # the model's other outputs (``Graph.extras``) live until the step returns them
        for r in graph.extras:
            use(storage.get(code.get(r)), end)
    if not training:
        for r in graph.outputs:
            if r is not None:
                use(storage.get(code.get(r)), end)
    walk = (start, last, size, kinds, make, use)
    grads_total = _grads(graph, walk, storage, prog.grads, places, out_code, nbytes, mesh, precision, grad_stages,
                         end, win.like if win is not None else {}) if training else 0

    base = static["params"] + static["optimizer"]
    parts = {k: 0 for k in PEAK_KINDS}
    parts["params"], parts["optimizer"] = static["params"], static["optimizer"]
    between = 0
    if start or extra is not None:
        best, best_at, found, between = _sweep(start, last, size, kinds, saved_from, base, extra)
        for k, v in found.items():
            parts["temporaries" if k == UNREDUCED else k] += v
    else:
        best, best_at = base, end
    time = best_at // W
    where = nodes[time].name if time < len(nodes) else ""
    phase = "backward" if training and time >= first_back else "forward"
    peak = Peak(int(best), parts, phase, where, between)
    if training:  # the optimizer step: the state, the reduced gradients, and its scratch
        scratch = optimizer_scratch(float_numel, precision)
        after = static["params"] + static["optimizer"] + grads_total + scratch
        if after > peak.peak:
            peak = Peak(after, {"params": static["params"], "grads": grads_total, "optimizer": static["optimizer"],
                                "activations": 0, "temporaries": scratch}, "optimizer step", "", between)
    return peak


def _code(code: dict, refs: list, r: Ref) -> int:
    got = code.get(r)
    if got is None:
        got = code[r] = len(refs)
        refs.append(r)
    return got


def _sweep(start: dict, last: dict, size: dict, kinds: dict, saved_from: int, base: int, extra=None):
    """The bytes by kind alive at every moment: ``(the largest total, its moment, its bytes by kind, the
    most temporaries at any moment)``; the first moment of the largest. A storage with no kind is an
    activation when it lives from the forward into the backward, else a temporary. ``extra``: more
    storages as arrays ``(start, last, bytes, kind: 0 activations, 1 temporaries)``."""
    keys = list(start)
    s = np.fromiter(start.values(), dtype=np.int64, count=len(keys))
    e = np.fromiter((last[k] for k in keys), dtype=np.int64, count=len(keys))
    nb = np.fromiter((size[k] for k in keys), dtype=np.int64, count=len(keys))
    names = ["activations", "temporaries"] + sorted({v for v in kinds.values()} - {"activations", "temporaries"})
    ids = {k: i for i, k in enumerate(names)}
    kind = np.where((s < saved_from) & (saved_from <= e), 0, 1)
    for i, k in enumerate(keys):
        got = kinds.get(k)
        if got is not None:
            kind[i] = ids[got]
    if extra is not None:
        s, e, nb, kind = (np.concatenate([a, b]) for a, b in zip((s, e, nb, kind), extra))
    times = np.unique(np.concatenate([s, e]))
    delta = np.zeros((len(names), len(times) + 1), dtype=np.int64)
    np.add.at(delta, (kind, np.searchsorted(times, s)), nb)
    np.add.at(delta, (kind, np.searchsorted(times, e) + 1), -nb)
    running = np.cumsum(delta[:, :-1], axis=1)
    best_at = int(np.argmax(running.sum(axis=0)))
    present = set(kind.tolist())
    found = {names[i]: int(running[i, best_at]) for i in range(len(names)) if i in present}
    return base + int(running[:, best_at].sum()), int(times[best_at]), found, int(running[1].max())


@functools.lru_cache(maxsize=1 << 16)
def _block_bytes(shape: tuple, dtype, place: tuple, mesh_shape: tuple, role: str, precision: Precision) -> int:
    """Bytes of the largest local block (alike layers share their shapes: cached across walks)."""
    return local_numel(shape, place, mesh_shape) * element_bytes(dtype, role, precision)


def _moves(have, want) -> bool:
    """Whether resharding ``have`` to ``want`` runs a collective (not only local slicing)."""
    return any(a != b and not (a == B) for a, b in zip(have, want))


def _grads(graph: Graph, walk: tuple, storage: dict, grads: list, places: list, out_code, nbytes, mesh,
           precision, stages, end: int, like: Mapping[str, str]) -> int:
    """Every gradient's reduction (see the module's docstring); the reduced gradients' bytes. ``walk``:
    the walk's ``(start, last, size, kinds, make, use)``; refs and placements by their codes (``grads``:
    ``Program.grads``); ``like``: a gradient FQN -> one whose placements are its own (a window's)."""
    start, _, _, kinds, make, use = walk
    steps, src_of, dst_of, refs = {}, {}, {}, {}
    for fqn, rc, pc in grads:
        refs[fqn] = rc
        base = like.get(fqn)  # a window's gradient: its template's placements and steps
        if base is not None and base in src_of:
            src_of[fqn], dst_of[fqn] = src_of[base], dst_of[base]
            if base in steps:
                steps[fqn] = steps[base]
            continue
        src, dst = out_code(rc), out_code(pc)
        src_of[fqn], dst_of[fqn] = src, dst
        if src != dst:
            steps[fqn] = grad_steps(graph, fqn, places[src], places[dst], mesh, precision)
    buckets: dict[int, list[str]] = defaultdict(list)
    for fqn, b in grad_buckets(graph, steps, stages).items():
        buckets[b].append(fqn)
    shared = {f for m in buckets.values() if len(m) > 1 for f in m}
    alone = [f for f in steps if f not in shared]
    total = 0
    for fqn, rc in refs.items():
        key = storage.get(rc)
        if fqn not in steps:  # no reduction: the backward's own value is the gradient
            if key is not None:
                kinds[key] = "grads"
                use(key, end)
            total += nbytes(rc, dst_of[fqn], "grad")
    for fqn in alone:  # held by its collective to the end of the backward
        rc = refs[fqn]
        use(storage.get(rc), end)
        if storage.get(rc) is not None:
            kinds.setdefault(storage[rc], UNREDUCED)
        size = nbytes(rc, dst_of[fqn], "grad")
        make(("grad", fqn), start.get(storage.get(rc), end), size, "grads")
        use(("grad", fqn), end)
        total += size
    for b, fqns in buckets.items():
        if len(fqns) < 2:
            continue
        keys = [storage.get(refs[f]) for f in fqns]
        made = [start.get(k, end) for k in keys]
        packed = sum(nbytes(refs[f], src_of[f], "grad") for f in fqns)
        size = sum(nbytes(refs[f], dst_of[f], "grad") for f in fqns)
        if all(st.kind == "all_reduce" for st in steps[fqns[0]]):
            # packed as each is made into a buffer reduced in place: the gradients are its views
            make(("grad", b), min(made), packed, "grads")
            use(("grad", b), end)
            total += packed
            continue
        # concatenated and reduced after the backward's ops, one bucket after another
        last = end - LAST + 1 + b  # (the end's time, 1 + b)
        for k in keys:
            use(k, last)
            if k is not None:
                kinds.setdefault(k, UNREDUCED)
        make(("cat", b), last, packed, "temporaries")
        make(("grad", b), last, size, "grads")
        use(("grad", b), end)
        total += size
    return total


__all__ = ["PEAK_KINDS", "Peak", "optimizer_scratch", "step_peak"]
