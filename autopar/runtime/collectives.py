"""The collectives a lowered program calls, for real process groups and for the simulator.

A lowered program calls the rank-level functions below (``all_gather``, ``reduce_scatter``,
``all_reduce``, ``all_to_all``, ``wait``) with mesh-axis numbers and sizes baked in. They pad
uneven pieces to equal ones (pieces follow DTensor's ``Shard``: ``ceil(size / n)`` each, the last
ones shorter or empty), run one collective on the axis's group through the *backend* of the
calling thread, and trim the padding. Two backends exist:

- ``ProcessGroupComm``: torch's functional collectives on one process group per mesh axis (gloo
  or NCCL); results are ``AsyncCollectiveTensor``s, waited at first use (``wait``).
- ``ThreadComm``: every rank of a mesh is a thread of one process; a collective is an exchange
  through shared slots and barriers (``autopar.simulate``).

``record_collectives`` lists what actually ran, per collective: kind, mesh axis and bytes of the
buffer as the axis group sees it (all-gather: its output; reduce-scatter and all-reduce: the
input; all-to-all: the input times the group size), the same measure as the cost model's
``step_bytes``. For process groups it intercepts torch's ``_c10d_functional`` ops with a dispatch
mode, so it sees the collectives the program really issued.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode


_local = threading.local()


class CollectiveError(RuntimeError):
    """A collective that cannot complete: no backend, or ranks that stopped agreeing."""


@dataclass(frozen=True)
class Executed:
    """One collective that ran on this rank."""

    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all
    axis: str  # mesh axis name
    bytes: int


def _backend():
    b = getattr(_local, "backend", None)
    if b is None:
        raise CollectiveError(
            "a lowered autopar program ran outside a parallel context: run it through a ParallelModule "
            "(autopar.compile) or autopar.simulate, which set up the mesh's process groups"
        )
    return b


@contextlib.contextmanager
def use_backend(backend) -> Iterator[None]:
    """Route this thread's collectives to ``backend`` while the block runs."""
    prev = getattr(_local, "backend", None)
    _local.backend = backend
    try:
        yield
    finally:
        _local.backend = prev


# -- padding -------------------------------------------------------------------------------------

