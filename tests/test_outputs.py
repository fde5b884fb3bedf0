"""The compiled step returns what the model returns: a Hugging Face ``ModelOutput``, a dict, a
dataclass, a tuple or a tensor, with the loss in its place and every other output too, each equal
to the single-device model's; ``loss_fn=`` for models that return logits. The simulator runs every
device; one case runs on 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _outputs_helpers import Classifier, Out, build, cross_entropy, outputs_on_rank

import autopar
from autopar import StepOutput
from autopar.errors import ArgumentError, CaptureError

MESH = {"dp": 2, "tp": 2}


def _mesh(axes=MESH) -> autopar.Mesh:
    return autopar.Mesh(dict(axes), device="cpu")


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    assert type(got) is torch.Tensor, type(got)  # the simulator hands back whole plain tensors
    torch.testing.assert_close(got.detach(), want.detach(), rtol=tol, atol=tol)


def _grads_close(grads: dict, model: nn.Module, tol: float = 1e-5) -> None:
    for name, p in model.named_parameters():
        _close(grads[name], p.grad, tol)


def _plan(model, args, kwargs=None, axes=MESH, **kw):
    return autopar.plan(model, _mesh(axes), args, kwargs, progress=False, deterministic_time=0.3, **kw)


class _LogitsOf(nn.Module):
    """A built-in model's logits (``GPT.logits`` / ``Llama.logits``) as its forward: the usual
    model that leaves the loss to the training loop."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(tokens)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_builtin_models_returning_logits_train_with_loss_fn(family):
    """GPT and LLaMA returning logits, with ``loss_fn(output, target)`` and the target as
    ``target=``: the step's loss, logits and every gradient equal one device's."""
    from autopar.models import make

    torch.manual_seed(0)
    inner, (tokens, targets) = make(family, "tiny", batch=4)
    model = _LogitsOf(inner)
    plan = _plan(model, (tokens,), {"target": targets}, loss_fn=cross_entropy)
    out, grads = autopar.simulate(model, plan, (tokens,), {"target": targets}, loss_fn=cross_entropy)
    logits = model(tokens)
    loss = cross_entropy(logits, targets)
    loss.backward()
    assert isinstance(out, StepOutput)
    _close(out.loss, loss)
    _close(out.output, logits)
    _grads_close(grads, model)


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_hugging_face_model_output_comes_back_with_loss_and_logits(name):
    """Hugging Face GPT-2 and LLaMA (shrunk) return their ``ModelOutput`` class: ``out.loss`` and
    ``out.logits`` equal one device's, the key-value cache object (which autopar does not rebuild)
    is None, and the gradients match."""
    import _corpus

    torch.manual_seed(0)
    model, args, kwargs = getattr(_corpus, name)()
    plan = _plan(model, args, kwargs)
    out, grads = autopar.simulate(model, plan, args, kwargs)
    want = model(*args, **kwargs)
    want.loss.backward()
    assert type(out) is type(want)
    _close(out.loss, want.loss)
    _close(out.logits, want.logits)
    assert [k for k in out.keys() if out[k] is not None] == ["loss", "logits"]
    _grads_close(grads, model, 1e-4)


@pytest.mark.parametrize("returns", ["tuple", "dict", "dataclass"])
def test_loss_with_other_outputs_in_any_structure(returns):
    """``(loss, accuracy)``, a dict with logits, accuracy, a constant and the loss again (detached),
    and a dataclass: each
    comes back in its own structure, every output equal to one device's."""
    model, (x, y) = build(returns)
    plan = _plan(model, (x, y))
    out, grads = autopar.simulate(model, plan, (x, y))
    want = model(x, y)
    if returns == "tuple":
        want[0].backward()
        assert type(out) is tuple and len(out) == 2
        _close(out[0], want[0])
        _close(out[1], want[1])
    elif returns == "dict":
        want["loss"].backward()
        assert list(out) == ["loss", "logits", "acc", "n", "again"] and out["n"] == 3
        for k in ("loss", "logits", "acc", "again"):
            _close(out[k], want[k])
    else:
        want.loss.backward()
        assert type(out) is Out and out.note is None
        _close(out.loss, want.loss)
        _close(out.logits, want.logits)
    _grads_close(grads, model)


def test_inference_returns_the_model_structure():
    """``training=False``: the dict comes back with every tensor output and the constant."""
    model, (x, y) = build("dict")
    plan = _plan(model, (x, y), training=False)
    out, grads = autopar.simulate(model, plan, (x, y))
    with torch.no_grad():
        want = model(x, y)
    assert grads == {} and out["n"] == 3
    for k in ("loss", "logits", "acc"):
        _close(out[k], want[k])


