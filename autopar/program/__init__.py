"""The lowered program's contract, shared by the lowering (which writes programs) and the runtime
(which runs them): ``Program``/``Slot``/``LocalOp``/``RandomOp`` (``program.py``), the collectives a program calls
(``collectives.py``) and gradient-bucket packing (``bucket.py``)."""

from autopar.program.program import LocalOp, Program, RandomOp, RandomState, Slot

__all__ = ["LocalOp", "Program", "RandomOp", "RandomState", "Slot"]
