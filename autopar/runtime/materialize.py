"""Values for parameters and buffers of a model built on ``meta``.

A model planned on ``meta`` has no values. They are rebuilt through the model's own
initialisation, on a copy of the model whose tensors are all ``meta`` except the ones of the module
being rebuilt (empty CPU tensors), with the random stream seeded from that module's path: every
rank computes the same values without talking to the others, and only one module's tensors are
ever whole in memory, never the model's (initialisers touching the rest of the copy cost nothing
on ``meta``). Each rank then keeps its own block.

The initialiser of a tensor is the first of these that writes it (found once, before planning, by
running them all on the ``meta`` copy and recording what they write):

1. Hugging Face's: ``_init_weights(module)`` of the nearest ``PreTrainedModel`` (what ``post_init``
   runs), applied as ``initialize_weights`` does, children first, to the module and then to each
   of its ancestors (GPT-2's attention re-initialises its child ``c_proj``);
2. a model-level ``init_weights()``, the outermost one on the module's path first (the zoo's and
   torchtitan's models re-initialise their layers there, and keep RoPE tables in root buffers);
3. ``reset_parameters()`` of the module, then of its ancestors, nearest first.

The values follow the model's initialisation, not a CPU build's random stream. A tensor none of
them writes is named (module path and class) by ``check_materializable`` before planning starts.
To start from particular weights, load a ``torch.distributed.checkpoint`` into the
ParallelModule's ``state_dict()`` after compiling.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Optional

import torch

from autopar import _torch_compat as tc
from autopar.errors import MaterializeError

#: The module methods that may rebuild tensors, besides Hugging Face's ``_init_weights``.
INITIALISERS = ("init_weights", "reset_parameters")

#: Added to every module's seed, so a run can choose another initialisation (``torch.manual_seed``
#: of the caller does not reach here: the per-module seed must not depend on what ran before).
BASE_SEED = 0


def _seed(path: str) -> int:
    return (int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "little") + BASE_SEED) % (2**63)


def _chain(path: str) -> list[str]:
    """``path`` and its ancestors' paths, innermost first: ``a.b`` -> ``["a.b", "a", ""]``."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _own(module: torch.nn.Module) -> list[tuple[dict, str]]:
    """(table, name) of every tensor ``module`` holds itself."""
    return [(table, name) for table in (tc.parameter_table(module), tc.buffer_table(module))
            for name, t in table.items() if t is not None]


