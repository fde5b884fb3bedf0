"""The one place that touches private torch APIs (torch 2.13).

Capture needs a few internals that have no public equivalent yet: AOTAutograd's joint export with
input/output descriptors, ``FakeTensorMode`` and its exceptions, and fx's node-metadata annotation.
Everything else in autopar imports them from here, so a torch upgrade is fixed in one file.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx.traceback as _fx_traceback
import torch.utils._pytree as pytree
from torch._decomp import get_decompositions
from torch._functorch._aot_autograd import descriptors as _desc
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "ParamAOTInput",
    "BufferAOTInput",
    "PlainAOTInput",
    "TangentAOTInput",
    "PlainAOTOutput",
    "GradAOTOutput",
    "InputMutationAOTOutput",
    "DATA_DEPENDENT_ERRORS",
    "annotate",
    "preserve_node_meta",
    "export_joint",
    "decompositions",
    "data_dependent_op",
    "use_flat_calling_convention",
    "pytree",
]

ParamAOTInput = _desc.ParamAOTInput
BufferAOTInput = _desc.BufferAOTInput
PlainAOTInput = _desc.PlainAOTInput
TangentAOTInput = _desc.TangentAOTInput
PlainAOTOutput = _desc.PlainAOTOutput
GradAOTOutput = _desc.GradAOTOutput
InputMutationAOTOutput = _desc.InputMutationAOTOutput

#: Exceptions fake tensors raise on an op whose output shape or value depends on tensor data.
DATA_DEPENDENT_ERRORS = (DynamicOutputShapeException, DataDependentOutputException, GuardOnDataDependentSymNode)

annotate = _fx_traceback.annotate
preserve_node_meta = _fx_traceback.preserve_node_meta


def decompositions(ops: list) -> dict:
    """torch's decompositions for ``ops`` (OpOverloads or packets)."""
    return get_decompositions(ops)


def export_joint(module: torch.nn.Module, args: tuple, kwargs: dict, decomps: dict) -> torch.fx.GraphModule:
    """The joint forward+backward graph of ``module(*args, **kwargs)`` (placeholders and the output
    node carry ``meta["desc"]``). The export's context stack is closed before returning: we only keep
    the graph, never compile through AOTAutograd's state."""
    # imported here: AOTAutograd pulls in dynamo (~1.5 s), which plan files and the CLI's show,
    # explain and diff never need
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    with contextlib.ExitStack() as stack, _use_lazy_graph_module(True):
        # lazy: the Python code of a 7k-node graph is generated once, on first call, not per rewrite
        jd = aot_export_joint_with_descriptors(stack, module, args, kwargs, decompositions=decomps)
        return jd.graph_module


def use_flat_calling_convention(gm: torch.fx.GraphModule) -> None:
    """Make ``gm`` take its placeholders as flat positional arguments and return a flat tuple
    (the export's pytree in/out specs no longer hold once placeholders are removed)."""
    gm.graph._codegen = torch.fx.graph.CodeGen()


def data_dependent_op(exc: BaseException) -> str | None:
    """The op named by a data-dependent fake-tensor exception, if it says."""
    func: Any = getattr(exc, "func", None)
    if func is not None:
        return str(func)
    return None