def test_loss_fn_without_target_and_eval():
    """``loss_fn(output)`` (no ``target=``): the loss of the output alone; and an inference plan with
    ``loss_fn`` returns the evaluation loss with the output."""
    model, (x, _) = build("logits")
    fn = lambda logits: logits.square().mean()  # noqa: E731
    for training in (True, False):
        plan = _plan(model, (x,), loss_fn=fn, training=training)
        out, _ = autopar.simulate(model, plan, (x,), loss_fn=fn)
        with torch.set_grad_enabled(training):
            logits = model(x)
        _close(out.loss, fn(logits))
        _close(out.output, logits)


def test_plan_made_from_a_loss_only_graph_runs_with_the_loss_alone():
    """A plan made from a graph captured without the other outputs (``plan(graph=capture(...))``)
    still simulates: the step is the one it was planned for, and returns the loss alone."""
    from autopar.ir.capture import capture

    model, (x, y) = build("dict")
    plan = _plan(model, (x, y), graph=capture(model, (x, y)))
    loss, _ = autopar.simulate(model, plan, (x, y))
    _close(loss, model(x, y)["loss"])


def test_extra_outputs_are_priced_until_returned():
    """The logits a model returns live until the step ends: the plan's peak holds them on top of
    what the loss-only step holds (their block is at least the whole logits over 4 devices)."""
    with_logits, (x, y) = build("dict", batch=64)
    loss_only = Classifier("tuple")
    loss_only.load_state_dict(with_logits.state_dict())
    a = _plan(with_logits, (x, y), recipe="ddp")
    b = _plan(loss_only, (x, y), recipe="ddp")
    assert a.peak_memory - b.peak_memory >= 64 * 8 * 4 / 4


def test_errors_name_the_problem():
    """A model returning logits without ``loss_fn`` is told to pass one; a ``loss_fn`` closing over
    its target, or one that is not callable, is refused; pipelines refuse ``loss_fn``."""
    model, (x, y) = build("logits")
    with pytest.raises(CaptureError, match=r"training capture needs a loss, but the model returned a float32 tensor "
                                           r"of shape \(8, 8\)\. Pass loss_fn="):
        _plan(model, (x,))
    with pytest.raises(CaptureError, match=r"^loss_fn closes over a tensor of shape \(8,\): .* target="):
        _plan(model, (x,), loss_fn=lambda out: cross_entropy(out, y))
    with pytest.raises(ArgumentError, match=r"^autopar.plan: loss_fn must be a callable"):
        _plan(model, (x,), loss_fn="cross_entropy")
    with pytest.raises(ArgumentError, match=r"^autopar.simulate: loss_fn must be a callable"):
        autopar.simulate(model, _plan(Classifier("tuple"), (x, y)), (x, y), loss_fn=3)
    with pytest.raises(ArgumentError, match=r"^autopar.plan: loss_fn= works with unpipelined plans"):
        _plan(model, (x,), {"target": y}, axes={"pp": 2, "dp": 2}, loss_fn=cross_entropy)


def test_pipelined_plans_return_the_loss_alone():
    """Under a pipeline the step returns the loss (equal to one device's), not the dict; a
    ``loss_fn`` is refused with the reason."""
    from autopar.models import make

    torch.manual_seed(0)
    inner, (tokens, targets) = make("gpt", "tiny", batch=4)
    plan = autopar.plan(inner, _mesh({"pp": 2, "dp": 1}), (tokens, targets), progress=False,
                        deterministic_time=0.3, pipeline={"schedule": "GPipe", "microbatches": 2})
    loss, _ = autopar.simulate(inner, plan, (tokens, targets))
    _close(loss, inner(tokens, targets))
    with pytest.raises(ArgumentError, match=r"loss_fn= \(it returns the loss alone\)"):
        autopar.simulate(inner, plan, (tokens, targets), loss_fn=cross_entropy)


# -- gloo ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(gloo_pool4):
    """Four gloo ranks: the pytest process's shared pool (tests/conftest.py)."""
    return gloo_pool4()


def test_gloo_compiled_module_returns_the_model_outputs(pool):
    """On 4 gloo ranks (dp x tp = 2 x 2): the dict model's step returns its dict, the logits a DTensor
    with the plan's placements (``outputs="local"``: its block), each output and every gradient equal
    to one device's; the logits-returning model with ``loss_fn`` and ``outputs="full"`` returns
    ``StepOutput`` with whole plain logits."""
    model, (x, y) = build("dict")
    plan = _plan(model, (x, y))
    for rank, r in enumerate(pool.run(outputs_on_rank, plan.to_json())):
        assert r["dict_type"] == "dict" and r["n"] == 3, (rank, r)
        assert r["keys"] == ["loss", "logits", "acc", "n", "again"], (rank, r)
        assert r["logits_is_dtensor"] and r["local_is_block"], (rank, r)
        assert max(r[k] for k in ("loss", "logits", "acc", "again", "grads")) <= 1e-5, (rank, r)
        assert r["step_type"] == "StepOutput" and r["full_is_plain"], (rank, r)
        assert max(r[k] for k in ("fn_loss", "fn_logits", "fn_grads")) <= 1e-5, (rank, r)
