"""Marks a lowered program sets as it runs, for whoever watches it (``runtime.memory``).

The backward program of a plan with checkpointing calls ``recomputing(True)`` before each run of
re-executed forward ops and ``recomputing(False)`` after it (``passes/lower/schedule.py:
mark_recomputation``), so a memory measurement can count what they make as activations (the
cost model prices them so: a checkpointed layer's backward holds its recomputed activations).
A call is one thread-local store: programs run it whether or not anyone watches.
"""

from __future__ import annotations

import threading

_local = threading.local()


def recomputing(flag: bool) -> None:
    """The ops that follow, on this thread, re-run forward ops (True) or not (False)."""
    _local.recomputing = flag


def is_recomputing() -> bool:
    """Whether this thread's program is re-running forward ops now."""
    return getattr(_local, "recomputing", False)


__all__ = ["is_recomputing", "recomputing"]
