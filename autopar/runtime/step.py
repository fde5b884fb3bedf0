"""The lowered program as one autograd node (``Step``), as ``autopar.compile``'s module runs it: the
forward program in the autograd forward, the backward program in the autograd backward, and the
gradients delivered as DTensors placed like their parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from autopar import _torch_compat as tc

if TYPE_CHECKING:  # annotations only: the module is the driver's
    from autopar.parallel import ParallelModule


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local block, without ``to_local``'s autograd node (programs run without grad)."""
    return tc.local_tensor(t)


class Step(torch.autograd.Function):
    """The lowered program as one autograd node: forward runs the forward program, backward the
    backward program seeded with the loss's incoming gradient.

    It takes the parameters themselves (DTensors) and returns their gradients as DTensors with
    the parameters' own specs, built directly: a ``to_local`` / ``from_local`` pair per parameter
    and step costs more than a small model's whole step on CPU. Under a plain ``backward()`` it
    stores them in ``.grad`` itself (``deliver``) rather than through autograd's accumulation."""

    @staticmethod
    def forward(ctx, pm: "ParallelModule", n_params: int, *values):
        params = values[:n_params]
        # the backward redraws this forward's masks (attention with dropout): it runs at this step
        ctx.step = pm.program.random.step if pm.program.random is not None else None
        memory = pm._memory
        if memory is not None:
            pm._begin_memory(params, values[n_params:])
        outs, saved = pm._run_forward([_local(p) for p in params] + list(values[n_params:]))
        if memory is not None:
            memory.mark(saved, "activations")
        ctx.pm, ctx.saved, ctx.n_params, ctx.params = pm, saved, n_params, params
        ctx.specs = [tc.dtensor_spec(p) for p in params]
        extras = [o.detach() if o is outs[0] else o for o in outs[1:]]  # the loss returned again: its own tensor
        ctx.mark_non_differentiable(*extras)  # the model's other outputs: the gradient is the loss's
        return (outs[0], *extras)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        pm = ctx.pm
        grads = pm._run_backward(ctx.saved, grad_loss, ctx.step)
        if pm._memory is not None:
            pm._memory.mark(grads, "grads")
            pm._memory.finish()
        ctx.saved = None
        grads = [tc.dtensor_from_spec(g, spec) for g, spec in zip(grads, ctx.specs)]
        rest = [None] * (len(pm.program.inputs) - ctx.n_params)
        params, ctx.params = ctx.params, None
        if deliver(ctx, params, grads):
            return (None, None, *([None] * len(grads)), *rest)
        return (None, None, *grads, *rest)


def deliver(ctx, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
    """Store the gradients in ``.grad`` as autograd's accumulation would (set, or add to the one
    there), when this backward is a plain ``backward()`` reaching every parameter; False (nothing
    stored) otherwise, and autograd accumulates the returned gradients itself.

    Why: autograd's accumulation detaches each DTensor gradient, a Python dispatch of DTensor's
    per parameter and step (about 45 us each on CPU, a millisecond of a small GPT's DDP step).
    It is skipped only where nothing can tell: no gradient graph is being built (``create_graph``),
    every parameter's accumulation node is its own and will run in this backward (not
    ``autograd.grad``, which raises on the question, nor ``backward(inputs=...)`` leaving some
    out), and no parameter has a tensor hook or a post-accumulate-grad hook (a hook registered
    on the accumulation node itself is not visible here and would not run)."""
    if torch.is_grad_enabled():
        return False
    nodes = ctx.next_functions[:len(params)]  # one per tensor input: the parameters come first
    if len(nodes) != len(params):
        return False
    for (node, _), p in zip(nodes, params):
        if node is None:  # a parameter that does not require grad gets none
            continue
        if getattr(node, "variable", None) is not p or tc.has_grad_hooks(p):
            return False
        try:
            if not tc.will_engine_execute(node):
                return False
        except RuntimeError:  # autograd.grad(): gradients are returned, not accumulated
            return False
    for (node, _), p, g in zip(nodes, params, grads):
        if node is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)
    return True


__all__ = ["Step", "deliver"]
