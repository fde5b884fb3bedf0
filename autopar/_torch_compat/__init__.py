"""The one place that touches private torch APIs (torch 2.13).

autopar needs a few torch internals that have no public equivalent yet. Each module here wraps one
private surface and says, in its docstring, what to check on a torch upgrade:

- ``aot``: AOTAutograd's joint export with input/output descriptors, decompositions, and
  autopar's one-pass joint tracer built on AOTAutograd's helpers;
- ``fake``: ``FakeTensorMode``, the data-dependent-op exceptions, ``record_dispatch``, ``record_writes``;
- ``inplace``: in-place ops on intermediates of a traced graph made functional (for ``aot``);
- ``fx``: node-metadata annotation, a graph's calling convention, torch's pytree;
- ``dtensor``: ``_StridedShard`` and its checkpointing, a DTensor's local tensor and spec;
- ``c10d``: the functional collectives and their dispatcher ops, group timeouts;
- ``gloo``: gloo groups with one worker thread (a workaround for a torch 2.13 race);
- ``autograd``: autograd-engine and storage bindings of ``torch._C``;
- ``nn``: ``nn.Module``'s parameter/buffer tables and its conversion hook;
- ``dynamo``: the graph-break counts of ``torch.compile`` (compiled rank programs);
- ``sdpa``: fused attention kernels chosen as ``F.scaled_dot_product_attention`` chooses them, with
  their logsumexp and backward (the CUDA kernels of ``autopar.ir.attention``);
- ``pipelining``: torch's pipeline schedules' action orders, built without a process group, and a
  forward-only step of a schedule that runs a lowered order (ZBV);
- ``layouts``: the styles a ``parallelize`` function applies, and ``_StridedShard``'s split dim
  (``autopar.recipes.from_dtensor``); ``trace``: torch's structured trace (``TORCH_TRACE``), which
  planning writes its plan to. These two are imported from their modules.

Everything else in autopar imports these names from here (``from autopar import _torch_compat as
tc``), never from torch's private modules (``tests/test_private_api.py`` enforces it), so a torch
upgrade is fixed in this package.
"""

from __future__ import annotations

from autopar._torch_compat.aot import (
    JOINT_PATHS,
    BufferAOTInput,
    GradAOTOutput,
    InputMutationAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
    decompositions,
    export_joint,
)
from autopar._torch_compat.autograd import has_grad_hooks, storage_use_count, will_engine_execute
from autopar._torch_compat.c10d import (
    collective_payload,
    functional_all_gather,
    functional_all_reduce,
    functional_all_reduce_,
    functional_all_to_all,
    functional_collective_name,
    functional_reduce_scatter,
    group_timeout,
    process_group,
    set_group_timeout,
)
from autopar._torch_compat.dynamo import graph_breaks, reset_dynamo
from autopar._torch_compat.dtensor import (
    dtensor_from_spec,
    dtensor_spec,
    held_indices,
    install_strided_checkpointing,
    local_tensor,
    strided_shard,
)
from autopar._torch_compat.fake import (
    DATA_DEPENDENT_ERRORS,
    FakeTensor,
    FakeTensorMode,
    data_dependent_op,
    record_dispatch,
    record_writes,
    storage_key,
)
from autopar._torch_compat.fx import (
    annotate,
    preserve_node_meta,
    pytree,
    rename_node,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
    use_flat_calling_convention,
)
from autopar._torch_compat.gloo import group_alive, new_one_worker_gloo_groups
from autopar._torch_compat.nn import after_conversion, buffer_table, parameter_table, share_tables, with_metadata
from autopar._torch_compat.pipelining import forward_only, runs_action_order, schedule_order

#: Try the one-pass joint trace first (``aot._export_joint_fast``); False: always AOTAutograd's
#: export. Set here (``tc.FAST_JOINT = False``): ``export_joint`` reads it from the package.
FAST_JOINT = True

__all__ = [
    "rename_node",
    "after_conversion", "annotate", "collective_payload", "buffer_table", "BufferAOTInput", "DATA_DEPENDENT_ERRORS", "data_dependent_op",
    "decompositions", "dtensor_from_spec", "dtensor_spec", "export_joint", "FakeTensor", "FakeTensorMode",
    "FAST_JOINT", "functional_all_gather", "functional_all_reduce", "functional_all_reduce_",
    "functional_all_to_all", "functional_collective_name", "functional_reduce_scatter", "GradAOTOutput",
    "graph_breaks", "group_alive", "group_timeout", "has_grad_hooks", "held_indices", "InputMutationAOTOutput",
    "install_strided_checkpointing", "JOINT_PATHS", "local_tensor", "new_one_worker_gloo_groups", "ParamAOTInput",
    "parameter_table", "PlainAOTInput", "PlainAOTOutput", "preserve_node_meta", "process_group", "pytree", "reset_dynamo",
    "forward_only", "record_dispatch", "record_writes", "runs_action_order", "schedule_order", "set_group_timeout", "share_tables", "storage_key", "storage_use_count",
    "strided_shard", "TangentAOTInput",
    "tree_flatten", "tree_leaves", "tree_map", "tree_unflatten", "use_flat_calling_convention",
    "will_engine_execute", "with_metadata"
]
