"""Lowering: a Plan and its IR become one rank's SPMD program of local ops and collectives.

``resolve`` (``resolve.py``) matches every node with the plan's strategy; ``lower`` (``emitter.py``)
writes one rank's forward and backward programs, resharding with the cost model's own steps
(``reshard.py``), bucketing gradients (``grads.py``), then tidies (``simplify.py``) and schedules
(``schedule.py``) them. The program's contract (``Program``, its collectives) is ``autopar.program``.
"""

from autopar.passes.lower.emitter import lower
from autopar.passes.lower.resolve import RANDOM_OPS, Resolved, resolve

__all__ = ["RANDOM_OPS", "Resolved", "lower", "resolve"]
