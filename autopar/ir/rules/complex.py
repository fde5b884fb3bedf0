"""Rules for complex numbers as rotary embeddings use them (torchtitan's Llama 3 RoPE):
``view_as_complex`` / ``view_as_real`` and the conjugate that their backward takes.

``view_as_complex`` reads a real tensor's last dim of 2 (real, imaginary) as one complex element;
that dim never splits, every other dim maps one to one. Both views and the conjugate are linear
(over the reals), so partial sums pass through them. Complex ``mul`` is the ordinary pointwise
``mul`` rule (``generic.py``): complex tensors count as floating for partial sums.
"""

from __future__ import annotations

import torch

from autopar.ir.rules.base import LocalCtx, OpCall, register
from autopar.ir.rules.dimmap import DimMap
from autopar.ir.rules.generic import float_flags, linear_in, pointwise_map


def _pair_map(call: OpCall, real_is_input: bool) -> DimMap:
    """Dims of the complex tensor shared with the real one; the real one's last dim is the pair."""
    cplx = call.out_specs[0] if real_is_input else call.in_specs[0]
    assert cplx is not None
    names = [f"d{i}" for i in range(cplx.ndim)]
    complex_dims = [(n,) for n in names]
    real_dims = complex_dims + [("_pair",)]
    fi, fo = float_flags(call)
    ins, outs = (real_dims, complex_dims) if real_is_input else (complex_dims, real_dims)
    return DimMap(
        [ins], [outs], dict(zip(names, cplx.shape)) | {"_pair": 2}, no_split=frozenset({"_pair"}),
        linear=[linear_in([0], [0])], float_inputs=fi, float_outputs=fo,
    )


def _view_as_complex_local(ctx: LocalCtx, xs: list) -> torch.Tensor:
    """``view_as_complex`` of this device's block: a block that is not laid out as (re, im) pairs
    (a strided piece of a larger tensor) is made dense first."""
    x = xs[0]
    if x.stride(-1) != 1 or x.storage_offset() % 2 or any(s % 2 for s in x.stride()[:-1]):
        x = x.contiguous()
    return torch.view_as_complex(x)


@register("aten.view_as_complex.default", local=_view_as_complex_local)
def _view_as_complex(call: OpCall) -> DimMap:
    return _pair_map(call, real_is_input=True)


@register("aten.view_as_real.default")
def _view_as_real(call: OpCall) -> DimMap:
    return _pair_map(call, real_is_input=False)


@register("aten._conj.default", "aten.conj_physical.default", "aten.resolve_conj.default")
def _conj(call: OpCall) -> DimMap:
    # conj(a + b) = conj(a) + conj(b): linear, elementwise
    return pointwise_map(call, [linear_in([0], [0])])
