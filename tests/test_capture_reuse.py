"""One capture for every batch size (``ir/rebatch.py``) and captures reused within a process
(``planner/captures.py``): a re-shaped graph equals a fresh capture at that batch (fingerprint and
plan), pipelined plans are the same with and without reuse, the cache key misses on every change
that changes the graph, and nothing the planner does changes a cached graph."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import _corpus
import autopar
from autopar import models
from autopar.ir.capture import capture as fresh_capture
from autopar.ir.fingerprint import graph_fingerprint, graph_info
from autopar.ir.rebatch import Unproven, probe_rows, rebatch
from autopar.planner import captures
from autopar.planner.intra import run_passes
from autopar.planner.options import PlanOptions
from autopar.planner.pipelined import micro_inputs
from autopar.planner.report import build_plan

MESH = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")


@pytest.fixture(autouse=True)
def _cold():
    """Every test starts from an empty cache (and leaves none behind)."""
    captures.clear()
    yield
    captures.clear()


def _builtin(name: str):
    model, inputs = models.make(name, size="tiny", batch=8)
    return model, inputs if isinstance(inputs, tuple) else (inputs,), {}


CASES = {
    "gpt": lambda: _builtin("gpt"),
    "llama": lambda: _builtin("llama"),
    "titan_llama": lambda: _corpus.build("titan_llama"),
    "hf_llama": lambda: _corpus.build("hf_llama"),
}


def _batch(args, kwargs) -> int:
    return next(int(v.shape[0]) for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor))


def _plan_json(model, args, kwargs, graph) -> str:
    return build_plan(run_passes(model, MESH, args, kwargs, PlanOptions(progress=False, graph=graph,
                                                                        deterministic_time=2.0))).to_json()


@pytest.mark.parametrize("name", sorted(CASES))
def test_reshaped_graph_equals_a_fresh_capture(name):
    """At two micro-batch sizes: the same fingerprint and graph facts as a capture at that size, and
    the same plan JSON from either graph; one capture (the probe) serves both sizes."""
    model, args, kwargs = CASES[name]()
    batch = _batch(args, kwargs)
    for rows in (batch // 2, batch):
        got = captures.at_rows(model, args, kwargs, batch, rows)
        margs, mkwargs = micro_inputs(args, kwargs, batch, batch // rows)
        want = fresh_capture(model, margs, mkwargs)
        assert graph_fingerprint(got) == graph_fingerprint(want)
        assert graph_info(got) == graph_info(want)
        if rows == batch // 2:
            assert _plan_json(model, margs, mkwargs, got) == _plan_json(model, margs, mkwargs, want)
    assert (captures.STATS.captured, captures.STATS.rebatched, captures.STATS.fallbacks) == (1, 2, [])


class _HalfBatch(nn.Module):
    """A loss over the first half of the batch: ``B // 2`` is no multiple of the batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x[: x.shape[0] // 2]).pow(2).mean()


def test_nonlinear_batch_sizes_fall_back_to_a_fresh_capture_saying_why():
    """A size computed from the batch other than by multiplying it (``B // 2``; an MoE's capacity
    ``ceil(1.3 * tokens * k / E)``) refuses the re-shape: that size is captured itself, the reason
    kept, and the graph equals a fresh capture. One row is always captured itself."""
    x = torch.randn(8, 8)
    model = _HalfBatch()
    got = captures.at_rows(model, (x,), {}, 8, 4)
    assert graph_fingerprint(got) == graph_fingerprint(fresh_capture(model, (x[:4],)))
    assert "no multiple of the probe batch" in captures.STATS.fallbacks[0] and "_HalfBatch at 4 rows" in \
        captures.STATS.fallbacks[0]
    moe, inputs = models.make("moe", size="tiny", batch=8, capacity_factor=1.3)
    got = captures.at_rows(moe, inputs, {}, 8, 4)
    assert graph_fingerprint(got) == graph_fingerprint(fresh_capture(moe, micro_inputs(inputs, {}, 8, 2)[0]))
    assert "MoEModel at 4 rows" in captures.STATS.fallbacks[1] and "layers.0.moe" in captures.STATS.fallbacks[1]
    gpt, args, _ = _builtin("gpt")
    probe = captures._probe(gpt, args, {}, 8, True, False)
    with pytest.raises(Unproven, match="a batch of 1 row"):
        rebatch(probe[1], probe[0], 1)


