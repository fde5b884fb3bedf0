"""Op sharding rules: which SBP signatures each aten op admits, and how it runs on local blocks.

Importing this package registers every rule (``generic`` for the data-only ops, ``special`` for the
ops whose local implementation needs offsets, ``vision`` and ``moe`` for the CNN and
mixture-of-experts ops, ``grouped`` for grouped matrix products (``_grouped_mm``, ``histc``),
``indexing`` for positional writes and advanced indexing, ``complex`` for
complex RoPE, ``random_ops`` for dropout and the other random draws, ``ring`` for ring attention).
"""

from autopar.ir.rules import (  # noqa: F401  (registration)
    complex, generic, grouped, indexing, layout, moe, random_ops, ring, special, vision,
)
from autopar.ir.rules.base import (
    RULES,
    LocalCtx,
    OpCall,
    OpRule,
    dimmap,
    has_rule,
    op_call,
    register,
    run_local,
    signatures,
    strategies,
)
from autopar.ir.rules.dimmap import DimMap, Linear, Signature, Strategy

__all__ = [
    "RULES", "DimMap", "Linear", "LocalCtx", "OpCall", "OpRule", "Signature", "Strategy",
    "dimmap", "has_rule", "op_call", "register", "run_local", "signatures", "strategies",
]
