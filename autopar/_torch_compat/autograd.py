"""Autograd-engine and storage bindings in ``torch._C`` (torch 2.13):
``_will_engine_execute_node``, a tensor's private hook tables (``_backward_hooks``,
``_post_accumulate_grad_hooks``) and ``_storage_Use_Count``.

On a torch upgrade: check that ``_will_engine_execute_node`` still answers for the running
backward and raises ``RuntimeError`` under ``torch.autograd.grad``; that a tensor's hooks still
live in those two attributes (``ParallelModule``'s ``_deliver`` must see every hook to skip
autograd's accumulation safely); and that ``_storage_Use_Count`` still counts references to a
storage's implementation (``tests/test_private_api.py`` checks ``storage_use_count``).
"""

from __future__ import annotations

from typing import Any

import torch


def will_engine_execute(node: Any) -> bool:
    """Whether the running ``backward()`` will execute autograd ``node``. Raises ``RuntimeError``
    outside a backward or under ``torch.autograd.grad`` (which returns gradients, and never
    executes accumulation nodes)."""
    return bool(torch._C._will_engine_execute_node(node))


def has_grad_hooks(t: torch.Tensor) -> bool:
    """Whether tensor ``t`` has a hook on its gradient (``register_hook``) or a post-accumulate-grad
    hook (``register_post_accumulate_grad_hook``)."""
    return bool(t._backward_hooks) or bool(getattr(t, "_post_accumulate_grad_hooks", None))


def storage_use_count(t: torch.Tensor) -> int:
    """How many tensors and storage objects hold ``t``'s memory (``t`` itself included), not
    counting the storage object this call makes to ask: 1 when no other tensor shares it."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


__all__ = ["has_grad_hooks", "storage_use_count", "will_engine_execute"]
