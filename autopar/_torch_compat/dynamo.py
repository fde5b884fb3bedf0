"""``torch.compile`` of lowered rank programs: the graph-break statistics dynamo keeps.

torch exposes ``torch.compile`` and ``torch.compiler.is_compiling`` publicly, but the count of graph
breaks a compilation made lives in ``torch._dynamo.utils.counters``. On a torch upgrade, check that
``counters["graph_break"]`` still maps each break's reason to its count and that
``torch._dynamo.reset`` still clears compiled code and counters.
"""

from __future__ import annotations

from collections import Counter


def graph_breaks() -> Counter:
    """Graph breaks dynamo has counted in this process so far, by reason."""
    from torch._dynamo.utils import counters

    return Counter(dict(counters["graph_break"]))


def reset_dynamo() -> None:
    """Forget every compiled frame and dynamo's counters (tests compile afresh)."""
    import torch._dynamo

    torch._dynamo.reset()


__all__ = ["graph_breaks", "reset_dynamo"]
