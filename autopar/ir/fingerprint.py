"""Fingerprints of a captured graph: what a plan records so it is never used on another model.

``graph_fingerprint`` hashes everything that shapes a plan; ``graph_info`` keeps the readable facts
(counts, FQNs, input and parameter shapes, op histogram) a mismatch message compares. The planner's report writes
both into the plan; ``compile`` and the lowering check them.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

from autopar.ir.attention import LEGACY_NAMES
from autopar.ir.graph import Graph


def graph_info(graph: Graph) -> dict:
    """What a plan records of its graph, so a plan used on another model can say what differs:
    node and op counts, parameter FQNs, input and parameter shapes, an op histogram and block-split parameters."""
    params = sorted(set(graph.params) | set(getattr(graph, "aliases", {})))
    info = {
        "nodes": len(graph.nodes),
        "ops": len(graph.op_names()),
        "params": len(params),
        "fqns": params,
        "inputs": {k: str(graph.node(v).out) for k, v in sorted(graph.inputs.items())},
        "shapes": {k: str(graph.node(v).out) for k, v in sorted(graph.params.items())},
        "ops_hist": dict(sorted(Counter(n.op for n in graph.ops()).items())),
    }
    # parameters with dims of equal blocks (ir.blocks): their splits cut every block alike
    blocks = {fqn: [list(b) for b in graph.node(v).out.blocks] for fqn, v in sorted(graph.params.items())
              if graph.node(v).out.blocks}
    if blocks:
        info["blocks"] = blocks
    return info


def graph_fingerprint(graph: Graph, *, legacy: bool = False) -> str:
    """A hash of everything that shapes a plan: ops, shapes, dtypes, arguments, inputs' meaning.
    ``legacy``: with attention under the name plan schema versions 1-7 recorded (``ir.attention``)."""
    h = hashlib.sha256()
    names = LEGACY_NAMES if legacy else {}
    for n in graph.nodes:
        h.update(repr((n.name, names.get(n.op, n.op), [str(o) for o in n.outputs], repr(n.args), repr(n.kwargs), n.roles)).encode())
    h.update(json.dumps([sorted(graph.params.items()), sorted(graph.inputs.items()), graph.training],
                        sort_keys=True, default=str).encode())
    return h.hexdigest()
