"""Measured memory of a running step: the peak of distinct live storages, by what they hold.

A ``MemoryTracker`` watches every op a rank's program dispatches during one training step (the
forward and the backward) and, after each op, adds up the bytes of the distinct storages still
alive among those it has seen (a view counts once, with its storage; collective buffers and
bucket buffers are op outputs like any other). The largest sum is the step's peak. What lives
before the step is handed to it (``begin``): the parameters' and buffers' local blocks, the
optimizer's state and any gradients kept from an earlier step.

At the peak, each storage is one kind (``KINDS``): ``params`` (parameters and buffers),
``grads`` (the gradients the backward returns, or kept from before), ``optimizer`` (the
optimizer's state), ``activations`` (what the forward saves for the backward, the step's inputs
among them when saved, and what a checkpointed layer's forward ops make when the backward runs
them again: ``program.marks``) and ``temporaries`` (everything else: values between ops, collective
and bucket buffers, the loss). Kinds are settled at the end of the step, so a value made in the
forward and saved for the backward is an activation wherever the peak falls. Besides the peak's
split, ``activations_peak`` is the most activation bytes alive at once in the step (the saved
values, and in a checkpointed layer's backward its re-run values): the figure the cost model's
``activations`` prices, which need not all be alive at the overall peak, when the temporaries
of another moment may be larger.

On a CUDA device (``MemoryTracker(device)``) the step also reads the caching allocator's own peak
statistics, reset when the step begins: ``cuda_allocated_peak`` and ``cuda_reserved_peak``. They
count what the storages above cannot see: allocator rounding and fragmentation, library workspaces
(cuBLAS, cuDNN, attention kernels) and buffers freed late on a collective's stream. They are the
device's figures, so one process must run one rank there (``autopar.simulate`` runs a mesh's ranks
as threads of one process and does not read them).

Why our own tracker rather than ``torch.distributed._tools.mem_tracker``: that one sorts
storages by module hooks and autograd, and a lowered program runs op by op with neither; here the
program itself says what is saved and what is a gradient.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Iterable, Iterator, Optional

import torch

from autopar import _torch_compat as tc
from autopar.program.marks import is_recomputing

_local = threading.local()


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Ops run inside the block are not counted (this thread): the simulator's own scratch for a
    collective that gloo runs in place, outside any program's memory."""
    before = getattr(_local, "hidden", False)
    _local.hidden = True
    try:
        yield
    finally:
        _local.hidden = before


