"""A repeated layer stack walked once: the liveness walk (``cost_model.liveness.step_peak``) of a deep
stack at the cost of a shallow one, with the same result as the walk of every op.

In the walk's program order the forward runs the layer instances one after another and the backward
in reverse. Where instances ``tau - 1 .. hi + 1`` are *shifts* of one another (below), the walk of
the middle instances ``lo = tau + 1 .. hi`` (the *window*, ``n`` of them) is instance ``tau``'s
walk moved in time:

- the *short program* is the program without the window's ops (forward and backward), where
  instance ``hi + 1`` reads instance ``tau``'s values in place of ``hi``'s, and ``tau`` reads
  ``hi + 1``'s in place of ``lo``'s (the backward's gradient stream); it is the program of the same
  stack with ``n`` fewer instances, and its gathers are issued and its recomputed ops run again by
  the same rules (``liveness_program.issue_times``, ``rerun_times``) on its own order;
- its walk gives every storage of the full walk (``Expanded``): those owned by instances outside
  the window (keyed by their values) with their moments moved past the removed ops, and those
  instance ``tau`` owns once per instance ``tau .. hi``, copy ``d`` with its forward moments
  ``d * P`` ops later and its backward moments ``(n - d) * Q`` ops later than ``tau``'s own (``P``,
  ``Q``: ops per instance and phase); the moments after the backward's ops stay at the end.

*Shifts* (``stack``, once per graph): instance ``k + 1``'s nodes are instance ``k``'s node by node
(op, outputs, phase; ``ir.layers``' agreement), each instance's forward and backward ops are
contiguous with ``k + 1``'s forward ``P`` ops later and its backward ``Q`` ops earlier, every input
is the shifted input (inside the stack: the same position in the instance one further; outside it:
the same value), read only from the instance itself or its neighbours, no node outside the stack
reads the instance, and the gathers are issued at the shifted moment. Per walk (``window``): the
instances run the same strategies (``alike.representative``: equal representatives, equal
strategies), recompute the same positions and read the same kept gathers. Where any of it fails, or
a storage's moments lie outside the instances the proof covers (``Aperiodic`` while expanding), the
walk is the walk of every op.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Optional

import numpy as np

from autopar.cost_model.liveness_program import W, Program, at, first_backward, issue_times
from autopar.ir.graph import Graph, Phase, Ref
from autopar.ir.layers import layers

#: the fewest instances worth a window (fewer: the walk of every op)
MIN_WINDOW = 2
#: short programs kept per graph (each nearly the program's size; a recomputation sweep moves the window)
SHORTS_KEPT = 4


class Aperiodic(Exception):
    """A storage of the short program's walk that the window's proof does not cover."""


@dataclass
class Stack:
    """A graph's layer stack as the walk sees it (``prefix``'s instances, ``ir.layers``)."""

    inst: list  # instance k -> its node names in order
    pos: dict  # node name -> (instance, position)
    ok: list  # ok[k]: instance k + 1 is instance k shifted (see the module's docstring)
    touched: set  # instances a node outside the stack reads (or the loss or an output is of)
    fwd: list  # instance k -> the index of its first forward op
    bwd: list  # instance k -> the index of its first backward op (-1 without a backward)
    P: int  # forward ops per instance
    Q: int  # backward ops per instance
    outs: list  # instance k -> per position, its outputs' ``((output index, ref code), ...)``
    grads: list  # per gradient (``Program.grads``' order): (FQN, ref code, its node's (instance, position) or None)
    folded: dict = field(default_factory=dict)  # id(alike) -> (alike, per pair: equal representatives)


def stack(graph: Graph, prog: Program) -> Optional[Stack]:
    """The graph's largest agreeing layer stack and which of its neighbouring instances are shifts
    of each other, once per graph (None without one)."""
    if "stack" not in prog.periodic:
        prog.periodic["stack"] = _stack(graph, prog)
    return prog.periodic["stack"]


def _stack(graph: Graph, prog: Program) -> Optional[Stack]:
    lay = layers(graph)
    if not lay.alike:
        return None
    prefix = max(lay.alike, key=lambda p: (len(lay.alike[p]), p))
    count = 1 + max(i for p, i in lay.instances if p == prefix)
    inst = [lay.instances.get((prefix, k), ()) for k in range(count)]
    pos = {name: (k, j) for k, names in enumerate(inst) for j, name in enumerate(names)}
    order, nodes, ops = prog.order, graph.nodes, prog.ops
    starts = _op_starts(prog)
    fwd, bwd, parts = [], [], []  # parts: per instance (its placeholders' outputs, forward ops, backward ops)
    for names in inst:
        held = [x for x in names if nodes[order[x]].is_placeholder]
        f = [order[x] for x in names if nodes[order[x]].phase == Phase.FORWARD and not nodes[order[x]].is_placeholder]
        b = [order[x] for x in names if nodes[order[x]].phase == Phase.BACKWARD and not nodes[order[x]].is_placeholder]
        fwd.append(min(f) if f else -1)
        bwd.append(min(b) if b else -1)
        got = None
        if f and all(max(xs) - min(xs) + 1 == len(xs) for xs in (f, b) if xs):
            fo, bo = _slice(ops, starts, f), _slice(ops, starts, b)
            if [op[1].name for op in fo + bo] == list(names[len(held):]):  # graph order: the positions
                got = ([prog.code[Ref(x, 0)] if nodes[order[x]].outputs[0] is not None else None for x in held],
                       fo, bo)
        parts.append(got)
    P, Q = (len(parts[0][1]), len(parts[0][2])) if parts and parts[0] else (0, 0)
    owner: dict = {}  # ref code -> the instance that makes it
    for k, got in enumerate(parts):
        if got is not None:
            owner.update((rc, k) for rc in got[0] if rc is not None)
            owner.update((rc, k) for op in got[1] + got[2] for _, rc in op[4])
    alike = set(lay.alike[prefix])
    ok = [k in alike and k + 1 in alike and parts[k] is not None and parts[k + 1] is not None
          and (len(parts[k][1]), len(parts[k][2])) == (len(parts[k + 1][1]), len(parts[k + 1][2])) == (P, Q)
          and len(parts[k][0]) == len(parts[k + 1][0]) and P > 0
          and (prefix, k) not in lay.positions and (prefix, k + 1) not in lay.positions
          and fwd[k + 1] == fwd[k] + P and (Q == 0 or bwd[k] == bwd[k + 1] + Q)
          for k in range(count - 1)]
    nxt: dict = {}  # ref code of instance k -> the same position's of instance k + 1 (where ``ok[k]``)
    for k in range(count - 1):
        if ok[k]:
            a, b = parts[k], parts[k + 1]
            nxt.update((x, y) for x, y in zip(a[0], b[0]) if x is not None)
            for oa, ob in zip(a[1] + a[2], b[1] + b[2]):
                if len(oa[4]) != len(ob[4]) or oa[1].op != ob[1].op:
                    ok[k] = False
                    break
                nxt.update((x, y) for (_, x), (_, y) in zip(oa[4], ob[4]))
    for k in range(count - 1):
        if ok[k]:
            ok[k] = _shifted(graph, prog, parts[k], parts[k + 1], k, owner, nxt, P, Q)
    touched: set = set()
    for op in ops:
        if op[1].name not in pos:
            touched.update(owner[rc] for _, rc, _ in op[3] if rc in owner)
    ends = [graph.loss] + list(graph.extras) + list(graph.outputs if not graph.training else [])
    touched.update(pos[r.node][0] for r in ends if r is not None and r.node in pos)
    outs = [None if got is None else [((0, rc),) if rc is not None else () for rc in got[0]]
            + [op[4] for op in got[1] + got[2]] for got in parts]
    grads = [(fqn, rc, pos.get(prog.refs[rc].node)) for fqn, rc, _ in prog.grads]
    return Stack(inst, pos, ok, touched, fwd, bwd, P, Q, outs, grads)


def _op_starts(prog: Program) -> list:
    """The node index of each op of ``prog`` (ops are in node order), once per program."""
    if "starts" not in prog.periodic:
        prog.periodic["starts"] = [op[0] for op in prog.ops]
    return prog.periodic["starts"]


def _slice(ops: list, starts: list, indices: list) -> list:
    """The ops at the contiguous node indices ``indices``."""
    if not indices:
        return []
    i = bisect_left(starts, min(indices))
    return ops[i:i + len(indices)]


def _shifted(graph: Graph, prog: Program, a: tuple, b: tuple, k: int, owner: dict, nxt: dict, P: int, Q: int) -> bool:
    """Whether instance ``k + 1`` (``b``: its placeholders' output codes, forward and backward ops) is
    instance ``k`` (``a``) shifted (see the module's docstring); ``owner``: ref code -> instance,
    ``nxt``: ref code -> the next instance's at its position."""
    params = prog.periodic.setdefault("params", frozenset(graph.params.values()))
    for x, y in zip(a[0], b[0]):  # the placeholders: their bytes are counted once per instance
        if (x is None) != (y is None):
            return False
        if x is not None:
            na, nb = graph.node(prog.refs[x].node), graph.node(prog.refs[y].node)
            if (graph.spec(prog.refs[x]) != graph.spec(prog.refs[y]) or na.roles != nb.roles
                    or (na.name in params) != (nb.name in params)):
                return False
    issue = prog.issue
    for oa, ob in zip(a[1] + a[2], b[1] + b[2]):
        ins_a, ins_b = oa[3], ob[3]
        if len(ins_a) != len(ins_b) or oa[2] != ob[2] or oa[5] != ob[5]:
            return False
        gathers = False
        for (_, x, va), (_, y, vb) in zip(ins_a, ins_b):
            if va != vb:
                return False
            gathers = gathers or va
            at_ = owner.get(x)
            if at_ is None:
                if y != x:
                    return False
            elif abs(at_ - k) > 1 or nxt.get(x) != y:
                return False
        if gathers:  # gathered at the shifted moment
            ph, step = ("b", -Q) if oa[2] else ("f", P)
            ia, ib = issue.get((oa[1].name, ph)), issue.get((ob[1].name, ph))
            if ia is None or ib is None or ib - ia != step * W:
                return False
    return True


@dataclass
class Window:
    """Instances ``lo .. hi`` walked as copies of instance ``tau = lo - 1`` (the module's docstring)."""

    st: Stack
    tau: int
    hi: int
    prog: Program  # the short program
    like: dict  # a window instance's gradient FQN -> instance tau's at its position

    @property
    def n(self) -> int:
        return self.hi - self.tau

    def weight(self, name: str) -> int:
        """How many instances a placeholder of the short program stands for: ``tau``'s, ``n + 1``; a
        window instance's, none (0); any other, itself (1)."""
        at_ = self.st.pos.get(name)
        if at_ is None:
            return 1
        k = at_[0]
        return self.n + 1 if k == self.tau else 0 if self.tau < k <= self.hi else 1


def window(graph: Graph, prog: Program, alike, redo: frozenset, served) -> Optional[Window]:
    """The window for one walk (strategies by ``alike``, recomputation ``redo``, kept gathers
    ``served``), or None where no run of instances is long enough."""
    st = stack(graph, prog)
    if st is None or alike is None:
        return None
    got = st.folded.get(id(alike))
    if got is None or got[0] is not alike:
        rep = alike.representative
        reps = [[rep(x) for x in names] for names in st.inst]
        got = st.folded[id(alike)] = (alike, [ok and reps[k] == reps[k + 1] for k, ok in enumerate(st.ok)])
    same = list(got[1])
    sig: dict = defaultdict(set)
    for name in redo:
        at_ = st.pos.get(name)
        if at_ is not None:
            sig[at_[0]].add(at_[1])
    pairs = served.items() if isinstance(served, Mapping) else ((s, s) for s in served)
    for (r, want), (src, placed) in pairs:
        at_r, at_s = st.pos.get(r.node), st.pos.get(src.node)
        if at_r is None and at_s is None:
            continue
        if at_r is None or at_s is None or at_r[0] != at_s[0]:
            return None
        sig[at_r[0]].add((at_r[1], r.index, tuple(want), at_s[1], src.index, tuple(placed)))
    best, x = (0, 0), None
    for k in range(len(same) + 1):
        good = k < len(same) and same[k] and sig.get(k) == sig.get(k + 1) \
            and k not in st.touched and k + 1 not in st.touched
        if good and x is None:
            x = k
        elif not good and x is not None:
            best, x = max(best, (k - x, x)), None
    span, x = best  # instances x .. x + span, each a shift of the one before
    if span - 2 < MIN_WINDOW:
        return None
    tau, hi = x + 1, x + span - 1
    key = ("short", tau, hi)
    if key not in prog.periodic:
        fqn_at = {(at_, prog.refs[rc].index): fqn for fqn, rc, at_ in st.grads if at_ is not None}
        like = {fqn: fqn_at.get(((tau, at_[1]), prog.refs[rc].index)) for fqn, rc, at_ in st.grads
                if at_ is not None and tau < at_[0] <= hi}
        try:
            prog.periodic[key] = (_short(graph, prog, st, tau, hi), {k: v for k, v in like.items() if v is not None})
        except Aperiodic:
            prog.periodic[key] = None
        held = [k for k, v in prog.periodic.items() if isinstance(k, tuple) and k[0] == "short" and v is not None]
        for old in held[:-SHORTS_KEPT]:  # the oldest made again if asked for again
            del prog.periodic[old]
    return Window(st, tau, hi, *prog.periodic[key]) if prog.periodic[key] is not None else None


def forget(prog: Program, win: Window) -> None:
    """No window ``win.tau .. win.hi`` on this graph from now on: its expansion met a storage its
    proof does not cover (``Aperiodic``), as it would again."""
    prog.periodic[("short", win.tau, win.hi)] = None


def _short(graph: Graph, prog: Program, st: Stack, tau: int, hi: int) -> Program:
    """The short program of window ``tau + 1 .. hi`` (the module's docstring)."""
    n, P, Q = hi - tau, st.P, st.Q
    f0, f1 = st.fwd[tau + 1], st.fwd[tau + 1] + n * P
    b0, b1 = (st.bwd[hi], st.bwd[hi] + n * Q) if Q else (f1, f1)
    every = graph.nodes
    nodes = every[:f0] + every[f1:b0] + every[b1:]
    order = {m.name: i for i, m in enumerate(nodes)}
    code, refs, inst, pos = prog.code, prog.refs, st.inst, st.pos
    starts = _op_starts(prog)
    cuts = [bisect_left(starts, x) for x in (f0, f1, b0, b1)]
    kept = prog.ops[:cuts[0]] + prog.ops[cuts[1]:cuts[2]] + prog.ops[cuts[3]:]

    def moved(i: int) -> int:
        return i if i < f0 else i - n * P if i < b0 else i - n * (P + Q)

    ops, readers = [], defaultdict(list)
    for i, m, back, ins, outs, alias in kept:
        new = []
        for k, rc, is_view in ins:
            r = refs[rc]
            at_ = pos.get(r.node)
            if at_ is not None and tau < at_[0] <= hi:  # a window value: its stand-in
                to = tau if at_[0] == hi else hi + 1 if at_[0] == tau + 1 else None
                if to is None:  # (the shifts say not)
                    raise Aperiodic("a read across the window")
                r = Ref(inst[to][at_[1]], r.index)
                rc = code[r]
            readers[r.node].append(m.name)
            new.append((k, rc, is_view))
        ops.append((moved(i), m, back, tuple(new), outs, alias))
    first_back = first_backward(nodes, graph.training)
    issue = {k: at(*v) for k, v in issue_times(nodes, order, first_back).items()}
    return Program(order, first_back, prog.views, ops, issue, dict(readers), code, refs, sizes=prog.sizes,
                   length=len(nodes), placeholders=prog.placeholders)


@dataclass
class Expanded:
    """The full walk's storages from the short program's: ``start``, ``last``, ``size``, ``kinds``
    and ``storage`` (keyed as the walk keys them; the window's gradients' storages too, which the
    reduction of gradients reads and ends), and the other copies of instance ``tau``'s as arrays
    (``s``, ``e``, ``nb`` and ``kind``: 0 activations, 1 temporaries)."""

    start: dict
    last: dict
    size: dict
    kinds: dict
    storage: dict
    s: np.ndarray
    e: np.ndarray
    nb: np.ndarray
    kind: np.ndarray


def expand(win: Window, graph: Graph, prog: Program, walk: tuple, storage: dict, saved_from: int) -> Expanded:
    """The full walk's storages from the short program's walk ``walk`` (``(start, last, size,
    kinds)``, moments of the short program; ``saved_from``: its backward's first moment) and its
    ``storage`` (ref code -> key). Raises ``Aperiodic`` where a storage lies outside the proof."""
    start, last, size, kinds = walk
    st, sp, refs, pos = win.st, win.prog, prog.refs, win.st.pos
    tau, hi, n, P, Q = win.tau, win.hi, win.n, st.P, st.Q
    f0 = st.fwd[tau + 1]  # the short program's index of hi + 1's forward (tau's ends there)
    fb, length = sp.first_back, sp.length
    bt = st.bwd[tau] - n * (P + Q) if Q else length  # the short program's index of tau's backward
    lo_f, hi_f = f0 - 2 * P, f0 + P  # tau's copies: forward moments within tau - 1 .. hi + 1
    lo_b, hi_b = bt - Q, bt + 2 * Q  # backward within hi + 1 .. tau - 1
    far = n * (P + Q)

    def owner(key) -> Optional[int]:
        tag = key[0]
        name = key[1] if tag == "ring" else refs[key[2] if tag == "c" else key[1]].node
        got = pos.get(name)
        return None if got is None else got[0]

    def outer(i: int) -> int:  # the full index of a short program index, for storages outside the window
        return i if i < f0 else i + n * P if i < bt else i + far

    def early(i: int) -> int:  # an instance's before tau: never between hi + 1's forward and tau's backward
        if f0 <= i < bt:
            raise Aperiodic(i)
        return outer(i)

    def late(i: int) -> int:  # an instance's after hi + 1: only there, or at the end
        if i < f0 or bt <= i < length:
            raise Aperiodic(i)
        return outer(i)

    def after(i: int) -> int:  # hi + 1's: its forward and its backward's reads stand after the window's
        if i >= length:
            return i + far
        if i < lo_f + P or bt + Q <= i:
            raise Aperiodic(i)
        return i + n * P

    grads = {storage.get(rc) for _, rc, _ in st.grads}
    mine_g: list = []
    mine: list = []
    full_start, full_last = {}, {}
    for key, t0 in start.items():
        k = owner(key)
        if k == tau:
            (mine_g if key in grads else mine).append(key)
            continue
        move = outer if k is None else after if k == hi + 1 else early if k < tau else late
        t1 = last[key]
        full_start[key] = move(t0 // W) * W + t0 % W
        full_last[key] = move(t1 // W) * W + t1 % W

    def region(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per short-program index of tau's storages: (shift of copy 0, shift per copy), in ops."""
        fw, bw, end = idx < fb, (fb <= idx) & (idx < length), idx >= length
        if np.any(fw & ((idx < lo_f) | (idx >= hi_f))) or np.any(bw & ((idx < lo_b) | (idx >= hi_b))):
            raise Aperiodic("a storage of the template instance outside its neighbours")
        base = np.where(fw, 0, far)
        per = np.where(fw, P, np.where(bw, -Q, 0))
        return base, per * (~end)

    copies = np.arange(n + 1, dtype=np.int64)[:, None]

    def moments(ts: list) -> np.ndarray:
        t = np.asarray(ts, dtype=np.int64)
        base, per = region(t // W)
        return t[None, :] + (base[None, :] + copies * per[None, :]) * W

    s = moments([start[k] for k in mine])
    e = moments([last[k] for k in mine])
    nb = np.tile(np.asarray([size[k] for k in mine], dtype=np.int64), n + 1)
    crossing = [0 if (start[k] < saved_from <= last[k]) else 1 for k in mine]
    kind = np.tile(np.asarray([{"activations": 0, "temporaries": 1}.get(kinds.get(k), c) if k in kinds else c
                               for k, c in zip(mine, crossing)], dtype=np.int64), n + 1)
    if any(k in kinds and kinds[k] not in ("activations", "temporaries") for k in mine):
        raise Aperiodic("a storage of another kind")
    out_kinds = {k: v for k, v in kinds.items() if owner(k) != tau}
    out_size = {k: size[k] for k in full_start}
    if mine_g:  # the gradients' storages: each copy a storage of its own (the reduction ends them)
        gs, ge = moments([start[k] for k in mine_g]), moments([last[k] for k in mine_g])
        for d in range(n + 1):
            for j, key in enumerate(mine_g):
                new = _renamed(key, d, st, prog)
                full_start[new], full_last[new], out_size[new] = int(gs[d, j]), int(ge[d, j]), size[key]
                if key in kinds:
                    out_kinds[new] = kinds[key]
    full_storage = dict(storage)
    for fqn, rc, at_ in st.grads:
        if at_ is None or not tau < at_[0] <= hi:
            if at_ is None or at_[0] != tau:  # another's gradient in tau's storage: not a copy
                key = storage.get(rc)
                if key is not None and owner(key) == tau:
                    raise Aperiodic(fqn)
            continue
        src = storage.get(_out(st, tau, at_[1], refs[rc].index))
        if src is not None and src not in mine_g:
            raise Aperiodic(fqn)
        full_storage[rc] = None if src is None else _renamed(src, at_[0] - tau, st, prog)
    return Expanded(full_start, full_last, out_size, out_kinds, full_storage, s.ravel(), e.ravel(), nb, kind)


def _renamed(key: tuple, d: int, st: Stack, prog: Program) -> tuple:
    """Storage ``key`` of instance ``tau``'s, for the instance ``d`` further (its refs moved)."""
    if d == 0:
        return key
    if key[0] == "ring":  # (no value's storage)
        raise Aperiodic(key)
    i = 2 if key[0] == "c" else 1
    r = prog.refs[key[i]]
    k, j = st.pos[r.node]
    return key[:i] + (_out(st, k + d, j, r.index),) + key[i + 1:]


def _out(st: Stack, k: int, j: int, index: int) -> int:
    """The ref code of output ``index`` of instance ``k``'s node at position ``j``."""
    for i, rc in st.outs[k][j]:
        if i == index:
            return rc
    raise Aperiodic((k, j, index))


__all__ = ["Aperiodic", "Expanded", "Stack", "Window", "expand", "forget", "stack", "window"]
