"""Values for parameters and buffers of a model built on ``meta``.

A model planned on ``meta`` has no values. ``full_value`` rebuilds one tensor by running the
initialisation of the module that owns it (``reset_parameters()``, else ``init_weights()``, the
name model-level initialisers such as the zoo's Llama use for buffers like RoPE tables) on an empty
CPU copy of that one module, with the random stream seeded from the module's path: every rank
computes the same values without talking to the others, and only one module's tensors are ever
whole in memory, never the model's (the copy's submodules stay on ``meta``, so an initialiser that
walks them costs nothing there). Each rank then keeps its own block.

The values are those initialisers' own, not whatever a model's constructor does afterwards: the
zoo's GPT, say, re-initialises its weights in ``GPT.init_weights`` (N(0, 0.02)), while a GPT built
on ``meta`` gets ``nn.Linear``/``nn.Embedding``'s defaults. To start from particular weights, load
a ``torch.distributed.checkpoint`` into the ParallelModule's ``state_dict()`` after compiling.
"""

from __future__ import annotations

import copy
import hashlib

import torch

from autopar import _torch_compat as tc
from autopar.errors import MaterializeError

#: The methods that may rebuild a module's own tensors, in order of preference.
INITIALISERS = ("reset_parameters", "init_weights")

#: Added to every module's seed, so a run can choose another initialisation (``torch.manual_seed``
#: of the caller does not reach here: the per-module seed must not depend on what ran before).
BASE_SEED = 0


def _seed(path: str) -> int:
    return (int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "little") + BASE_SEED) % (2**63)


def _meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` in which every parameter and buffer of its subtree is a fresh meta
    tensor of the same (global) shape and dtype.

    The owner's other tensors may already be this rank's DTensors (``compile`` replaces them one by
    one, so a module's weight is a DTensor by the time its bias is rebuilt), or real data. Copying
    those would be wrong three ways: a sharded DTensor cannot be deep-copied at all ("invalid python
    storage"), ``reset_parameters`` would then run random ops on DTensors (a per-rank RNG, and
    collectives on some ranks only), and real data would be copied for nothing. Tied tensors stay
    tied in the copy (one placeholder per tensor)."""
    memo: dict[int, object] = {}
    for sub in module.modules():
        for table in (tc.parameter_table(sub), tc.buffer_table(sub)):
            for t in table.values():
                if t is None or id(t) in memo:
                    continue
                ph = torch.empty(t.shape, dtype=t.dtype, device="meta")
                if isinstance(t, torch.nn.Parameter):
                    ph = torch.nn.Parameter(ph, requires_grad=t.requires_grad)
                memo[id(t)] = ph
    return copy.deepcopy(module, memo)


def full_value(model: torch.nn.Module, fqn: str, t: torch.Tensor) -> torch.Tensor:
    """The whole value of ``model``'s tensor ``fqn`` (``t``), rebuilt if it lives on ``meta``."""
    if not t.is_meta:
        return t.detach()
    path, _, name = fqn.rpartition(".")
    owner = model.get_submodule(path)
    where = f"{path or '<root>'!r} ({type(owner).__name__})"
    init = next((m for m in INITIALISERS if callable(getattr(owner, m, None))), None)
    if init is None:
        raise MaterializeError(
            f"{fqn!r} lives on the meta device and its module {where} has no "
            f"{' or '.join(f'{m}()' for m in INITIALISERS)} to rebuild it: build the model on CPU, "
            f"or give {type(owner).__name__} a reset_parameters() that initialises {name!r}")
    clone = _meta_copy(owner).to_empty(device="cpu", recurse=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed(path))
        with torch.no_grad():
            getattr(clone, init)()
    value = getattr(clone, name)
    if not isinstance(value, torch.Tensor) or value.is_meta:
        raise MaterializeError(f"{fqn!r} is still on meta after {where}.{init}(): it cannot be rebuilt")
    return value.detach()


__all__ = ["BASE_SEED", "INITIALISERS", "MaterializeError", "full_value"]