def test_probe_is_a_prime_clear_of_every_size():
    p = probe_rows([64, 50257, 3])
    assert p // 64 > 50257 and all(p % k for k in range(2, 2000))
    assert probe_rows([128256]) // 64 > 128256  # every size of the model stays below the refusal's floor


def test_pipelined_plans_are_byte_identical_with_and_without_reuse():
    """The pipeline search (schedule and micro-batches searched) on one probe capture, against a
    capture per micro-batch size: the same plan file."""
    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=4)
    mesh = autopar.Mesh({"pp": 2, "dp": 2}, device="cpu")
    with captures.reuse(False):
        plain = autopar.plan(model, mesh, inputs, progress=False, deterministic_time=2.0)
    fresh = captures.STATS.captured
    assert fresh >= 1 and captures.STATS.rebatched == 0
    captures.clear()
    reused = autopar.plan(model, mesh, inputs, progress=False, deterministic_time=2.0)
    assert reused.to_json() == plain.to_json()
    assert captures.STATS.captured == 1 and captures.STATS.rebatched >= 1
    assert "capture" in reused.phases  # the probe's capture and the re-shapes, in seconds


def test_replanning_reuses_the_capture_and_factorization_captures_twice():
    """Another mesh, another budget, a re-plan at another batch: no new capture. The factorization
    search: the full batch's capture and one probe for every micro-batch size."""
    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=4)
    a = autopar.plan(model, autopar.Mesh({"dp": 4}, device="cpu"), inputs, progress=False, deterministic_time=1.0)
    autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, device="cpu"), inputs, progress=False,
                 memory_budget="1GiB")
    again = autopar.plan(model, autopar.Mesh({"dp": 4}, device="cpu"), inputs, progress=False, deterministic_time=1.0)
    assert again.to_json() == a.to_json()
    assert (captures.STATS.captured, captures.STATS.reused) == (1, 2)
    captures.clear()
    autopar.plan(model, autopar.Mesh.devices(4, device="cpu", pp=[1, 2], tp=[1]), inputs, progress=False,
                 deterministic_time=1.0)
    assert captures.STATS.captured == 2 and captures.STATS.rebatched >= 1
    # a re-plan at another batch is re-shaped from the probe of the same kind (the loss alone, as pipelines run)
    double = tuple(torch.cat([t, t]) for t in inputs)
    autopar.plan(model, autopar.Mesh({"pp": 2, "dp": 2}, device="cpu"), double, progress=False, deterministic_time=1.0)
    assert captures.STATS.captured == 2 and not captures.STATS.fallbacks


def _key(model, args, kwargs=None, **kw):
    return captures.capture_key(model, args, kwargs or {}, **dict(dict(training=True, outputs=False, loss_fn=None),
                                                                **kw))


class _Alt(nn.Module):
    def __init__(self, dim=8, scale=1.0):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.scale = scale

    def forward(self, x):
        return self.lin(x).pow(2).mean() * self.scale


def _same_name_other_code():
    class _Alt(nn.Module):  # the same qualified name and structure, another forward
        def __init__(self, dim=8, scale=1.0):
            super().__init__()
            self.lin = nn.Linear(dim, dim)
            self.scale = scale

        def forward(self, x):
            return self.lin(x).abs().mean() * self.scale

    return _Alt


