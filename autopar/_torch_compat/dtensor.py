"""DTensor internals (torch 2.13): the ``_StridedShard`` placement
(``torch.distributed.tensor.placement_types``), a DTensor's local tensor and spec
(``DTensor._local_tensor``, ``DTensor._spec``), the private ``DTensor(local, spec, ...)``
constructor, and the checkpoint hooks DTensor gives ``torch.distributed.checkpoint``
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``).

On a torch upgrade: check ``_StridedShard(dim, split_factor=)`` and the order in which DTensor
applies it over mesh axes (``tests/test_blocks.py`` compares ``held_indices`` with DTensor's own
``_local_shard_size_and_offset``), whether DCP still refuses a strided block's overlapping chunk
(``install_strided_checkpointing`` may become unnecessary; ``tests/test_dcp.py``), and
that ``_local_tensor``/``_spec`` and the constructor keep their names and meaning.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local block, without ``to_local``'s autograd node (for code running without grad)."""
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t.to_local()


def dtensor_spec(t: torch.Tensor) -> Any:
    """A DTensor's spec (mesh, placements, global shape, stride and dtype), opaque outside this
    module: give it back to ``dtensor_from_spec``."""
    return t._spec


def dtensor_from_spec(local: torch.Tensor, spec: Any) -> torch.Tensor:
    """A DTensor with ``spec`` (from ``dtensor_spec``) whose local block is ``local``, cast to the
    spec's dtype, not requiring grad. Unlike ``DTensor.from_local`` it adds no autograd node and
    recomputes nothing (the global shape and stride come with the spec)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local.to(spec.tensor_meta.dtype), spec, requires_grad=False)


# ---------------------------------------------------------------------------------------------
# DTensor's ``_StridedShard``: dims of equal blocks (``TensorSpec.blocks``) split block by block


def strided_shard(dim: int, blocks: int) -> Any:
    """DTensor's placement for a split of ``dim`` that cuts each of its ``blocks`` equal blocks
    alike (a device holds its piece of every block, in block order)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=blocks)


def held_indices(size: int, dim: int, placements: Sequence, mesh_shape: Sequence[int],
                 coords: Sequence[int]) -> list[int]:
    """The global indices along ``dim`` of a DTensor's local block, in local order (``Shard``
    takes its chunk; ``_StridedShard(sf)`` cuts the current block into ``sf`` equal blocks and
    takes its chunk of each: left to right over the mesh axes, as DTensor does)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    idx = list(range(size))
    for p, n, c in zip(placements, mesh_shape, coords):
        if isinstance(p, _StridedShard) and p.dim == dim:
            sf = int(p.split_factor)
            block = len(idx) // sf
            piece = -(-block // n)
            idx = [i for b in range(sf) for i in idx[b * block:(b + 1) * block][c * piece:(c + 1) * piece]]
        elif isinstance(p, Shard) and p.dim == dim:
            piece = -(-len(idx) // n)
            idx = idx[c * piece:(c + 1) * piece]
    return idx


def _strided_pieces(t: torch.Tensor) -> list | None:
    """A ``_StridedShard`` DTensor's local block as the contiguous pieces of the global tensor it is
    made of: ``[(global offsets, sizes, local starts)]``; None for any other DTensor."""
    import itertools

    from torch.distributed.tensor.placement_types import _StridedShard

    if not any(isinstance(p, _StridedShard) for p in t.placements):
        return None
    mesh, coords = t.device_mesh, t.device_mesh.get_coordinate()
    if coords is None:
        return []
    runs_per_dim = []
    for d, size in enumerate(t.shape):
        idx = held_indices(size, d, t.placements, mesh.shape, coords)
        runs, start = [], 0  # (global start, local start, length) of each run of consecutive indices
        for k in range(1, len(idx) + 1):
            if k == len(idx) or idx[k] != idx[k - 1] + 1:
                runs.append((idx[start], start, k - start))
                start = k
        runs_per_dim.append(runs)
    return [(tuple(r[0] for r in combo), tuple(r[2] for r in combo), tuple(r[1] for r in combo))
            for combo in itertools.product(*runs_per_dim)]


def install_strided_checkpointing() -> None:
    """Teach ``torch.distributed.checkpoint`` the ``_StridedShard`` blocks autopar makes.

    DCP describes a DTensor's local block as one chunk at its first global offset; a block holding
    a piece of each of several blocks of the global tensor is several chunks, so torch 2.13 refuses
    to save it ("overlapping chunks") and would load the wrong rows into it. This describes it as
    one chunk per contiguous piece (DTensor's own checkpoint hooks, patched once; every other
    DTensor goes the original way)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.tensor import DTensor

    if getattr(DTensor, "_autopar_strided_checkpointing", False):
        return
    orig_write, orig_chunks, orig_shard = (DTensor.__create_write_items__, DTensor.__create_chunk_list__,
                                           DTensor.__get_tensor_shard__)

    def write_items(self, fqn, obj):
        pieces = _strided_pieces(self)
        if pieces is None:
            return orig_write(self, fqn, obj)
        props = TensorProperties.create_from_tensor(self.to_local())
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(off),
                                                                                 sizes=torch.Size(size)),
                                                      properties=props, size=self.size()))
                for off, size, _ in pieces]

    def chunk_list(self):
        pieces = _strided_pieces(self)
        if pieces is None:
            return orig_chunks(self)
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)) for off, size, _ in pieces]

    def tensor_shard(self, index):
        pieces = _strided_pieces(self)
        if pieces is None:
            return orig_shard(self, index)
        local = self.to_local()
        for off, size, start in pieces:
            if index.offset is not None and tuple(index.offset) == off:
                for d, (s, n) in enumerate(zip(start, size)):
                    local = local.narrow(d, s, n)
                return local  # a view: DCP loads into it in place
        raise ValueError(f"{index.fqn!r}: no piece of this rank's block starts at {index.offset}")

    DTensor.__create_write_items__ = write_items
    DTensor.__create_chunk_list__ = chunk_list
    DTensor.__get_tensor_shard__ = tensor_shard
    DTensor._autopar_strided_checkpointing = True


__all__ = ["dtensor_from_spec", "dtensor_spec", "held_indices", "install_strided_checkpointing", "local_tensor",
           "strided_shard"]
