"""Python's cyclic garbage collector paused around planning work (``collector_paused``).

Planning allocates millions of small objects that reference counting frees, and every collection
they trigger walks the whole planning heap (the captured graph, its fx graph and fake tensors, the
priced problem). Cycles made meanwhile are collected at the next collection after.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off within, as it was after (also a decorator:
    ``@collector_paused()``)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
