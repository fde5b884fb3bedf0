"""torch's functional collectives (``torch.distributed._functional_collectives``), the in-place
all-reduce op beneath them (``torch.ops._c10d_functional.all_reduce_``), and looking a process
group up by name (``distributed_c10d._resolve_process_group``), torch 2.13.

On a torch upgrade: check that the four functional collectives keep their signatures and return
``AsyncCollectiveTensor``s waited at first use; that ``_c10d_functional`` keeps its namespace and
op names (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``, ``all_reduce_``,
``all_to_all_single``, the group's name last among the arguments; ``record_collectives`` in
``runtime/collectives.py`` reads them); ``_maybe_wrap_tensor``; and that an ``AsyncCollectiveTensor``
keeps the tensor it wraps as ``elem`` (``collective_payload``). Imports are deferred: importing
autopar does not import torch.distributed's collectives.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

#: The dispatcher namespace of the ops the functional collectives issue.
_NAMESPACE = "_c10d_functional"


def functional_all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """All-gather of ``x`` along ``dim`` over ``group`` (an ``AsyncCollectiveTensor``)."""
    from torch.distributed import _functional_collectives as fc

    return fc.all_gather_single(x, dim, group)


def functional_reduce_scatter(x: torch.Tensor, reduce: str, dim: int, group: Any) -> torch.Tensor:
    """Reduce-scatter of ``x`` along ``dim`` over ``group`` with ``reduce`` ("sum", "avg", ...)."""
    from torch.distributed import _functional_collectives as fc

    return fc.reduce_scatter_single(x, reduce, dim, group)


def functional_all_reduce(x: torch.Tensor, reduce: str, group: Any) -> torch.Tensor:
    """All-reduce of ``x`` over ``group`` into a new tensor."""
    from torch.distributed import _functional_collectives as fc

    return fc.all_reduce(x, reduce, group)


def functional_all_reduce_(x: torch.Tensor, reduce: str, group: Any) -> torch.Tensor:
    """All-reduce of the dense tensor ``x`` over ``group``, written into ``x`` itself (no copy of
    the input); returned wrapped like the functional collectives' results, to be waited on."""
    from torch.distributed import _functional_collectives as fc

    out = torch.ops._c10d_functional.all_reduce_(x, reduce.lower(), group.group_name)
    return fc._maybe_wrap_tensor(out)


def collective_payload(t: torch.Tensor) -> torch.Tensor:
    """The tensor an ``AsyncCollectiveTensor`` wraps (``t`` itself for any other tensor): the
    wrapper is a subclass without storage of its own, so memory is counted by what it holds."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


def functional_all_to_all(x: torch.Tensor, group: Any, send: Optional[list[int]] = None,
                           recv: Optional[list[int]] = None) -> torch.Tensor:
    """All-to-all of ``x`` along dim 0 over ``group``: equal pieces, or ``send[s]`` rows to rank s
    and ``recv[r]`` rows from rank r (a zero size sends or receives nothing: a point-to-point
    permutation is one such call)."""
    from torch.distributed import _functional_collectives as fc

    return fc.all_to_all_single(x, recv, send, group)


def functional_collective_name(func: Any) -> Optional[str]:
    """The name of a functional collective op seen at dispatch (``"all_reduce"``,
    ``"all_gather_into_tensor"``, ...), or None for any other op."""
    if getattr(func, "namespace", "") != _NAMESPACE:
        return None
    return func._opname


def process_group(name: str) -> Any:
    """The process group named ``name`` (a collective op's group argument)."""
    import torch.distributed.distributed_c10d as c10d

    return c10d._resolve_process_group(name)


def group_timeout(group: Any = None) -> Any:
    """The collective timeout (a ``timedelta``) of ``group`` (the default group when None) on this
    rank, or None when torch does not say (read from the group's CPU or CUDA backend options)."""
    import torch.distributed.distributed_c10d as c10d

    group = c10d._get_default_group() if group is None else group
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def set_group_timeout(group: Any, timeout: Any) -> None:
    """Give ``group``'s collectives the timeout ``timeout`` (a ``timedelta``): groups made by
    ``init_device_mesh`` get torch's 30-minute default whatever the default group's timeout."""
    import torch.distributed.distributed_c10d as c10d

    c10d._set_pg_timeout(timeout, group)


__all__ = ["collective_payload", "functional_all_gather", "functional_all_reduce", "functional_all_reduce_", "functional_all_to_all",
           "functional_collective_name", "functional_reduce_scatter", "group_timeout", "process_group",
           "set_group_timeout"]
