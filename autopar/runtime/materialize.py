"""Values for parameters and buffers of a model built on ``meta``.

A model planned on ``meta`` has no values. ``full_value`` rebuilds one tensor by running the
initialisation of the module that owns it (``reset_parameters``) on an empty CPU copy of that one
module, with the random stream seeded from the module's path: every rank computes the same values
without talking to the others, and only one module's tensors are ever whole in memory, never the
model's. Each rank then keeps its own block. To start from trained weights instead, load a
``torch.distributed.checkpoint`` into the ParallelModule's ``state_dict()`` after compiling.
"""

from __future__ import annotations

import copy
import hashlib

import torch

from autopar.errors import AutoparError

#: Added to every module's seed, so a run can choose another initialisation (``torch.manual_seed``
#: of the caller does not reach here: the per-module seed must not depend on what ran before).
BASE_SEED = 0


class MaterializeError(AutoparError):
    """A meta tensor whose values cannot be rebuilt."""


def _seed(path: str) -> int:
    return (int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "little") + BASE_SEED) % (2**63)


def full_value(model: torch.nn.Module, fqn: str, t: torch.Tensor) -> torch.Tensor:
    """The whole value of ``model``'s tensor ``fqn`` (``t``), rebuilt if it lives on ``meta``."""
    if not t.is_meta:
        return t.detach()
    path, _, name = fqn.rpartition(".")
    owner = model.get_submodule(path)
    if not callable(getattr(owner, "reset_parameters", None)):
        raise MaterializeError(
            f"{fqn!r} lives on the meta device and its module {path or '<root>'!r} ({type(owner).__name__}) has "
            "no reset_parameters() to rebuild it: build the model on CPU, give the module a reset_parameters(), "
            "or load a torch.distributed.checkpoint into the compiled module's state_dict()")
    clone = copy.deepcopy(owner).to_empty(device="cpu", recurse=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed(path))
        with torch.no_grad():
            clone.reset_parameters()
    value = getattr(clone, name)
    if not isinstance(value, torch.Tensor) or value.is_meta:
        raise MaterializeError(f"{fqn!r} is still on meta after {path or '<root>'}.reset_parameters(): it cannot be rebuilt")
    return value.detach()


__all__ = ["BASE_SEED", "MaterializeError", "full_value"]