def _pad_dim(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    if x.shape[dim] == length:
        return x
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _step(size: int, n: int) -> int:
    return -(-size // n) if size else 0


# -- the rank-level functions a lowered program calls ----------------------------------------------

def all_gather(x: torch.Tensor, axis: int, dim: int, size: int) -> torch.Tensor:
    """S(dim) -> B on mesh axis ``axis``; ``size`` is the gathered length of ``dim``."""
    b = _backend()
    n = b.axis_size(axis)
    out = b.all_gather(_pad_dim(x, dim, _step(size, n)), axis, dim)
    return out.narrow(dim, 0, size).contiguous() if out.shape[dim] != size else out


def reduce_scatter(x: torch.Tensor, axis: int, dim: int, reduce: str, length: int) -> torch.Tensor:
    """P -> S(dim) on mesh axis ``axis``; this rank's piece of ``dim`` has ``length`` elements."""
    b = _backend()
    n = b.axis_size(axis)
    step = _step(x.shape[dim], n)
    out = b.reduce_scatter(_pad_dim(x, dim, step * n), axis, dim, reduce)
    return out.narrow(dim, 0, length).contiguous() if out.shape[dim] != length else out


def all_reduce(x: torch.Tensor, axis: int, reduce: str, inplace: bool = False) -> torch.Tensor:
    """P -> B on mesh axis ``axis``. With ``inplace`` the result is written into ``x`` itself, which
    the caller must own and never read again (a gradient bucket it has just concatenated): that
    saves the copy a functional all-reduce makes of its input, a whole bucket's bytes per step."""
    b = _backend()
    return b.all_reduce_(x, axis, reduce) if inplace else b.all_reduce(x, axis, reduce)


def all_to_all(x: torch.Tensor, axis: int, src_dim: int, dst_dim: int, src_size: int, dst_length: int) -> torch.Tensor:
    """S(src_dim) -> S(dst_dim) on mesh axis ``axis``.

    ``src_size`` is the gathered length of ``src_dim``; this rank keeps ``dst_length`` of
    ``dst_dim``. Pieces are padded to equal sizes, stacked on a new leading dim and exchanged with
    one equal-split all-to-all.
    """
    b = _backend()
    n = b.axis_size(axis)
    si, sj = _step(src_size, n), _step(x.shape[dst_dim], n)
    xp = _pad_dim(_pad_dim(x, src_dim, si), dst_dim, sj * n)
    pieces = torch.stack(xp.split(sj, dim=dst_dim)) if sj else xp.unsqueeze(0).expand(n, *xp.shape)
    got = b.all_to_all(pieces.contiguous(), axis)  # got[r]: rank r's block of src_dim, my piece of dst_dim
    out = torch.cat(list(got.unbind(0)), dim=src_dim)
    out = out.narrow(src_dim, 0, src_size) if out.shape[src_dim] != src_size else out
    out = out.narrow(dst_dim, 0, dst_length) if out.shape[dst_dim] != dst_length else out
    return out.contiguous()


def wait(x: torch.Tensor) -> torch.Tensor:
    """Wait for a collective's result (a no-op for results that are already complete)."""
    if type(x) is not torch.Tensor and hasattr(x, "wait"):
        return x.wait()
    return x


#: The collective functions of lowered programs (for passes that reorder or recognise them).
COLLECTIVES = (all_gather, reduce_scatter, all_reduce, all_to_all)


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

    Why (torch 2.13): ``ProcessGroupGloo::runLoop`` runs a group's collectives on its worker
    threads, and each worker, after finishing one, writes the group's status record
    (``pgStatus_->lastCompletedWorkName = opTypeToString(opType)``) without holding the group's
    lock. Two collectives of one group finishing together race on that ``std::string``; names
    longer than 15 characters live on the heap (the functional all-gather's
    "ALLGATHER_COALESCED"), so the race double-frees it: glibc aborts ("double free or corruption
    (fasttop)", "unaligned tcache/fastbin chunk") or a later collective crashes. Programs keep
    several collectives in flight (``passes.schedule``), so this hit long runs within minutes. With
    one worker a group's collectives run one after another on one thread, still under compute."""
    import os

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import ProcessGroupGloo

    def devices() -> list:  # as torch's own constructor picks them
        names = os.environ.get("GLOO_SOCKET_IFNAME", "")
        if len(names) > 1:
            return [ProcessGroupGloo.create_device(interface=n) for n in names.split(",")]
        return [ProcessGroupGloo.create_default_device()]

    class OneWorkerGloo(ProcessGroupGloo):
        def __init__(self, store, group_rank, group_size, timeout):
            opts = ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = devices()
            opts._threads = 1
            super().__init__(store, group_rank, group_size, opts)

    key = (id(dist.group.WORLD), tuple(mesh_ranks.shape), tuple(mesh_ranks.flatten().tolist()))
    known = _ONE_WORKER_GROUPS.get(key)
    if known is not None and all(g in c10d._world.pg_map for g in known):  # not destroyed since
        return known
    # the default group's timeout (``autopar.launch``'s), so a collective a peer never joins fails alike
    timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    mine = []
    saved = c10d.ProcessGroupGloo
    c10d.ProcessGroupGloo = OneWorkerGloo  # the class new_group builds gloo backends with
    try:
        for groups in axis_groups(mesh_ranks):
            made = [dist.new_group(ranks, backend="gloo", timeout=timeout) for ranks in groups]
            mine.append(next(g for g, ranks in zip(made, groups) if rank in ranks))
    finally:
        c10d.ProcessGroupGloo = saved
    _ONE_WORKER_GROUPS[key] = mine
    return mine


class ProcessGroupComm:
    """Collectives over one torch process group per mesh axis (this rank's groups)."""

    def __init__(self, groups: Sequence, axis_names: Sequence[str]):
        self.groups = list(groups)
        self.axis_names = list(axis_names)
        self.sizes = [g.size() for g in self.groups]

    def axis_size(self, axis: int) -> int:
        return self.sizes[axis]

    def all_gather(self, x, axis, dim):
        from torch.distributed import _functional_collectives as fc

        return fc.all_gather_single(x.contiguous(), dim, self.groups[axis])

    def reduce_scatter(self, x, axis, dim, reduce):
        from torch.distributed import _functional_collectives as fc

        return fc.reduce_scatter_single(x.contiguous(), reduce, dim, self.groups[axis])

    def all_reduce(self, x, axis, reduce):
        from torch.distributed import _functional_collectives as fc

        return fc.all_reduce(x.contiguous(), reduce, self.groups[axis])

    def all_reduce_(self, x, axis, reduce):
        from torch.distributed import _functional_collectives as fc

        if not x.is_contiguous():  # the collective needs a dense buffer: reduce a dense copy
            return self.all_reduce(x, axis, reduce)
        out = torch.ops._c10d_functional.all_reduce_(x, reduce.lower(), self.groups[axis].group_name)
        return fc._maybe_wrap_tensor(out)  # waited like the functional collectives' results

    def all_to_all(self, x, axis):
        from torch.distributed import _functional_collectives as fc

        return fc.all_to_all_single(x, None, None, self.groups[axis])


class _Recorder(TorchDispatchMode):
    """Lists every ``_c10d_functional`` collective dispatched while active."""

    def __init__(self, axis_of_group: dict[str, str], out: list):
        super().__init__()
        self.axis_of_group = axis_of_group
        self.out = out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = getattr(func, "namespace", "")
        if ns == "_c10d_functional":
            name = func._opname
            x = args[0]
            nbytes = x.numel() * x.element_size()
            group = args[-1]
            if name == "all_gather_into_tensor":
                self.out.append(Executed("all_gather", self.axis_of_group.get(group, group), nbytes * args[1]))
            elif name == "reduce_scatter_tensor":
                self.out.append(Executed("reduce_scatter", self.axis_of_group.get(group, group), nbytes))
            elif name in ("all_reduce", "all_reduce_"):
                self.out.append(Executed("all_reduce", self.axis_of_group.get(group, group), nbytes))
            elif name == "all_to_all_single":
                size = len(args[1]) if args[1] else self._size(group)
                self.out.append(Executed("all_to_all", self.axis_of_group.get(group, group), nbytes * size))
        return func(*args, **kwargs)

    @staticmethod
    def _size(group_name: str) -> int:
        import torch.distributed.distributed_c10d as c10d

        return c10d._resolve_process_group(group_name).size()


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
        except threading.BrokenBarrierError:
            raise CollectiveError(f"simulated ranks stopped agreeing at {what} (a rank failed or diverged)") from None
        kinds = {w for w, _ in got}
        if len(kinds) != 1:
            raise CollectiveError(f"simulated ranks issued different collectives together: {sorted(kinds)}")
        return [t for _, t in got]


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

    def abort(self) -> None:
        for ex in self.exchanges.values():
            ex.barrier.abort()


class ThreadComm:
    """One simulated rank's view of a ``ThreadMesh``."""

    def __init__(self, mesh: ThreadMesh, coords: Sequence[int]):
        self.mesh = mesh
        self.coords = tuple(coords)
        self.executed = mesh.executed.setdefault(self.coords, [])

    def axis_size(self, axis: int) -> int:
        return self.mesh.mesh_shape[axis]

    def _swap(self, axis: int, x: torch.Tensor, what: str, group_bytes: int) -> list[torch.Tensor]:
        key = tuple(c for i, c in enumerate(self.coords) if i != axis)
        self.executed.append(Executed(what, self.mesh.axis_names[axis], group_bytes))
        return self.mesh.exchanges[(axis, key)].swap(self.coords[axis], x, what)

    def all_gather(self, x, axis, dim):
        n = self.axis_size(axis)
        return torch.cat(self._swap(axis, x, "all_gather", _nbytes(x) * n), dim=dim)

    def reduce_scatter(self, x, axis, dim, reduce):
        full = _reduce(self._swap(axis, x, "reduce_scatter", _nbytes(x)), reduce)
        return full.chunk(self.axis_size(axis), dim=dim)[self.coords[axis]].contiguous()

    def all_reduce(self, x, axis, reduce):
        return _reduce(self._swap(axis, x, "all_reduce", _nbytes(x)), reduce)

    all_reduce_ = all_reduce  # the exchange makes a new tensor anyway

    def all_to_all(self, x, axis):
        n = self.axis_size(axis)
        got = self._swap(axis, x, "all_to_all", _nbytes(x) * n)
        return torch.stack([g[self.coords[axis]] for g in got])


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _reduce(parts: list[torch.Tensor], reduce: str) -> torch.Tensor:
    stacked = torch.stack(parts)
    if reduce == "sum":
        return stacked.sum(0)
    if reduce == "max":
        return stacked.amax(0)
    if reduce == "min":
        return stacked.amin(0)
    if reduce == "avg":
        return stacked.mean(0)
    raise CollectiveError(f"unknown reduction {reduce!r}")


@contextlib.contextmanager
def record_collectives(axis_of_group: Optional[dict[str, str]] = None) -> Iterator[list[Executed]]:
    """Collect the process-group collectives this thread dispatches inside the block."""
    out: list[Executed] = []
    with _Recorder(axis_of_group or {}, out):
        yield out


__all__ = [
    "COLLECTIVES",
    "CollectiveError",
    "Executed",
    "ProcessGroupComm",
    "ThreadComm",
    "ThreadMesh",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "axis_groups",
    "record_collectives",
    "reduce_scatter",
    "single_worker_gloo_groups",
    "use_backend",
    "wait",
]
