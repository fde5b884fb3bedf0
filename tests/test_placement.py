"""SBP placements: text form, DTensor conversion, and uneven shard geometry as DTensor's Shard."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate, Shard

from autopar.ir.placement import (
    B,
    P,
    Partial,
    PlacementError,
    S,
    chunk_range,
    format_placements,
    from_dtensor,
    local_shape,
    parse,
    shard_range,
    to_dtensor,
)


def test_parse_positional_and_print_roundtrip():
    pl = parse("S(0), B, P, P(max)")
    assert pl == (S(0), B, P, Partial("max"))
    assert format_placements(pl) == "S(0), B, P, P(max)"
    assert parse(format_placements(pl)) == pl


def test_parse_by_axis_name_leaves_other_axes_broadcast():
    assert parse("dp=S(0)", axis_names=["dp", "tp"]) == (S(0), B)
    assert parse("tp=S(1), dp=P", axis_names=["dp", "tp"]) == (P, S(1))


@pytest.mark.parametrize(
    "text, kw, match",
    [
        ("S(x)", {}, "cannot parse placement 'S\\(x\\)'"),
        ("Q", {}, "expected S"),
        ("", {}, "empty placement"),
        ("S(0), B", {"ndim": 3}, "has 2 entries but the mesh has 3 axes"),
        ("pp=S(0)", {"axis_names": ["dp", "tp"]}, "names mesh axis 'pp'"),
        ("dp=S(0), dp=B", {"axis_names": ["dp", "tp"]}, "twice"),
        ("dp=S(0), B", {"axis_names": ["dp", "tp"]}, "mixes named"),
        ("dp=S(0)", {}, "no mesh axis names"),
        ("P(avg)", {}, "cannot parse"),
    ],
)
def test_malformed_placements_are_clear_errors(text, kw, match):
    with pytest.raises(PlacementError, match=match):
        parse(text, **kw)


def test_dtensor_conversion_roundtrip():
    ours = (S(1), B, P, Partial("max"))
    theirs = to_dtensor(ours)
    assert theirs == (Shard(1), Replicate(), DPartial("sum"), DPartial("max"))
    assert from_dtensor(theirs) == ours
    assert parse([Shard(0), Replicate()]) == (S(0), B)


def test_uneven_split_is_dtensor_shard_not_torch_chunk():
    # 5 over 4 devices: 2, 2, 1, 0 (torch.chunk would give only 3 pieces)
    assert [chunk_range(5, 4, i)[1] for i in range(4)] == [2, 2, 1, 0]


@given(size=st.integers(0, 40), n=st.integers(1, 8))
def test_chunk_range_matches_dtensor(size, n):
    for i in range(n):
        length, offset = Shard.local_shard_size_and_offset(size, n, i)
        assert chunk_range(size, n, i) == (offset, length)


@given(size=st.integers(0, 40), n0=st.integers(1, 4), n1=st.integers(1, 4), data=st.data())
def test_nested_split_is_in_mesh_axis_order(size, n0, n1, data):
    c0 = data.draw(st.integers(0, n0 - 1))
    c1 = data.draw(st.integers(0, n1 - 1))
    l0, o0 = Shard.local_shard_size_and_offset(size, n0, c0)
    l1, o1 = Shard.local_shard_size_and_offset(l0, n1, c1)
    assert shard_range(size, [(n0, c0), (n1, c1)]) == (o0 + o1, l1)
    assert local_shape((size, 3), (S(0), S(0)), (n0, n1), (c0, c1)) == (l1, 3)
