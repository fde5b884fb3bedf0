"""Random ops (dropout, ``bernoulli``, ``rand_like``, ``randn_like``): a rule, and a counter-based draw.

A sharded program must draw what the same program draws on one device, so nothing here reads a
random stream. Every element's number is a hash of ``(seed, step, op, global element index)``:
``key`` mixes seed, step and op (the IR node's name, the same under every placement) into one
64-bit integer, and each element of a device's block hashes ``key`` with its index in the *whole*
tensor (under block-split dims too). A block therefore holds exactly the piece of the whole
tensor's draw that it covers, and replicated copies draw alike. The hash is splitmix64 of
``key + index * golden`` on wrapping int64 arithmetic, vectorized over the block with torch
integer ops.

The numbers differ from torch's own (Philox or MT) streams: a model's masks under autopar are not
the ones its eager forward would draw, only the same on every placement.
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional, Sequence, Union

import torch

from autopar.ir.placement import Placement, expand_blocks, local_range
from autopar.ir.rules.base import OFFSET_READS, LocalCtx, OpCall, register
from autopar.ir.rules.dimmap import DimMap
from autopar.ir.rules.generic import pointwise_map

#: Random ops autopar lowers to the counter-based draw (elementwise: any placement but partial).
SUPPORTED = ("aten.native_dropout.default", "aten.bernoulli.p", "aten.bernoulli.default",
             "aten.rand_like.default", "aten.randn_like.default")

#: Op names (without overload) that draw random numbers; those not in ``SUPPORTED`` are refused.
RANDOM_BASES = frozenset({
    "aten.native_dropout", "aten.dropout", "aten.feature_dropout", "aten.alpha_dropout",
    "aten.feature_alpha_dropout", "aten.bernoulli", "aten.bernoulli_", "aten.rand", "aten.randn",
    "aten.randint", "aten.rand_like", "aten.randn_like", "aten.randint_like", "aten.normal",
    "aten.normal_", "aten.uniform", "aten.uniform_", "aten.exponential", "aten.exponential_",
    "aten.geometric", "aten.geometric_", "aten.cauchy", "aten.cauchy_", "aten.log_normal",
    "aten.log_normal_", "aten.random", "aten.random_", "aten.multinomial", "aten.randperm",
    "aten.rrelu_with_noise", "aten.poisson", "aten._standard_gamma", "aten._sample_dirichlet",
    "aten.binomial", "aten._fused_dropout", "aten.native_dropout_", "aten.rrelu",
})

_M64 = (1 << 64) - 1


def is_random(op: str) -> bool:
    """Whether ``op`` (an aten op name with its overload) draws random numbers."""
    return op.rsplit(".", 1)[0] in RANDOM_BASES


def unsupported_random(ops: Sequence[str]) -> list[str]:
    """The random ops among ``ops`` that autopar cannot draw placement-independently."""
    return sorted({op for op in ops if is_random(op) and op not in SUPPORTED})


# -- the hash ---------------------------------------------------------------------------------------

def _signed(v: int) -> int:
    v &= _M64
    return v - (1 << 64) if v >= 1 << 63 else v


_C1, _C2, _GOLDEN = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(0x9E3779B97F4A7C15)


def splitmix(v: int) -> int:
    """splitmix64 of the 64-bit integer ``v`` (Python ints: exact), as an unsigned 64-bit value."""
    z = (v + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def draw_seed() -> int:
    """A run's seed, drawn from torch's default generator (so ``torch.manual_seed`` fixes it)."""
    return int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))


def op_id(name: str) -> int:
    """A 64-bit id of an IR node's name (stable across processes, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def draw_key(seed: int, step: int, op: str) -> int:
    """The 64-bit key of op ``op`` (an IR node name) at ``step`` of a run seeded ``seed``."""
    return splitmix(splitmix(splitmix(seed & _M64) ^ (step & _M64)) ^ op_id(op))


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` by ``s`` bits."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def key_tensor(key: int, device=None) -> torch.Tensor:
    """``key`` as a 0-dim int64 tensor (its bits, signed): the key a compiled program's draws read as
    data, so a new step's key is a new input rather than a constant to compile again for."""
    return torch.tensor(_signed(key), dtype=torch.int64, device=device)


def hash_indices(key: Union[int, torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """splitmix64 of ``key + index * golden`` per element (int64, wrapping), a bijection of the
    index for a given key: the element's 64 random bits. ``key`` is an int or a ``key_tensor``."""
    base = key + _signed(0x9E3779B97F4A7C15) if isinstance(key, torch.Tensor) else _signed(key + 0x9E3779B97F4A7C15)
    z = index * _GOLDEN + base
    z = (z ^ _srl(z, 30)) * _C1
    z = (z ^ _srl(z, 27)) * _C2
    return z ^ _srl(z, 31)


def _salted(key: Union[int, torch.Tensor], salt: int) -> Union[int, torch.Tensor]:
    """``splitmix(key ^ salt)``: a second key drawn from ``key``, for an int or a ``key_tensor``."""
    if isinstance(key, torch.Tensor):
        return hash_indices(key ^ _signed(salt), torch.zeros((), dtype=torch.int64, device=key.device))
    return splitmix(key ^ salt)


def uniform53(key: Union[int, torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """Per element an integer uniform in ``[0, 2**53)`` (int64)."""
    return _srl(hash_indices(key, index), 11)


def _unit(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.float64) * (2.0 ** -53)


# -- global indices of a block ----------------------------------------------------------------------

def global_index(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int],
                 coords: Sequence[int], blocks: Sequence[tuple[int, int]] = (), offset_scale: int = 1,
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """Every element of the block the device at ``coords`` holds, numbered by its row-major index in
    the whole tensor of ``shape`` (int64, the block's shape). ``blocks``: dims split block by block
    (``TensorSpec.blocks``). ``offset_scale`` 0 forgets the offsets (the rule proof's mutation)."""
    block_of = dict(blocks)
    eshape, epl = expand_blocks(shape, placements, blocks)
    ranges = local_range(eshape, epl, mesh_shape, coords)
    per_dim: list[torch.Tensor] = []
    e = 0
    for d in range(len(shape)):
        parts = ranges[e:e + 2] if d in block_of else ranges[e:e + 1]
        idx = torch.zeros(1, dtype=torch.int64, device=device)
        inner = 1
        for (start, length), size in reversed(list(zip(parts, eshape[e:e + len(parts)]))):
            if start:
                OFFSET_READS[0] += 1
            ar = torch.arange(length, dtype=torch.int64, device=device) + start * offset_scale
            idx = (ar[:, None] * inner + idx[None, :]).reshape(-1)
            inner *= size
        per_dim.append(idx)
        e += len(parts)
    total = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[d] = -1
        total = total + per_dim[d].view(view) * stride
        stride *= shape[d]
    local = tuple(len(i) for i in per_dim)
    return total.expand(local).contiguous() if local else total


# -- the draws --------------------------------------------------------------------------------------

def draw(op: str, args: tuple, kwargs: dict, inputs: Sequence[torch.Tensor], index: torch.Tensor,
         key: int, out_dtype: Optional[torch.dtype] = None) -> list:
    """Op ``op``'s outputs on a block whose elements have global indices ``index``, drawn with ``key``.
    ``args``/``kwargs`` are the call's (tensors as placed by the caller), ``inputs`` its tensors."""
    x = inputs[0]
    if op == "aten.native_dropout.default":
        p = float(args[1] if len(args) > 1 else kwargs.get("p", 0.5))
        train = args[2] if len(args) > 2 else kwargs.get("train", True)
        if train is False:  # torch: an identity with an all-true mask
            return [x.clone(), torch.ones_like(x, dtype=torch.bool)]
        if p >= 1.0:
            return [torch.zeros_like(x), torch.zeros_like(x, dtype=torch.bool)]
        keep = uniform53(key, index) >= round(p * 2.0 ** 53)
        return [x * keep.to(x.dtype) * (1.0 / (1.0 - p)), keep]
    if op == "aten.bernoulli.p":
        p = float(args[1] if len(args) > 1 else kwargs.get("p", 0.5))
        return [(uniform53(key, index) < round(p * 2.0 ** 53)).to(x.dtype)]
    if op == "aten.bernoulli.default":
        return [(_unit(uniform53(key, index)) < x.to(torch.float64)).to(x.dtype)]
    dtype = out_dtype or x.dtype
    if op == "aten.rand_like.default":
        return [_unit(uniform53(key, index)).to(dtype)]
    if op == "aten.randn_like.default":  # Box-Muller on two independent draws
        u1 = 1.0 - _unit(uniform53(key, index))  # (0, 1]
        u2 = _unit(uniform53(_salted(key, 0x5851F42D4C957F2D), index))
        return [(torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).to(dtype)]
    raise NotImplementedError(f"autopar cannot draw {op}")


def draw_local(ctx: LocalCtx, inputs: Sequence[torch.Tensor], key: int) -> list:
    """This device's outputs of the random op ``ctx.call`` (its block of the whole tensor's draw)."""
    call = ctx.call
    spec = call.out_specs[0]
    assert spec is not None
    index = global_index(spec.shape, ctx.out_placements(0), ctx.mesh_shape, ctx.coords, spec.blocks,
                         ctx.offset_scale, inputs[0].device)
    args = tuple(inputs[0] if i == 0 else a for i, a in enumerate(call.args))
    return draw(call.op, args, call.kwargs, inputs, index, key, spec.dtype)


def _local(ctx: LocalCtx, inputs: list) -> list:
    """The rule's local implementation outside a program (the proof, plain ``run_local``): key 0.
    Lowered programs call ``draw_local`` with the run's key (``program.RandomOp``)."""
    return draw_local(ctx, inputs, draw_key(0, 0, ""))


@register(*SUPPORTED, local=_local)
def _random(call: OpCall) -> DimMap:
    # elementwise; never linear: a mask cannot be a partial sum, and the input of a draw is its
    # shape (or its probabilities), so P never passes
    return pointwise_map(call, [])


@register("aten.native_dropout_backward.default")
def _dropout_backward(call: OpCall) -> DimMap:
    # grad * mask * scale: linear in the gradient
    from autopar.ir.rules.generic import all_outputs, linear_in

    return pointwise_map(call, [linear_in([0], all_outputs(call))])


__all__ = ["RANDOM_BASES", "SUPPORTED", "draw", "draw_key", "draw_local", "draw_seed", "global_index", "hash_indices",
           "key_tensor",
           "is_random", "splitmix", "unsupported_random"]