#: The kinds a step's peak is split into, in the order ``memory_stats`` lists them.
KINDS = ("params", "grads", "optimizer", "activations", "temporaries")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The plain tensors in an op's output or an argument list (nested lists, tuples, dicts)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, torch.Tensor):
        # a DTensor by its local block; a collective's pending result by the buffer it wraps (the
        # wrapper has no storage of its own: counted as one, it would double the collective's bytes)
        yield tc.local_tensor(value) if isinstance(value, DTensor) else tc.collective_payload(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class MemoryTracker:
    """The peak of one step's live storages on this rank (see the module's docstring)."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        #: the CUDA device whose allocator statistics each step reads as well (None: none)
        self.cuda = torch.device(device) if device is not None and torch.device(device).type == "cuda" else None
        #: storage key -> (uid, bytes); a key whose storage died may be reused by a new storage
        self._live: dict[Any, tuple[int, int]] = {}
        self._kind: dict[int, str] = {}
        self._uids = itertools.count()
        self._total = 0
        self._peak = 0
        self._at_peak: list[tuple[int, int]] = []
        self._act_peak = 0
        #: steps measured so far
        self.steps = 0
        #: the last finished step's figures (``finish``), or None
        self.last: Optional[dict[str, int]] = None

    # -- what the step holds ----------------------------------------------------------------------
    def _add(self, t: torch.Tensor) -> Optional[int]:
        if t.is_meta:
            return None
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (a sparse or symbolic tensor)
            return None
        key = tc.storage_key(t)
        got = self._live.get(key)
        if got is not None:
            if not key.expired():
                return got[0]
            self._drop(key)
        uid = next(self._uids)
        nbytes = storage.nbytes()
        self._live[key] = (uid, nbytes)
        self._total += nbytes
        return uid

    def _drop(self, key: Any) -> None:
        _, nbytes = self._live.pop(key)
        self._total -= nbytes  # its kind stays: the peak may hold it


    def hold(self, values: Iterable, kind: str) -> None:
        """Count the storages of ``values`` (tensors, DTensors, nested containers) as ``kind``."""
        for t in _tensors(list(values)):
            uid = self._add(t)
            if uid is not None:
                self._kind[uid] = kind

    def mark(self, values: Iterable, kind: str) -> None:
        """Settle the storages of ``values`` that are of no kind yet as ``kind`` (a parameter saved
        for the backward stays a parameter)."""
        for t in _tensors(list(values)):
            uid = self._add(t)
            if uid is not None:
                self._kind.setdefault(uid, kind)

    def take(self, values: Iterable) -> None:
        """Count the storages of ``values`` with no kind yet (the step's inputs, a value received from
        another rank): activations if the forward saves them, else temporaries."""
        for t in _tensors(list(values)):
            self._add(t)

    # -- the step ---------------------------------------------------------------------------------
    def begin(self, params: Iterable = (), optimizer: Iterable = (), grads: Iterable = (), inputs: Iterable = ()) -> None:
        """Start a step: forget what earlier steps saw and count what lives now."""
        self._live.clear()
        self._kind.clear()
        self._total = 0
        self.hold(params, "params")
        self.hold(optimizer, "optimizer")
        self.hold(grads, "grads")
        self.take(inputs)
        self._peak, self._at_peak, self._act_peak = 0, [], 0
        if self.cuda is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda)
        self._sample()

    def _sample(self) -> None:
        dead, act = [], 0
        for key, (uid, nbytes) in self._live.items():
            if key.expired():
                dead.append(key)
            elif self._kind.get(uid) == "activations":
                act += nbytes
        for key in dead:
            self._drop(key)
        self._act_peak = max(self._act_peak, act)
        if self._total > self._peak:
            self._peak = self._total
            self._at_peak = list(self._live.values())

    def _on_op(self, func, args, kwargs, out) -> None:
        if getattr(_local, "hidden", False):
            return
        if is_recomputing():  # a checkpointed layer's forward op, run again: what it makes is an activation
            self.mark([out], "activations")
        else:
            for t in _tensors(out):
                self._add(t)
        self._sample()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Count every op's outputs while the block runs (this thread only)."""
        with tc.record_dispatch(self._on_op):
            yield
        self._sample()

    def finish(self) -> dict[str, int]:
        """End the step: its peak and the kinds at the peak, in bytes (also kept as ``last``)."""
        out = {"peak": self._peak, **{k: 0 for k in KINDS}}
        for uid, nbytes in self._at_peak:
            out[self._kind.get(uid, "temporaries")] += nbytes
        # the most activation bytes alive at once (from the end of the forward on, when the saved
        # values are known): the moment the cost model prices, which need not be the peak's
        out["activations_peak"] = max(self._act_peak, out["activations"])
        if self.cuda is not None:
            out["cuda_allocated_peak"] = int(torch.cuda.max_memory_allocated(self.cuda))
            out["cuda_reserved_peak"] = int(torch.cuda.max_memory_reserved(self.cuda))
        self.steps += 1
        out["step"] = self.steps
        self.last = out
        return out


def optimizer_state(optimizer: Optional[torch.optim.Optimizer]) -> list:
    """Every tensor of ``optimizer``'s per-parameter state (moments, step counts)."""
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


__all__ = ["KINDS", "MemoryTracker", "optimizer_state", "unobserved"]
