"""Torch's structured trace (``TORCH_TRACE``, read by tlparse), private in torch 2.13:
``torch._logging.trace_structured`` writes one record per call to the trace log when a handler is
installed (``TORCH_TRACE=DIR`` installs one at import), and ``torch._logging._internal`` holds that
log and its lazy file handler.

On a torch upgrade: check ``trace_structured``'s keywords (``metadata_fn``, ``payload_fn``,
``expect_trace_id``), that an ``"artifact"`` record with ``{"name", "encoding"}`` metadata is still
what tlparse lists, and ``LazyTraceHandler``/``TorchLogsFormatter(trace=True)``/``trace_log`` for
``tracing_to`` (``tests/test_trace_artifact.py`` reads an artifact back).
"""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Any, Callable, Iterator


def tracing() -> bool:
    """Whether torch's structured trace is on (``TORCH_TRACE`` set, or a handler installed). Torch
    installs a lazy handler without a directory at import, which removes itself on its first record
    outside Meta's environment: that one does not count (nor do handlers other tools, pytest's
    log capture, attach to every logger)."""
    from torch._logging._internal import LazyTraceHandler, trace_log

    return any(isinstance(h, LazyTraceHandler) and h.root_dir is not None for h in trace_log.handlers)


def trace_artifact(name: str, payload_fn: Callable[[], Any], encoding: str = "json") -> None:
    """Write an ``artifact`` record named ``name`` to torch's structured trace when it is on;
    ``payload_fn`` (a string, or a JSON-able object) is called only then."""
    from torch._logging import trace_structured

    if not tracing():
        return
    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload_fn,
                     expect_trace_id=False)


@contextlib.contextmanager
def tracing_to(directory: str) -> Iterator[Callable[[], list[str]]]:
    """Within the block, torch's structured trace writes to a log file in ``directory``, as
    ``TORCH_TRACE=directory`` makes it from the start of a process; yields a function listing the
    files written. The handler is removed (and its file closed) at the end."""
    import logging

    from torch._logging._internal import LazyTraceHandler, TorchLogsFormatter, trace_log

    handler = LazyTraceHandler(directory)
    handler.setFormatter(TorchLogsFormatter(trace=True))
    level = trace_log.level
    trace_log.setLevel(logging.DEBUG)
    trace_log.addHandler(handler)
    try:
        yield lambda: sorted(glob.glob(os.path.join(directory, "*.log")))
    finally:
        trace_log.removeHandler(handler)
        handler.close()
        trace_log.setLevel(level)


__all__ = ["trace_artifact", "tracing", "tracing_to"]
