"""``autopar.compile(..., compile=...)``: rank programs run through ``torch.compile``.

The compiled programs must compute what the eager ones compute (aot_eager traces the same aten ops,
so losses and parameters agree to the last bit), without a graph break where the program has no
random op, on a real gloo group (the shared 4-rank pool). Inductor's cold compile takes minutes on
this machine, so its step times are measured by ``benchmarks/compiled.py``, not here.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import CompileError
from autopar.models import make


def _run(backend, steps: int, optimizer, **model_kw):
    """A dp=2 x tp=2 run of a tiny model compiled with ``backend``: the module, each step's loss and
    the graph breaks dynamo counted after each step (dynamo starts afresh and is reset after)."""
    from autopar import _torch_compat as tc

    tc.reset_dynamo()
    torch.manual_seed(0)
    model, inputs = make(batch=4, **model_kw)
    pm = autopar.compile(model, autopar.Mesh({"dp": 2, "tp": 2}, device="cpu"), inputs, compile=backend)
    opt = optimizer(pm.parameters())
    before, losses, breaks = tc.graph_breaks(), [], []
    for _ in range(steps):
        loss = pm(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        breaks.append(dict(tc.graph_breaks() - before))
    tc.reset_dynamo()
    return pm, losses, breaks


def _train(family: str, backend, steps: int = 2):
    """Loss per step, the final parameters' local blocks and the graph breaks of a compiled run."""
    pm, losses, breaks = _run(backend, steps, lambda ps: torch.optim.AdamW(ps, lr=1e-2), family=family, size="tiny")
    params = {k: v.to_local().clone() for k, v in pm.state_dict().items() if isinstance(v, torch.Tensor)}
    return losses, params, breaks[-1], pm.program.compiled is not None


def _both(family: str):
    return _train(family, False), _train(family, "aot_eager")


@pytest.fixture(scope="module")
def pool(gloo_pool4):
    return gloo_pool4()


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_compiled_program_equals_eager_on_gloo(pool, family):
    for (eager, compiled) in pool.run(_both, family):
        e_losses, e_params, _, e_compiled = eager
        c_losses, c_params, breaks, c_compiled = compiled
        assert not e_compiled and c_compiled
        assert c_losses == e_losses
        assert e_params.keys() == c_params.keys()
        for k in e_params:
            assert torch.equal(e_params[k], c_params[k]), k
        assert breaks == {}, f"graph breaks in a program without random ops: {breaks}"


@pytest.mark.parametrize("bad, words", [("no-such-backend", "not a torch.compile backend"),
                                        (3, "must be True, False or a torch.compile backend")])
def test_compile_choice_is_checked_before_any_process_group(bad, words):
    model, inputs = make("mlp", "tiny", batch=4)
    with pytest.raises(CompileError, match=words):
        autopar.compile(model, autopar.Mesh({"dp": 2}, device="cpu"), inputs, compile=bad)


def _dropout(backend, steps: int = 3):
    """Losses and the graph breaks counted after each step of GPT with dropout on dp=2 x tp=2."""
    _, losses, breaks = _run(backend, steps, lambda ps: torch.optim.SGD(ps, lr=0.1), family="gpt", size="tiny",
                             dropout=0.1)
    return losses, [sum(b.values()) for b in breaks]


def test_compiled_dropout_draws_the_eager_masks_without_recompiling(pool):
    eager = pool.run(_dropout, False)
    compiled = pool.run(_dropout, "aot_eager")
    for (e_losses, _), (c_losses, breaks) in zip(eager, compiled):
        assert c_losses == e_losses
        # each random op is a graph break (its key is computed at run time), made once: a later
        # step's new key is data, not a reason to compile again
        assert breaks[0] > 0 and breaks == [breaks[0]] * len(breaks), breaks


@pytest.mark.slow
def test_pipelined_stages_compile_in_the_simulator():
    """Every stage's forward and backward of a pp=2 x dp=2 plan compiled: the simulated step equals
    the eager one exactly, and the only graph breaks are the simulator's own exchanges (collectives
    between threads, which a compiled program calls as Python)."""
    from autopar import _torch_compat as tc

    tc.reset_dynamo()
    torch.manual_seed(0)
    model, inputs = make("gpt", "tiny", batch=8)
    plan = autopar.plan(model, autopar.Mesh({"pp": 2, "dp": 2}, device="cpu"), inputs,
                        pipeline={"schedule": "1F1B", "microbatches": 2})
    eager_loss, eager_grads = autopar.simulate(model, plan, inputs)
    before = tc.graph_breaks()
    loss, grads = autopar.simulate(model, plan, inputs, compile="aot_eager")
    breaks = tc.graph_breaks() - before
    tc.reset_dynamo()
    assert float(loss) == float(eager_loss)
    assert grads.keys() == eager_grads.keys() and all(torch.equal(grads[k], eager_grads[k]) for k in grads)
    assert sum(breaks.values()) > 0 and all("ThreadComm" in reason for reason in breaks), dict(breaks)