def test_the_key_misses_on_every_change_that_changes_the_graph():
    x = torch.randn(4, 8)
    base = _key(_Alt(), (x,))
    assert base is not None and _key(_Alt(), (x,)) == base  # equal models share it, whatever their weights
    assert _key(_Alt(), (torch.zeros(4, 8, device="meta"),)) == base  # input values and device are not read
    other = _same_name_other_code()
    assert other.__qualname__.endswith("_Alt") and _key(other(), (x,)) != base  # forward code
    assert _key(_Alt(scale=2.0), (x,)) != base  # a plain attribute
    _Alt.helper = lambda self: 1  # another method (a forward may call it), a class attribute
    assert _key(_Alt(), (x,)) != base
    _Alt.helper = 2
    assert _key(_Alt(), (x,)) != base
    del _Alt.helper
    assert _key(_Alt(dim=4), (torch.randn(4, 4),)) != base  # parameter shapes
    frozen = _Alt()
    frozen.lin.bias.requires_grad_(False)
    assert _key(frozen, (x,)) != base
    assert _key(_Alt().double(), (x,)) != base
    assert _key(_Alt().eval(), (x,)) != base  # training mode
    assert _key(_Alt(), (torch.randn(2, 8),)) != base  # input shape
    assert _key(_Alt(), (x.double(),)) != base
    assert _key(_Alt(), (x,), training=False) != base and _key(_Alt(), (x,), outputs=True) != base
    hooked = _Alt()
    hooked.lin.register_forward_hook(lambda m, i, o: o * 2)
    assert _key(hooked, (x,)) != base
    assert _key(_Alt(), (x,), loss_fn=lambda o: o.sum()) != _key(_Alt(), (x,), loss_fn=lambda o: o.mean())
    # a value the key cannot describe: not cached, never wrongly shared
    odd = _Alt()
    odd.marker = object()
    assert _key(odd, (x,)) is None
    captures.capture(odd, (x,))
    captures.capture(odd, (x,))
    assert (captures.STATS.captured, captures.STATS.reused) == (2, 0)


def _snapshot(graph) -> str:
    """Everything of a graph a pass could change, as text."""
    nodes = [(n.name, n.op, repr(n.args), repr(n.kwargs), [str(r) for r in n.inputs], [str(o) for o in n.outputs],
              [r.value for r in n.roles], n.phase.value, n.module_path) for n in graph.nodes]
    tables = [graph.params, graph.buffers, graph.inputs, {k: str(v) for k, v in graph.grads.items()},
              [str(o) for o in graph.outputs], [str(e) for e in graph.extras], graph.aliases, str(graph.loss)]
    return json.dumps([nodes, tables], default=str)


def test_planning_and_simulating_leave_the_cached_graph_as_it_was():
    """A hit is a copy (editing it leaves the cache alone), and planning, a pipelined plan's
    re-shapes and simulating change nothing of the cached graphs."""
    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=2)
    mesh = autopar.Mesh({"dp": 2}, device="cpu")
    first = captures.capture(model, inputs, outputs=True)
    before = _snapshot(first)
    first.nodes.pop()
    first.params.clear()
    first.nodes[0].outputs[0] = None
    plan = autopar.plan(model, mesh, inputs, progress=False, deterministic_time=1.0)
    autopar.plan(model, autopar.Mesh({"pp": 2}, device="cpu"), inputs, progress=False, deterministic_time=1.0)
    loss, grads = autopar.simulate(model, plan, inputs)
    assert torch.allclose(loss, model(*inputs), atol=1e-5) and grads
    (cached, _), = [v for k, v in captures._CACHE.items() if k[0] != "reshaped" and k[3]]  # with outputs
    assert _snapshot(cached) == before == _snapshot(captures.capture(model, inputs, outputs=True))
    probes = [v for v in captures._PROBES.values() if isinstance(v, tuple)]
    assert len(probes) == 1
    probe_before = _snapshot(probes[0][1])
    autopar.plan(model, autopar.Mesh({"pp": 2}, device="cpu"), inputs, progress=False, deterministic_time=1.0)
    assert _snapshot(probes[0][1]) == probe_before


def test_capture_warnings_are_shown_again_on_a_hit():
    """What a capture warns about (attention written as softmax + dropout) is said on every reuse too."""
    class Unfused(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(8, 8)

        def forward(self, x):
            a = nn.functional.dropout(torch.softmax(self.q(x) @ x.transpose(-1, -2), -1), 0.1)
            return (a @ x).sum()

    x = torch.randn(2, 4, 8)
    for _ in range(2):
        with pytest.warns(UserWarning, match="softmax"):
            captures.capture(Unfused(), (x,))
    assert captures.STATS.reused == 1
