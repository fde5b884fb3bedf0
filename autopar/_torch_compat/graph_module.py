"""A GraphModule whose Python code is generated on first call (``torch.fx._lazy_graph_module``),
as the export's own graph modules are, torch 2.13.

On a torch upgrade: check that ``_make_graph_module`` still builds the class
``_use_lazy_graph_module(True)`` selects.
"""

from __future__ import annotations

import torch
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module


def lazy_graph_module(root: "torch.nn.Module | dict", graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """``GraphModule(root, graph)`` without generating its code now: a 30k-node graph's code takes
    seconds to generate, and most captured graphs are never called as a module."""
    with _use_lazy_graph_module(True):
        return _make_graph_module(root, graph)


__all__ = ["lazy_graph_module"]
