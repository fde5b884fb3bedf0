"""``program.bucket``: ``Bucket`` packs gradients into one flat buffer that it keeps between steps
only while nothing else views that buffer's memory (a gradient still held gets a fresh buffer and
keeps its values), and ``unflatten`` cuts the buffer back exactly."""

from __future__ import annotations

import torch

from autopar.program.bucket import Bucket, unflatten

SHAPES = [[3, 4], [5], [2, 1, 3]]


def _grads(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]


def test_pack_and_unpack_round_trip_exactly():
    xs = _grads(0)
    flat = Bucket().pack(xs)
    assert flat.shape == (sum(x.numel() for x in xs),) and flat.dtype == torch.float32
    assert torch.equal(flat, torch.cat([x.reshape(-1) for x in xs]))
    parts = unflatten(flat, SHAPES)
    assert [list(p.shape) for p in parts] == SHAPES
    for p, x in zip(parts, xs):
        assert torch.equal(p, x)
        assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # views, no copy
    # the packed buffer is never a view of an input: reducing it in place leaves the inputs alone
    kept = [x.clone() for x in xs]
    flat.mul_(2)
    assert all(torch.equal(x, k) for x, k in zip(xs, kept))


def test_buffer_is_reused_when_nothing_else_views_it():
    bucket = Bucket()
    flat = bucket.pack(_grads(0))
    ptr = flat.data_ptr()
    parts = unflatten(flat, SHAPES)
    del flat, parts  # the step's gradients were dropped (zero_grad(set_to_none=True))
    xs = _grads(1)
    flat = bucket.pack(xs)
    assert flat.data_ptr() == ptr
    assert torch.equal(flat, torch.cat([x.reshape(-1) for x in xs]))


def test_held_gradient_gets_a_new_buffer_and_keeps_its_values():
    bucket = Bucket()
    flat = bucket.pack(_grads(0))
    ptr = flat.data_ptr()
    held = unflatten(flat, SHAPES)[1]  # one gradient view still held by the caller
    expected = held.clone()
    del flat
    xs = _grads(1)
    new = bucket.pack(xs)
    assert new.data_ptr() != ptr
    assert torch.equal(held, expected)  # not overwritten by the second step
    assert torch.equal(new, torch.cat([x.reshape(-1) for x in xs]))
    # once the held view is dropped, the buffer of the second step is kept for the third
    ptr2 = new.data_ptr()
    del held, new
    assert bucket.pack(_grads(2)).data_ptr() == ptr2


def test_new_buffer_when_size_or_dtype_changes():
    bucket = Bucket()
    flat = bucket.pack(_grads(0))
    ptr = flat.data_ptr()
    del flat
    xs = _grads(1, torch.float64)
    flat = bucket.pack(xs)
    assert flat.dtype == torch.float64 and flat.data_ptr() != ptr
    assert torch.equal(flat, torch.cat([x.reshape(-1) for x in xs]))
    del flat
    xs = _grads(2, torch.float64)[:2]
    flat = bucket.pack(xs)
    assert flat.numel() == sum(x.numel() for x in xs)
    assert torch.equal(flat, torch.cat([x.reshape(-1) for x in xs]))
