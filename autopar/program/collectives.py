"""The collectives a lowered program calls: the instruction set shared by the lowering and the runtime.

A lowered program calls the rank-level functions below (``all_gather``, ``reduce_scatter``,
``all_reduce``, ``all_to_all``, ``wait``; ``all_to_all_v`` from inside local ops) with mesh-axis
numbers and sizes baked in. They pad uneven pieces to equal ones (pieces follow DTensor's
``Shard``: ``ceil(size / n)`` each, the last ones shorter or empty), run one collective on the axis's group through the *backend* of the
calling thread (a ``Backend``: ``runtime.collectives`` has the process-group and the simulated
ones), and trim the padding. The lowering emits these functions as fx call targets, so the
collectives that run are the ones the plan priced.

An ``axis`` is one mesh axis's number, or a tuple of them for a collective over their combined
group (``cost_model.comm.joint_step``: Ulysses over two axes), whose ranks are numbered first axis
major, the order nested splits of one dim give its blocks in.
"""


from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import torch

from autopar.errors import CollectiveError

_local = threading.local()


@dataclass(frozen=True)
class Executed:
    """One collective that ran on this rank."""

    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | permute
    axis: str  # mesh axis name ("a+b": the combined group of axes a and b)
    bytes: int


class Backend(Protocol):
    """What runs a program's collectives on one rank: one group per mesh axis, and one per tuple of
    axes the program joins (``axis`` a tuple). Results may be asynchronous (waited by ``wait``).
    ``runtime.collectives`` has the two implementations."""

    def axis_size(self, axis: int | tuple[int, ...]) -> int:
        """How many ranks the group of mesh axis ``axis`` (or of the axes, combined) has."""

    def all_gather(self, x: torch.Tensor, axis: int, dim: int) -> torch.Tensor:
        """Every rank's ``x`` (equal pieces) concatenated along ``dim``."""

    def reduce_scatter(self, x: torch.Tensor, axis: int, dim: int, reduce: str) -> torch.Tensor:
        """Every rank's ``x`` reduced; this rank keeps its equal piece of ``dim``."""

    def all_reduce(self, x: torch.Tensor, axis: int, reduce: str) -> torch.Tensor:
        """Every rank's ``x`` reduced, into a new tensor."""

    def all_reduce_(self, x: torch.Tensor, axis: int, reduce: str) -> torch.Tensor:
        """Every rank's ``x`` reduced into ``x`` itself (the caller owns it and never reads it again)."""

    def all_to_all(self, x: torch.Tensor, axis: int | tuple[int, ...]) -> torch.Tensor:
        """The leading dim exchanged: rank r's ``x[s]`` arrives at rank s as ``out[r]``."""

    def permute(self, x: torch.Tensor, axis: int, dest: Sequence[int]) -> torch.Tensor:
        """Point to point: rank r's ``x`` (equal shapes) arrives at rank ``dest[r]``, returned there."""
    def all_to_all_v(self, x: torch.Tensor, axis: int, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows of ``x`` exchanged in uneven pieces: ``send[s]`` consecutive rows go to rank s, and
        ``recv[r]`` rows arrive from rank r, concatenated in rank order."""


def _backend() -> Backend:
    b = getattr(_local, "backend", None)
    if b is None:
        raise CollectiveError(
            "a lowered autopar program ran outside a parallel context: run it through a ParallelModule "
            "(autopar.compile) or autopar.simulate, which set up the mesh's process groups"
        )
    return b


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
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


def all_to_all(x: torch.Tensor, axis: int | tuple[int, ...], src_dim: int, dst_dim: int, src_size: int,
               dst_length: int) -> torch.Tensor:
    """S(src_dim) -> S(dst_dim) on mesh axis ``axis`` (a tuple: on both axes, over their combined group).

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


def permute(x: torch.Tensor, axis: int, dest: Sequence[int]) -> torch.Tensor:
    """Every rank of mesh axis ``axis`` sends its ``x`` (the same shape on all) to rank ``dest[rank]``;
    returns what this rank received, waited (ring attention's exchanges, inside one op)."""
    if all(d == r for r, d in enumerate(dest)):
        return x
    return wait(_backend().permute(x.contiguous(), axis, list(dest)))
def all_to_all_v(x: torch.Tensor, axis: int, send: list[int], recv: list[int]) -> torch.Tensor:
    """Dim 0 of ``x`` exchanged in uneven, run-time pieces on mesh axis ``axis`` (the dispatch and
    combine of dropless expert parallelism): ``send[s]`` consecutive rows go to the axis's rank s,
    ``recv[r]`` rows arrive from rank r, in rank order. Every rank passes sizes that agree with its
    peers' (``recv`` here is ``send`` there)."""
    if sum(send) != x.shape[0]:
        raise CollectiveError(f"all_to_all_v: {x.shape[0]} rows to send, split sizes {send} add up to {sum(send)}")
    return _backend().all_to_all_v(x.contiguous(), axis, list(send), list(recv))


def wait(x: torch.Tensor) -> torch.Tensor:
    """Wait for a collective's result (a no-op for results that are already complete)."""
    if type(x) is not torch.Tensor and hasattr(x, "wait"):
        return x.wait()
    return x


#: The collective functions of lowered programs (for passes that reorder or recognise them);
#: ``all_to_all_v`` runs inside rank-aware local ops (``LocalCtx.exchange``), never as a program node.
COLLECTIVES = (all_gather, reduce_scatter, all_reduce, all_to_all)


__all__ = ["COLLECTIVES", "Backend", "Executed", "all_gather", "all_reduce", "all_to_all", "all_to_all_v",
           "permute",
           "reduce_scatter", "use_backend", "wait"]
