"""The backends that run a lowered program's collectives (``program.collectives``), and a recorder.

- ``ProcessGroupComm``: torch's functional collectives on one process group per mesh axis (gloo
  or NCCL); results are ``AsyncCollectiveTensor``s, waited at first use (``wait``).
- ``ThreadComm``: every rank of a mesh is a thread of one process; a collective is an exchange
  through shared slots and barriers (``autopar.simulate``).

``record_collectives`` lists what actually ran, per collective: kind, mesh axis and bytes of the
buffer as the axis group sees it (all-gather: its output; reduce-scatter and all-reduce: the
input; all-to-all: the input times the group size; a point-to-point ``permute``, ring attention's
exchange inside one op: the block sent), the same measure as the cost model's ``step_bytes``. For process groups it intercepts torch's ``_c10d_functional`` ops with a dispatch
mode, so it sees the collectives the program really issued.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional, Sequence

import torch

from autopar import _torch_compat as tc
from autopar.errors import CollectiveError
from autopar.program.collectives import Executed
from autopar.runtime.memory import unobserved

# -- process groups ----------------------------------------------------------------------------

def axis_groups(mesh_ranks: torch.Tensor) -> list[list[list[int]]]:
    """For each mesh axis, every group of ranks along it (the ranks whose coordinates differ in
    that axis only), in an order every rank computes alike."""
    out = []
    for axis in range(mesh_ranks.dim()):
        rows = mesh_ranks.movedim(axis, -1).reshape(-1, mesh_ranks.shape[axis])
        out.append([[int(r) for r in row] for row in rows])
    return out


#: ``single_worker_gloo_groups``' groups per (default group, mesh), reused by later compiles.
_ONE_WORKER_GROUPS: dict = {}


def single_worker_gloo_groups(mesh_ranks: torch.Tensor, rank: int) -> list:
    """This rank's process group on each mesh axis: gloo groups whose backend runs ONE worker
    thread (torch's default is two), made once per mesh layout and default group, and reused.
    Every rank must call it, in the same order (``new_group`` is collective over the world).

    Why: torch 2.13's gloo workers race on the group's status record when two collectives of one
    group finish together, and double-free it (``_torch_compat/gloo.py`` has the account). Programs
    keep several collectives in flight (``passes.lower.schedule``), so this hit long runs within
    minutes. With one worker a group's collectives run one after another, still under compute.
    The groups keep the default group's timeout (``autopar.launch``'s), so a collective a peer
    never joins fails alike."""
    import torch.distributed as dist

    key = (id(dist.group.WORLD), tuple(mesh_ranks.shape), tuple(mesh_ranks.flatten().tolist()))
    known = _ONE_WORKER_GROUPS.get(key)
    if known is not None and all(tc.group_alive(g) for g in known):  # not destroyed since
        return known
    timeout = tc.group_timeout()
    mine = []
    for rank_lists in axis_groups(mesh_ranks):
        made = tc.new_one_worker_gloo_groups(rank_lists, timeout)
        mine.append(next(g for g, ranks in zip(made, rank_lists) if rank in ranks))
    _ONE_WORKER_GROUPS[key] = mine
    return mine


def joint_pairs(program) -> list[tuple[int, ...]]:
    """The tuples of mesh axes a lowered program runs a collective over together, sorted."""
    from autopar.program import collectives as C

    found = set()
    for gm in (program.forward, program.backward):
        for n in () if gm is None else gm.graph.nodes:
            if n.op == "call_function" and n.target in C.COLLECTIVES and isinstance(n.args[1], tuple):
                found.add(n.args[1])
    return sorted(found)


def joint_groups(mesh_ranks: torch.Tensor, rank: int, pairs: Sequence[tuple[int, ...]], gloo: bool) -> dict:
    """This rank's process group over each tuple of mesh axes in ``pairs`` (its ranks numbered
    first axis major, as ``group_rank``): gloo groups of one worker thread (``single_worker_gloo_groups``
    says why), else the default backend's. Every rank must call it with the same ``pairs``, in the
    same order (``new_group`` is collective over the world)."""
    import torch.distributed as dist

    out = {}
    for axes in pairs:
        rest = [d for d in range(mesh_ranks.dim()) if d not in axes]
        rows = mesh_ranks.permute(*rest, *axes).reshape(-1, group_size(mesh_ranks.shape, axes))
        rank_lists = [[int(r) for r in row] for row in rows]
        if any(ranks != sorted(ranks) for ranks in rank_lists):  # new_group numbers a group's ranks ascending
            raise CollectiveError(f"the device mesh's ranks along axes {axes} do not ascend first axis major, "
                                  "so a group over them would not number its ranks as nested splits need")
        made = tc.new_one_worker_gloo_groups(rank_lists, tc.group_timeout()) if gloo else \
            [dist.new_group(ranks) for ranks in rank_lists]
        out[tuple(axes)] = next(g for g, ranks in zip(made, rank_lists) if rank in ranks)
    return out


class ProcessGroupComm:
    """Collectives over one torch process group per mesh axis (this rank's groups): a
    ``program.collectives.Backend``, whose methods it implements with functional collectives."""

    def __init__(self, groups: Sequence, axis_names: Sequence[str], joint: Optional[dict] = None):
        self.groups = list(groups)
        self.axis_names = list(axis_names)
        self.sizes = [g.size() for g in self.groups]
        #: (axis, axis) -> this rank's group over both axes (``joint_groups``), for joint all-to-alls
        self.joint = dict(joint or {})

    def _group(self, axis):
        if not isinstance(axis, tuple):
            return self.groups[axis]
        if axis not in self.joint:
            raise CollectiveError(f"the program runs a collective over mesh axes {axis_label(self.axis_names, axis)} "
                                  "together, but no process group over them was made (runtime.collectives.joint_groups)")
        return self.joint[axis]

    def axis_size(self, axis) -> int:
        return self._group(axis).size() if isinstance(axis, tuple) else self.sizes[axis]

    def all_gather(self, x, axis, dim):
        return tc.functional_all_gather(x.contiguous(), dim, self._group(axis))

    def reduce_scatter(self, x, axis, dim, reduce):
        return tc.functional_reduce_scatter(x.contiguous(), reduce, dim, self._group(axis))

    def all_reduce(self, x, axis, reduce):
        return tc.functional_all_reduce(x.contiguous(), reduce, self._group(axis))

    def all_reduce_(self, x, axis, reduce):
        # a dense buffer is reduced in place; a compiled program reduces functionally (an in-place
        # collective has an aliased output, which AOTAutograd cannot functionalize)
        if not x.is_contiguous() or torch.compiler.is_compiling():
            return self.all_reduce(x, axis, reduce)
        return tc.functional_all_reduce_(x, reduce, self._group(axis))  # waited like the others' results

    def all_to_all(self, x, axis):
        return tc.functional_all_to_all(x, self._group(axis))

    def permute(self, x, axis, dest):
        # one all-to-all whose only non-empty pieces are the block to dest[me] and the one from its source
        me, n = self._group(axis).rank(), self.sizes[axis]
        src = dest.index(me)
        flat = x.reshape(-1)
        ins = [flat.numel() if r == dest[me] else 0 for r in range(n)]
        outs = [flat.numel() if r == src else 0 for r in range(n)]
        return tc.functional_all_to_all(flat, self._group(axis), ins, outs).view(x.shape)

    def all_to_all_v(self, x, axis, send, recv):
        return tc.functional_all_to_all(x, self._group(axis), send, recv)


def record_executed(axis_of_group: dict[str, str], out: list):
    """A context manager that appends to ``out`` every functional collective dispatched while it
    is active, as ``Executed`` (``axis_of_group``: process-group name -> mesh axis name)."""

    def note(func, args, kwargs, result) -> None:
        name = tc.functional_collective_name(func)
        if name is None:
            return
        x = args[0]
        nbytes = x.numel() * x.element_size()
        group = args[-1]
        axis = axis_of_group.get(group, group)
        if name == "all_gather_into_tensor":
            out.append(Executed("all_gather", axis, nbytes * args[1]))
        elif name == "reduce_scatter_tensor":
            out.append(Executed("reduce_scatter", axis, nbytes))
        elif name in ("all_reduce", "all_reduce_"):
            out.append(Executed("all_reduce", axis, nbytes))
        elif name == "all_to_all_single" and args[1] and sum(1 for k in args[1] if k) == 1 == sum(
                1 for k in args[2] if k):  # one piece out, one in: a point-to-point permutation
            out.append(Executed("permute", axis, nbytes))
        elif name == "all_to_all_single":
            size = len(args[1]) if args[1] else tc.process_group(group).size()
            out.append(Executed("all_to_all", axis, nbytes * size))

    return tc.record_dispatch(note)


# -- threads (simulation) ------------------------------------------------------------------------

class _Exchange:
    """Shared slots of one axis group: every member writes its buffer, all read all of them."""

    def __init__(self, n: int, timeout: float):
        self.slots: list = [None] * n
        self.barrier = threading.Barrier(n, timeout=timeout)

    def swap(self, i: int, x: torch.Tensor, what: str) -> list[torch.Tensor]:
        self.slots[i] = (what, x)
        try:
            self.barrier.wait()
            got = list(self.slots)
            self.barrier.wait()  # nobody overwrites a slot before every member has read it
            self.slots[i] = None  # read by all: the exchange holds no rank's buffer past its collective
        except threading.BrokenBarrierError:
            raise CollectiveError(f"simulated ranks stopped agreeing at {what} (a rank failed or diverged)") from None
        kinds = {w for w, _ in got}
        if len(kinds) != 1:
            raise CollectiveError(f"simulated ranks issued different collectives together: {sorted(kinds)}")
        return [t for _, t in got]

    def sync(self, what: str) -> None:
        """Wait until every member got here (after a ``swap``: all have read every slot's tensor)."""
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise CollectiveError(f"simulated ranks stopped agreeing at {what} (a rank failed or diverged)") from None


class ThreadMesh:
    """The shared state of a simulated mesh: one exchange per (axis, group)."""

    def __init__(self, mesh_shape: Sequence[int], axis_names: Sequence[str], timeout: float = 120.0):
        import itertools

        self.mesh_shape = tuple(mesh_shape)
        self.axis_names = list(axis_names)
        self.exchanges: dict[tuple, _Exchange] = {}
        for axis, n in enumerate(self.mesh_shape):
            others = [range(m) for i, m in enumerate(self.mesh_shape) if i != axis]
            for key in itertools.product(*others):
                self.exchanges[(axis, key)] = _Exchange(n, timeout)
        self.executed: dict[tuple, list[Executed]] = {}
        self._timeout = timeout
        self._lock = threading.Lock()

    def exchange(self, axis, coords: Sequence[int]) -> _Exchange:
        """The exchange of the group along ``axis`` (one mesh axis, or a tuple of them: their
        combined group, made at first use) that the device at ``coords`` belongs to."""
        axes = axis if isinstance(axis, tuple) else (axis,)
        key = (axis, tuple(c for i, c in enumerate(coords) if i not in axes))
        found = self.exchanges.get(key)
        if found is None:
            with self._lock:  # every member of the group gets the same exchange
                found = self.exchanges.setdefault(key, _Exchange(group_size(self.mesh_shape, axes), self._timeout))
        return found

    def abort(self) -> None:
        """Break every exchange's barrier, so the other simulated ranks stop instead of waiting."""
        with self._lock:
            for ex in self.exchanges.values():
                ex.barrier.abort()


class ThreadComm:
    """One simulated rank's view of a ``ThreadMesh``: a ``program.collectives.Backend`` whose
    collectives are exchanges between threads."""

    def __init__(self, mesh: ThreadMesh, coords: Sequence[int]):
        self.mesh = mesh
        self.coords = tuple(coords)
        self.executed = mesh.executed.setdefault(self.coords, [])

    def axis_size(self, axis) -> int:
        if not isinstance(axis, tuple):
            return self.mesh.mesh_shape[axis]
        return group_size(self.mesh.mesh_shape, axis)

    def _exchange(self, axis) -> _Exchange:
        return self.mesh.exchange(axis, self.coords)

    def _swap(self, axis, x: torch.Tensor, what: str, group_bytes: int) -> list[torch.Tensor]:
        self.executed.append(Executed(what, axis_label(self.mesh.axis_names, axis), group_bytes))
        return self._exchange(axis).swap(self._index(axis), x, what)

    def _index(self, axis) -> int:
        """This rank's place in the group along ``axis`` (a tuple: numbered first axis major)."""
        return group_rank(self.mesh.mesh_shape, axis if isinstance(axis, tuple) else (axis,), self.coords)

    @torch.compiler.disable  # an exchange between threads: a compiled program calls it as Python
    def all_gather(self, x, axis, dim):
        n = self.axis_size(axis)
        return torch.cat(self._swap(axis, x, "all_gather", _nbytes(x) * n), dim=dim)

    @torch.compiler.disable  # an exchange between threads: a compiled program calls it as Python
    def reduce_scatter(self, x, axis, dim, reduce):
        n, i = self.axis_size(axis), self._index(axis)
        parts = self._swap(axis, x, "reduce_scatter", _nbytes(x))
        with unobserved():  # views of every member's buffer: not this rank's memory
            parts = [p.chunk(n, dim=dim)[i] for p in parts]
        return _reduce(parts, reduce)

    @torch.compiler.disable  # an exchange between threads: a compiled program calls it as Python
    def all_reduce(self, x, axis, reduce):
        return _reduce(self._swap(axis, x, "all_reduce", _nbytes(x)), reduce)

    @torch.compiler.disable  # an exchange between threads: a compiled program calls it as Python
    def all_reduce_(self, x, axis, reduce):
        parts = self._swap(axis, x, "all_reduce", _nbytes(x))
        with unobserved():  # gloo reduces in place: the simulator's scratch is not the program's memory
            reduced = _reduce(parts, reduce)
        self._exchange(axis).sync("all_reduce")  # every member has read x before any overwrites its own
        return x.copy_(reduced)

    @torch.compiler.disable  # an exchange between threads: a compiled program calls it as Python
    def all_to_all(self, x, axis):
        n = self.axis_size(axis)
        got = self._swap(axis, x, "all_to_all", _nbytes(x) * n)
        with unobserved():  # views of every member's buffer: not this rank's memory
            got = [g[self._index(axis)] for g in got]
        return torch.stack(got)

    @torch.compiler.disable  # an exchange between threads: a compiled program calls it as Python
    def all_to_all_v(self, x, axis, send, recv):
        me = self._index(axis)
        got = self._swap(axis, (x, send), "all_to_all_v", _nbytes(x))
        with unobserved():  # views of every member's buffer: not this rank's memory
            pieces = []
            for r, (peer, sizes) in enumerate(got):
                if sizes[me] != recv[r]:
                    raise CollectiveError(f"simulated all_to_all_v: rank {r} sends {sizes[me]} rows, {recv[r]} expected")
                pieces.append(peer.narrow(0, sum(sizes[:me]), sizes[me]))
        return torch.cat(pieces)


    @torch.compiler.disable  # an exchange between threads: a compiled program calls it as Python
    def permute(self, x, axis, dest):
        got = self._swap(axis, x, "permute", _nbytes(x))
        src = list(dest).index(self._index(axis))
        with unobserved():  # the sender's buffer: this rank's copy below is its memory
            block = got[src]
        return block.clone()


def group_size(mesh_shape: Sequence[int], axes: Sequence[int]) -> int:
    """How many ranks the combined group of mesh ``axes`` has (a plain loop: compiled programs trace
    it through ``ThreadComm.axis_size`` without a graph break)."""
    n = 1
    for a in axes:
        n *= mesh_shape[a]
    return n


def group_rank(mesh_shape: Sequence[int], axes: Sequence[int], coords: Sequence[int]) -> int:
    """The place of the device at ``coords`` in the combined group of ``axes``, first axis major
    (the order nested splits of one dim give its blocks in)."""
    r = 0
    for a in axes:
        r = r * mesh_shape[a] + coords[a]
    return r


def axis_label(axis_names: Sequence[str], axis) -> str:
    """The name a collective's group goes by: its mesh axis's, or ``"a+b"`` for a combined group."""
    return "+".join(axis_names[a] for a in axis) if isinstance(axis, tuple) else axis_names[axis]


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _reduce(parts: list[torch.Tensor], reduce: str) -> torch.Tensor:
    """The reduction of equal-shaped ``parts`` into one new tensor (the only one it allocates, as a
    real collective's result: ``simulate(..., measure_memory=True)`` counts it)."""
    if reduce not in ("sum", "avg", "max", "min"):
        raise CollectiveError(f"unknown reduction {reduce!r}")
    out = parts[0].contiguous().clone()
    for p in parts[1:]:
        if reduce in ("sum", "avg"):
            out.add_(p)
        elif reduce == "max":
            torch.maximum(out, p, out=out)
        else:
            torch.minimum(out, p, out=out)
    if reduce == "avg":
        out.div_(len(parts))
    return out


@contextlib.contextmanager
def record_collectives(axis_of_group: Optional[dict[str, str]] = None) -> Iterator[list[Executed]]:
    """Collect the process-group collectives this thread dispatches inside the block."""
    out: list[Executed] = []
    with record_executed(axis_of_group or {}, out):
        yield out


__all__ = ["CollectiveError", "Executed", "ProcessGroupComm", "ThreadComm", "ThreadMesh", "axis_groups", "axis_label",
           "group_rank", "group_size", "joint_groups", "joint_pairs",
           "record_collectives", "single_worker_gloo_groups"]