class Materializer:
    """Rebuilds the ``meta`` tensors of ``model`` (see the module docstring). Construct it before
    any of the model's tensors is replaced: it copies the model's structure, with ``meta``
    placeholders for every tensor, once."""

    def __init__(self, model: torch.nn.Module):
        memo: dict[int, object] = {}
        self.meta: dict[str, tuple[str, str]] = {}  # FQN of a meta tensor -> (owner path, attribute)
        self.canon: dict[str, str] = {}  # FQN -> the first FQN of the same tensor: tied names get one value
        first: dict[int, str] = {}
        for path, mod in model.named_modules(remove_duplicate=False):
            for table in (tc.parameter_table(mod), tc.buffer_table(mod)):
                for name, t in table.items():
                    if t is None:
                        continue
                    if t.is_meta:
                        fqn = f"{path}.{name}" if path else name
                        self.meta[fqn] = (path, name)
                        self.canon[fqn] = first.setdefault(id(t), fqn)
                    if id(t) not in memo:
                        ph = torch.empty(t.shape, dtype=t.dtype, device="meta")
                        memo[id(t)] = torch.nn.Parameter(ph, requires_grad=t.requires_grad) \
                            if isinstance(t, torch.nn.Parameter) else ph
        self.copy = copy.deepcopy(model, memo) if self.meta else None
        self._holders: dict[int, list[tuple[dict, str]]] = {}  # placeholder -> every table entry holding it
        for mod in (self.copy.modules() if self.copy is not None else ()):
            for table, name in _own(mod):
                self._holders.setdefault(id(table[name]), []).append((table, name))
        self._how: Optional[dict[str, tuple[str, str]]] = None  # FQN -> (kind, module path)
        self._cache: dict[str, dict[str, torch.Tensor]] = {}

    # -- which initialiser writes which tensor ---------------------------------------------------
    def _candidates(self, path: str) -> list[tuple[str, str]]:
        """The initialisers that may write a tensor of module ``path``, in order of preference."""
        chain = _chain(path)
        mods = {p: self.copy.get_submodule(p) for p in chain}
        out = []
        if any(callable(getattr(mods[p], "_init_weights", None)) for p in chain):
            out.append(("hf", path))
        out += [("init_weights", p) for p in reversed(chain) if callable(getattr(mods[p], "init_weights", None))]
        out += [("reset_parameters", p) for p in chain if callable(getattr(mods[p], "reset_parameters", None))]
        return out

    def _run(self, kind: str, path: str) -> None:
        """Run one initialiser on the copy (under ``no_grad``)."""
        if kind == "hf":  # Hugging Face's initialize_weights, restricted to the module's path
            chain = _chain(path)
            mods = [self.copy.get_submodule(p) for p in chain]
            for i, m in enumerate(mods):
                provider = next((a for a in mods[i:] if callable(getattr(a, "_init_weights", None))), None)
                if provider is not None:
                    provider._init_weights(m)
        else:
            getattr(self.copy.get_submodule(path), kind)()

    def plan(self) -> dict[str, tuple[str, str]]:
        """FQN of every meta tensor -> the initialiser that rebuilds it; raises ``MaterializeError``
        naming every tensor none can rebuild. Runs the initialisers on ``meta`` only."""
        if self._how is not None:
            return self._how
        by_storage: dict = {}
        placeholders = {}
        for fqn, (path, name) in self.meta.items():
            t = self._table(path, name)[name]
            placeholders[fqn] = t
            by_storage.setdefault(tc.storage_key(t), []).append(fqn)
        wrote: dict[tuple[str, str], set[str]] = {}
        errors: dict[tuple[str, str], str] = {}
        paths = sorted({p for p, _ in self.meta.values()})
        todo = {c for p in paths for c in self._candidates(p)}
        for cand in sorted(todo):
            written: set = set()
            try:
                with torch.random.fork_rng(devices=[]), torch.no_grad(), tc.record_writes(written):
                    self._run(*cand)
            except Exception as e:  # noqa: BLE001 - an initialiser that fails on meta writes nothing
                errors[cand] = f"{type(e).__name__}: {e}"
            hit = {f for key in written for f in by_storage.get(key, ())}
            for fqn, (path, name) in self.meta.items():  # an initialiser may assign a new tensor instead
                table = self._table(path, name)
                if table.get(name) is not placeholders[fqn]:
                    hit.add(fqn)
                    table[name] = placeholders[fqn]
            wrote[cand] = hit
        how, missing = {}, []
        for fqn, (path, name) in self.meta.items():
            cands = self._candidates(path)
            found = next((c for c in cands if fqn in wrote[c]), None)
            if found is None:
                missing.append((fqn, path, name, [c for c in cands if c in errors]))
            else:
                how[fqn] = found
        if missing:
            raise MaterializeError(self._explain(missing, errors))
        self._how = how
        return how

    def _table(self, path: str, name: str) -> dict:
        mod = self.copy.get_submodule(path)
        table = tc.parameter_table(mod)
        return table if name in table else tc.buffer_table(mod)

    def _explain(self, missing, errors) -> str:
        lines = []
        for fqn, path, name, failed in missing[:10]:
            cls = type(self.copy.get_submodule(path)).__name__
            why = "; ".join(f"{k}() of {p or '<root>'!r} raised {errors[(k, p)]}" for k, p in failed)
            lines.append(f"{fqn!r} in module {path or '<root>'!r} ({cls})" + (f" [{why}]" if why else ""))
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        return (f"cannot materialize {len(missing)} tensor(s) of the model built on the meta device: "
                f"{', '.join(lines)}{more}. None of the model's initialisers writes them: give the module a "
                "reset_parameters() that initialises them (or an init_weights(), or Hugging Face's "
                "_init_weights() on the model), or build the model on CPU")

    # -- values ---------------------------------------------------------------------------------
    def value(self, fqn: str) -> torch.Tensor:
        """The rebuilt whole value of meta tensor ``fqn`` (a CPU tensor; tied names get the same)."""
        fqn = self.canon[fqn]
        kind, where = self.plan()[fqn]
        path, name = self.meta[fqn]
        key = f"{kind}:{where}:{path}"
        if key not in self._cache or name not in self._cache[key]:
            self._cache[key] = self._build(kind, where, path)
        value = self._cache[key].pop(name)
        if not self._cache[key]:
            del self._cache[key]
        return value

    def _build(self, kind: str, where: str, path: str) -> dict[str, torch.Tensor]:
        """Every tensor of module ``path`` that the initialiser ``(kind, where)`` rebuilds."""
        mod = self.copy.get_submodule(path)
        own = [(table, name, table[name]) for table, name in _own(mod)]
        saved, done = [], set()  # every entry swapped, tied partners included (they see the same real tensor)
        for table, name, ph in own:
            if id(ph) in done:
                continue
            done.add(id(ph))
            real = torch.empty(ph.shape, dtype=ph.dtype, device="cpu")
            if real.is_floating_point() or real.is_complex():
                real.fill_(float("nan"))  # what the initialiser leaves unwritten shows
            if isinstance(ph, torch.nn.Parameter):
                real = torch.nn.Parameter(real, requires_grad=ph.requires_grad)
            for t, n in self._holders.get(id(ph), [(table, name)]):
                saved.append((t, n, t[n]))
                t[n] = real
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(_seed(path))
                self._run(kind, where)
            out = {}
            for table, name, _ in own:
                fqn = f"{path}.{name}" if path else name
                if self.plan().get(fqn) != (kind, where):
                    continue
                got = table[name]
                if not isinstance(got, torch.Tensor) or got.is_meta or \
                        ((got.is_floating_point() or got.is_complex()) and bool(torch.isnan(got).any())):
                    raise MaterializeError(f"{fqn!r} is not fully initialised by {kind}() of "
                                           f"{where or '<root>'!r} ({type(mod).__name__}): it cannot be rebuilt")
                out[name] = got.detach()
            return out
        finally:
            for table, name, ph in reversed(saved):
                table[name] = ph


def check_materializable(model: torch.nn.Module) -> Optional[Materializer]:
    """A ``Materializer`` for ``model`` if it has ``meta`` tensors (None otherwise), after checking
    that each of them has an initialiser: raises ``MaterializeError`` naming the module path and
    class of every one that has none. Cheap: the initialisers run on ``meta``."""
    mat = Materializer(model)
    if not mat.meta:
        return None
    mat.plan()
    return mat


def full_value(model: torch.nn.Module, fqn: str, t: torch.Tensor,
               materializer: Optional[Materializer] = None) -> torch.Tensor:
    """The whole value of ``model``'s tensor ``fqn`` (``t``), rebuilt if it lives on ``meta``
    (by ``materializer``, made before any of the model's tensors was replaced, or a fresh one)."""
    if not t.is_meta:
        return t.detach()
    mat = materializer if materializer is not None else Materializer(model)
    return mat.value(fqn)


__all__ = ["BASE_SEED", "INITIALISERS", "MaterializeError", "Materializer", "check_materializable", "full_value"]
