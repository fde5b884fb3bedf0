"""Layers: the numbered modules of a model (``layers.3``, ``blocks.0``, a root ``nn.Sequential``'s ``0``).

One rule serves every pass that needs layers, so they cannot disagree: ``fold`` groups alike
instances, the cast policy keeps layer ops in the compute dtype, and the lowering's schedule issues
parameter gathers one layer ahead. A node belongs to the first numbered module on its module path
(a parameter: on its FQN).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

from autopar.ir.graph import Graph, Node


def layer_of(path: str) -> Optional[tuple[str, int]]:
    """``"model.layers.3.attn"`` -> ``("model.layers", 3)``: the first numbered module on the path."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i]), int(p)
    return None


def _node_layer(node: Node, param_of: dict[str, str]) -> Optional[tuple[str, int]]:
    """The layer of an op (its module path) or of a parameter or buffer placeholder (its FQN)."""
    if node.is_placeholder:
        fqn = param_of.get(node.name)
        return layer_of(fqn) if fqn else None
    return layer_of(node.module_path) if node.module_path else None


def layers(graph: Graph, with_accumulation: bool) -> dict[tuple[str, int], list[str]]:
    """Layer (prefix, index) -> its node names in graph order; ``with_accumulation`` also takes in
    the module-less gradient accumulations that sum one layer's tensors."""
    param_of = {name: fqn for fqn, name in list(graph.params.items()) + list(graph.buffers.items())}
    by_layer: dict[tuple[str, int], list[str]] = defaultdict(list)
    owner: dict[str, tuple[str, int]] = {}
    for node in graph.nodes:
        key = _node_layer(node, param_of)
        if key is None and with_accumulation and not node.is_placeholder and not node.module_path:
            # Gradient accumulation (a tensor used twice, e.g. the residual stream) has no module:
            # it belongs to the lowest layer among its inputs' (the layer whose tensor it sums).
            keys = [owner[r.node] for r in node.inputs if r.node in owner]
            key = min(keys) if keys and len({k[0] for k in keys}) == 1 else None
        if key is not None:
            owner[node.name] = key
            by_layer[key].append(node.name)
    return by_layer


def layer_members(graph: Graph) -> frozenset[str]:
    """Every op of a numbered layer, gradient accumulation included, as ``fold`` groups them."""
    return frozenset(n for names in layers(graph, True).values() for n in names)


def layer_key(path: str) -> Optional[str]:
    """``"model.layers.3.attn"`` -> ``"model.layers.3"``; ``"0.fc"`` -> ``"0"``: the layer's module path."""
    found = layer_of(path)
    if found is None:
        return None
    prefix, index = found
    return f"{prefix}.{index}" if prefix else str(index)
