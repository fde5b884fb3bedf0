"""The price of dropless expert parallelism (``cost_model/experts.py``): the exchange at the
imbalanced load, counted where the rows sorted by expert sit, against the routing that
``ir/rules/expert.py`` executes; one exchange per tagged axis on its own link."""

from __future__ import annotations

import itertools

import pytest

import autopar
from autopar.cost_model import experts as pricing
from autopar.ir.placement import B, Split
from autopar.ir.rules.base import LocalCtx
from autopar.ir.rules.dimmap import Signature
from test_dropless import _call, _experts


def _price(strategy, a, b, mesh, **kw):
    """``exchange_time`` of a rows-form product ``a [T, K] @ b [E, K, N]`` under ``strategy``."""
    places = [tuple(sig.inputs[i] for sig in strategy) for i in range(2)]
    out = tuple(sig.outputs[0] for sig in strategy)
    return pricing.exchange_time(strategy, [a, b], places, (a[0], b[2]), out, 2, mesh, **kw)


def test_exchange_priced_at_the_imbalanced_load():
    """The exchange grows with the imbalance factor and the rows moved; other strategies pay none."""
    mesh = autopar.Mesh({"ep": 8}, device="h100")
    strat = (_experts("rows"),)
    t, grow = _price(strat, (4096 * 8, 2048), (16, 2048, 1024), mesh)
    assert t > 0 and grow == pytest.approx(pricing.IMBALANCE)
    assert _price(strat, (4096 * 8, 2048), (16, 2048, 1024), mesh, imbalance=2.0)[0] > t
    assert _price(strat, (8192 * 8, 2048), (16, 2048, 1024), mesh)[0] > t
    assert _price((Signature((B, B, B), (B,)),), (4096 * 8, 2048), (16, 2048, 1024), mesh)[0] == 0.0


def _route_rows(strategy, mesh_shape, t, e):
    """The most rows one device sends or receives, and runs, when ``rules.expert`` routes ``t`` rows
    evenly over ``e`` experts (a rows-form product) on every device of ``mesh_shape``."""
    from autopar.ir.rules.expert import _Route

    call = _call("rows", t, 4, 4, e)
    offs = [t * (i + 1) // e for i in range(e)]
    moved = held = 0
    for coords in itertools.product(*[range(n) for n in mesh_shape]):
        route = _Route(LocalCtx(call, strategy, tuple(mesh_shape), coords), offs, "rows")
        for _, send, recv, _ in route.stages:
            mine = sum(recv[i] for i in range(len(recv)) if i != coords[_axis_of(strategy)])
            sent = sum(send[i] for i in range(len(send)) if i != coords[_axis_of(strategy)])
            moved = max(moved, mine, sent)
        held = max(held, sum(route.counts))
    return moved, held


def _axis_of(strategy) -> int:
    return next(i for i, s in enumerate(strategy) if s.tag == "experts")


def test_exchange_priced_where_the_sorted_rows_sit():
    """The rows are sorted by expert, so at an even load the rows a device holds may already be its
    experts' (the rows split on the experts' axis, outer axes first, line up with the experts) or
    may all belong to one member of the group (the rows split on an outer axis first): the price
    counts the rows the executed routing moves and runs, not ``(n-1)/n`` of every device's rows."""
    rows = Signature((Split(0), B, B), (Split(0),), "S:t")
    other = Signature((B, Split(2), B), (Split(1),), "S:n")
    t, e = 256, 16
    for mesh, strategy in [((4,), (_experts("rows"),)), ((2, 4), (_experts("rows"), rows)),
                           ((2, 4), (rows, _experts("rows"))), ((2, 4), (other, _experts("rows"))),
                           ((4, 2), (_experts("rows"), other))]:
        places = [tuple(sig.inputs[i] for sig in strategy) for i in range(2)]
        got = pricing.expected_rows(strategy, (t, 4), places[0], 0, (e, 4, 4), places[1], mesh, imbalance=1.0)
        assert got == pytest.approx(_route_rows(strategy, mesh, t, e)), (mesh, strategy)
    # experts on the outer axis over rows split on both: nothing moves at an even load
    assert pricing.expected_rows((_experts("rows"), rows), (t, 4), (Split(0), Split(0)), 0, (e, 4, 4),
                                 (Split(0), B), (2, 4), imbalance=1.0) == (0.0, t / 8)
    # experts on the inner axis (4 x 4 experts): every row of an outer group goes to one member
    assert pricing.expected_rows((rows, _experts("rows")), (t, 4), (Split(0), Split(0)), 0, (e, 4, 4),
                                 (B, Split(0)), (4, 4), imbalance=1.0) == (t / 4 - t / 16, t / 4)
    # the price follows: on (8, 8) H100s, experts on dp over rows split on dp x tp move little
    mesh = autopar.Mesh({"dp": 8, "tp": 8}, device="h100")
    a, b = (64 * 131072, 2048), (128, 2048, 768)
    from autopar.cost_model.comm import collective_time

    aligned = _price((_experts("rows"), rows), a, b, mesh)
    inner = _price((rows, _experts("rows")), a, b, mesh)
    # (n-1)/n of each device's 131072 rows, sent at the imbalance and their products taken back
    mixed = sum(collective_time("all_to_all", 8 * 131072 * w * 2 * pricing.IMBALANCE, 8, mesh.links[0])
                for w in (2048, 768))
    assert aligned[0] < mixed / 3 and aligned[1] == pytest.approx(pricing.IMBALANCE)
    assert inner[1] == pytest.approx(8 * pricing.IMBALANCE)


def test_experts_over_two_axes_priced_per_axis_and_per_expert_rows():
    """Experts over two axes pay one exchange per axis, each on its own link (dp crosses nodes on
    (8, 8) H100s, tp does not); a grouped product's GEMM is priced at one expert's rows, so the
    same local rows over fewer local experts (expert parallelism) run at a higher efficiency."""
    from autopar.cost_model.compute import efficiency_of

    mesh = autopar.Mesh({"dp": 8, "tp": 8}, device="h100")
    whole = Signature((B, B, B), (B,))
    # the same local rows (4096) on each device, lined up with its experts
    dp = _price((_experts("rows"), whole), (4096 * 8, 2048), (128, 2048, 1024), mesh)[0]
    tp = _price((whole, _experts("rows")), (4096 * 8, 2048), (128, 2048, 1024), mesh)[0]
    both = _price((_experts("rows"), _experts("rows")), (4096 * 64, 2048), (128, 2048, 1024), mesh)[0]
    assert dp > tp > 0 and both == pytest.approx(dp + tp)
    call = _call("rows", 4096, 2048, 1024, 128)
    hw = mesh.hardware
    few = efficiency_of(call, [(4096, 2048), (2, 2048, 1024)], [(4096, 1024)], hw)
    many = efficiency_of(call, [(4096, 2048), (128, 2048, 1024)], [(4096, 1024)], hw)
    assert few > many
