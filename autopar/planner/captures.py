"""Captures reused within a process: planning the same model again (another mesh, budget or recipe,
the factorization search's shapes, the pipeline search's micro-batch sizes, ``simulate`` or
``compile`` after ``plan``) traces it once.

``capture`` is ``ir.capture.capture`` behind a cache keyed by what determines the captured graph
(``capture_key``):

- the model's structure: every module's path and class (its qualified name, and the code objects of
  its ``forward`` and of every method of it and its bases below ``nn.Module``, so edited code
  misses; its plain class attributes), its ``training`` flag and its other plain attributes (sizes,
  flags, configs: ``n_heads``, ``eps``, a ``config`` object's fields, functions by their code and
  closure), every hook's code, and every parameter's and buffer's name, shape, strides, dtype and
  ``requires_grad`` (and which names share one tensor);
- the example inputs: each tensor's position, shape, strides and dtype (not its values or device:
  capture reads neither), and each other input's value;
- the capture options: ``training``, ``outputs`` and ``loss_fn`` (its code, defaults and closure
  values, or a loss module's class and attributes).

Not in the key: parameter and buffer values (capture never reads them), object identity (two equal
models share a capture; a model changed in place misses), and what the forward reads outside its
modules (module-level functions and variables, environment variables, torch's global flags): a
model whose forward depends on such state that changed within the process must be planned with
``graph=`` or after ``clear()``. A value the key cannot describe
(an attribute of an unknown type, a tensor attribute on another device) makes the capture uncached,
never wrongly shared.

A hit hands out a copy of the cached graph's node and table lists (sharing the fx graph and tensor
specs, which are immutable or read-only to every pass), so a caller that edits its graph leaves the
cache as it was. ``at_rows`` serves a capture at another batch: the model is captured once at a
probe batch and re-shaped (``ir.rebatch``), or captured at that batch when the re-shape cannot be
proven (``STATS.fallbacks`` says why). ``STATS`` counts captures, hits and re-shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Optional

import torch

from autopar._torch_compat import pytree
from autopar.ir import capture as _capture
from autopar.ir.fingerprint import graph_fingerprint
from autopar.ir.graph import Graph
from autopar.ir.rebatch import Unproven, probe_rows, rebatch, with_nodes

#: graphs kept (most recently used last): a large model's graph is large
LIMIT = 6
_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_MAX_DEPTH = 8
_MODULE_SKIP = frozenset({"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks",
                          "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
                          "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs",
                          "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
                          "_non_persistent_buffers_set", "_is_full_backward_hook"})


@dataclass
class Stats:
    """What the cache did in this process: fresh captures, hits, re-shapes to another batch, and why
    a re-shape was not made (one line each)."""

    captured: int = 0
    reused: int = 0
    rebatched: int = 0
    fallbacks: list[str] = field(default_factory=list)


STATS = Stats()
#: key -> (graph, the warnings its capture gave, shown again on every hit)
_CACHE: "OrderedDict[Hashable, tuple]" = OrderedDict()
#: batch-free key -> (probe rows, probe graph, warnings) or the reason no probe graph can be made
_PROBES: "OrderedDict[Hashable, Any]" = OrderedDict()
_REUSE = [True]


class _Unkeyable(Exception):
    pass


def _code(fn, depth: int = 1, seen: frozenset = frozenset()) -> tuple:
    """A function's identity by content: qualified name, code, defaults and closure values (a
    function met again inside its own closure, as decorators' wrappers are, by its name alone)."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        raise _Unkeyable(repr(fn))
    if id(fn) in seen:
        return ("fn-again", fn.__qualname__, code)
    seen = seen | {id(fn)}
    try:
        cells = tuple(_value(c.cell_contents, depth + 1, seen) for c in (fn.__closure__ or ()))
    except ValueError as e:  # an empty cell
        raise _Unkeyable("cell") from e
    return ("fn", fn.__qualname__, code, _value(fn.__defaults__, depth + 1, seen),
            _value(fn.__kwdefaults__, depth + 1, seen), cells)


def _value(v, depth: int, seen: frozenset = frozenset()) -> Hashable:
    """A hashable description of a plain attribute's value (``_Unkeyable`` when there is none)."""
    if depth > _MAX_DEPTH:
        raise _Unkeyable("too deep")
    if isinstance(v, _PLAIN):
        return (type(v).__name__, v)
    if isinstance(v, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return ("torch", str(v))
    if isinstance(v, torch.Tensor):  # a plain tensor attribute: a constant whose values capture reads
        if v.device.type != "cpu" or v.is_sparse:
            raise _Unkeyable("tensor")
        try:
            data = v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        except (RuntimeError, TypeError) as e:
            raise _Unkeyable("tensor") from e
        return ("tensor", tuple(v.shape), tuple(v.stride()), str(v.dtype), data)
    if isinstance(v, (tuple, list, frozenset, set)):
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        return (type(v).__name__, tuple(_value(x, depth + 1, seen) for x in items))
    if isinstance(v, dict):
        return ("dict", tuple((_value(k, depth + 1, seen), _value(x, depth + 1, seen)) for k, x in v.items()))
    if isinstance(v, (types.FunctionType, types.MethodType)):
        return _code(v, depth, seen)
    if isinstance(v, types.BuiltinFunctionType) or type(v).__name__ in ("OpOverload", "OpOverloadPacket"):
        return ("builtin", getattr(v, "__module__", None), getattr(v, "__qualname__", None) or str(v))
    if isinstance(v, type):
        return ("type", v.__module__, v.__qualname__)
    if id(v) in seen:  # an object met again inside itself: described where it was first met
        return ("again", type(v).__qualname__)
    seen = seen | {id(v)}
    if isinstance(v, torch.nn.Module):  # (a submodule held outside ``_modules``: its class and attributes)
        return ("module", type(v).__qualname__, _attributes(v, depth + 1, seen))
    if dataclasses.is_dataclass(v) or hasattr(v, "__dict__"):  # configs (dataclasses, Hugging Face's)
        return ("obj", type(v).__module__, type(v).__qualname__, _attributes(v, depth + 1, seen))
    raise _Unkeyable(type(v).__qualname__)


def _attributes(obj, depth: int, seen: frozenset = frozenset()) -> tuple:
    return tuple((k, _value(x, depth, seen)) for k, x in sorted(vars(obj).items()) if k not in _MODULE_SKIP)


def _hooks(m: torch.nn.Module) -> tuple:
    return tuple(tuple(_code(h) for h in getattr(m, name).values())
                 for name in ("_forward_hooks", "_forward_pre_hooks") if getattr(m, name, None))


def _class(cls: type) -> tuple:
    """A module class by content: for it and its bases below ``nn.Module``, every method's code (the
    innermost of a decorated one), property's getter code and plain class attribute's value (other
    class attributes by their type)."""
    out = []
    for klass in cls.__mro__:
        if klass is torch.nn.Module or klass is object:
            break
        for name, v in sorted(vars(klass).items()):
            fn = getattr(v, "__func__", None) or getattr(v, "fget", None) or v
            try:
                code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
            except ValueError:  # a cycle of wrappers
                code = getattr(fn, "__code__", None)
            if code is not None:
                out.append((klass.__qualname__, name, code))
            elif isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v)):
                out.append((klass.__qualname__, name, type(v).__name__, v))
            elif not name.startswith("__"):
                out.append((klass.__qualname__, name, type(v).__qualname__))
    return tuple(out)


def _structure(model: torch.nn.Module) -> tuple:
    """Every module's path, class (its code), hooks and plain attributes; every parameter and buffer."""
    mods, classes = [], {}
    for path, m in model.named_modules(remove_duplicate=False):
        cls = type(m)
        if cls not in classes:
            classes[cls] = (cls.__module__, cls.__qualname__, _class(cls), _code(cls.forward))
        mods.append((path, classes[cls], _hooks(m), _attributes(m, 1)))
    tensors = [(k, tuple(t.shape), tuple(t.stride()), str(t.dtype), bool(t.requires_grad), id(t))
               for k, t in list(model.named_parameters(remove_duplicate=False))
               + list(model.named_buffers(remove_duplicate=False))]
    # which names share one tensor (tied weights) matters, the tensors' identities do not
    first: dict[int, str] = {}
    tied = tuple((k, first.setdefault(i, k)) for k, *_, i in tensors)
    return tuple(mods), tuple(t[:5] for t in tensors), tied


def _inputs(args: tuple, kwargs: dict, rows: Optional[int] = None) -> tuple:
    """The inputs' shapes, strides and dtypes and the other values' (with ``rows``: a tensor's batch
    dimension, its first of size ``rows``, written ``"B"``)."""
    out = []
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            shape = tuple(leaf.shape)
            if rows is not None and shape and shape[0] == rows and len(path) == 2:  # (as ``_with_rows`` cuts)
                shape = ("B",) + shape[1:]
            out.append((pytree.keystr(path), "tensor", shape, tuple(leaf.stride()), str(leaf.dtype)))
        else:
            out.append((pytree.keystr(path), _value(leaf, 1)))
    return tuple(out)


def capture_key(model: torch.nn.Module, args: tuple, kwargs: dict, *, training: bool, outputs: bool,
                loss_fn: Optional[Callable], rows: Optional[int] = None) -> Optional[tuple]:
    """The cache key of ``capture(model, args, kwargs, ...)`` (see the module docstring), or None
    when some part of the model or inputs has no description (the capture is then not cached).
    ``rows``: the key of every batch at once (the batch dimension left out)."""
    try:
        fn = None if loss_fn is None else (_value(loss_fn, 1) if isinstance(loss_fn, torch.nn.Module)
                                           else _code(loss_fn))
        return (_structure(model), _inputs(args, kwargs, rows), bool(training), bool(outputs), fn)
    except _Unkeyable:
        return None


def _copy(graph: Graph) -> Graph:
    """``graph`` with its own node objects and tables (the specs, fx graph and Refs shared: immutable)."""
    return with_nodes(graph, [replace(n, kwargs=dict(n.kwargs), inputs=list(n.inputs), outputs=list(n.outputs),
                                      roles=list(n.roles)) for n in graph.nodes])


def _remember(table: OrderedDict, key, value) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > LIMIT:
        table.popitem(last=False)


def _traced(model, args: tuple, kwargs: dict, **kw) -> tuple[Graph, tuple]:
    """``ir.capture.capture`` and the warnings it gave (shown now, and kept to show on every reuse)."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        graph = _capture.capture(model, args, kwargs, **kw)
    STATS.captured += 1
    said = tuple((w.message, w.category, w.filename, w.lineno) for w in got)
    _say(said)
    return graph, said


def _say(said: tuple) -> None:
    for message, category, filename, lineno in said:
        warnings.warn_explicit(message, category, filename, lineno)


def _hit(key) -> Optional[Graph]:
    if not _REUSE[0] or key is None or key not in _CACHE:
        return None
    _CACHE.move_to_end(key)
    STATS.reused += 1
    graph, said = _CACHE[key]
    _say(said)
    return _copy(graph)


def _keep(key, graph: Graph, said: tuple) -> Graph:
    if not _REUSE[0] or key is None:
        return graph
    _remember(_CACHE, key, (graph, said))
    return _copy(graph)


def _batch(args: tuple, kwargs: dict) -> Optional[int]:
    """The first top-level tensor input's dimension 0 (the batch, as ``planner.pipelined.batch_size`` reads it)."""
    return next((int(v.shape[0]) for v in list(args) + list(kwargs.values())
                 if isinstance(v, torch.Tensor) and v.dim() >= 1), None)


def _reshaped(key):
    """The cache key of a re-shaped graph (planning only: it has no fx graph to lower)."""
    return None if key is None else ("reshaped", key)


def capture(model: torch.nn.Module, example_inputs: Any, example_kwargs: Optional[dict] = None, *,
            training: bool = True, outputs: bool = False, loss_fn: Optional[Callable] = None,
            planning: bool = False) -> Graph:
    """``ir.capture.capture``, reusing an earlier capture of the same key in this process (a copy).
    ``planning``: the graph is only planned, never lowered, so a probe capture of this model made
    for another batch may serve it re-shaped (a re-plan at another batch)."""
    args, kwargs = _capture.as_args(example_inputs), dict(example_kwargs or {})
    key = capture_key(model, args, kwargs, training=training, outputs=outputs, loss_fn=loss_fn)
    graph = _hit(key)
    if graph is not None or not planning:
        return graph if graph is not None else _keep(key, *_traced(model, args, kwargs, training=training,
                                                                    outputs=outputs, loss_fn=loss_fn))
    graph = _hit(_reshaped(key))
    if graph is not None:
        return graph
    batch = _batch(args, kwargs)
    if _REUSE[0] and loss_fn is None and batch is not None:
        probe = _PROBES.get(capture_key(model, args, kwargs, training=training, outputs=outputs, loss_fn=None,
                                        rows=batch))
        if isinstance(probe, tuple):
            try:
                graph = rebatch(probe[1], probe[0], batch)
            except Unproven:
                graph = None
            if graph is not None:
                STATS.rebatched += 1
                _say(probe[2])
                return _keep(_reshaped(key), graph, probe[2])
    graph, said = _traced(model, args, kwargs, training=training, outputs=outputs, loss_fn=loss_fn)
    return _keep(key, graph, said)


def capture_for_plan(model: torch.nn.Module, example_inputs: Any, example_kwargs: Optional[dict], *, training: bool,
                     fingerprint: Optional[str], loss_fn: Optional[Callable] = None) -> Graph:
    """The capture (through the cache) a plan whose graph fingerprint is ``fingerprint`` was made
    from: with the model's other outputs (as ``autopar.plan`` captures), or the loss alone where the
    plan was made from such a graph (``plan(..., graph=capture(...))``); the step then returns the
    loss alone."""
    graph = capture(model, example_inputs, example_kwargs, training=training, outputs=True, loss_fn=loss_fn)
    if training and graph.extras and graph_fingerprint(graph) != fingerprint:
        alone = capture(model, example_inputs, example_kwargs, training=training, loss_fn=loss_fn)
        if graph_fingerprint(alone) == fingerprint:
            return alone
    return graph


def _sizes(model: torch.nn.Module, args: tuple, kwargs: dict, batch: int) -> list[int]:
    """The model's sizes other than the batch: its tensors' dimensions, the inputs' other dimensions
    and integer inputs (what ``probe_rows`` must stay clear of)."""
    out = [d for t in list(model.parameters()) + list(model.buffers()) for d in t.shape]
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            out += list(leaf.shape[1:] if leaf.dim() and leaf.shape[0] == batch and len(path) == 2 else leaf.shape)
        elif isinstance(leaf, int) and not isinstance(leaf, bool):
            out.append(leaf)
    return out


def _with_rows(args: tuple, kwargs: dict, batch: int, rows: int) -> tuple[tuple, dict]:
    """Every top-level tensor input of ``batch`` rows cut to its first ``rows`` rows, as
    ``planner.pipelined.micro_inputs`` cuts them; with more rows than ``batch`` (the probe), an
    empty meta tensor of that shape (capture reads shapes and dtypes only)."""
    def one(v):
        if not (isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch):
            return v
        if rows <= batch:
            return v[:rows]
        return torch.empty((rows,) + tuple(v.shape[1:]), dtype=v.dtype, device="meta")

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _probe(model, args: tuple, kwargs: dict, batch: int, training: bool, outputs: bool):
    """``(probe rows, probe graph, warnings)`` for this model and inputs at any batch, or the reason
    there is none (both remembered)."""
    key = capture_key(model, args, kwargs, training=training, outputs=outputs, loss_fn=None, rows=batch)
    if key is None:
        return "the model or its inputs hold a value the capture cache cannot key"
    if key in _PROBES:
        _PROBES.move_to_end(key)
        return _PROBES[key]
    bad = [k for k, v in [(f"input:{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
           if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch and not v.is_contiguous()]
    if bad:
        got: Any = f"input(s) {', '.join(bad)} are not contiguous"
    else:
        rows = probe_rows(_sizes(model, args, kwargs, batch))
        pargs, pkwargs = _with_rows(args, kwargs, batch, rows)
        try:
            got = (rows, *_traced(model, pargs, pkwargs, training=training, outputs=outputs))
        except Exception as e:  # noqa: BLE001 - the capture at the batch itself says what is wrong, if anything
            got = f"the capture at the probe batch of {rows} failed ({type(e).__name__}: {str(e)[:200]})"
    _remember(_PROBES, key, got)
    return got


def at_rows(model: torch.nn.Module, args: tuple, kwargs: dict, batch: int, rows: int, *, training: bool = True,
            outputs: bool = False) -> Graph:
    """The capture of ``model`` with every input of ``batch`` rows cut to ``rows`` rows (a micro-batch),
    for planning: a cache hit, else the probe capture re-shaped to ``rows`` (``ir.rebatch``; no fx
    graph to lower), else, where that cannot be proven, a capture at ``rows`` (the reason appended
    to ``STATS.fallbacks``)."""
    margs, mkwargs = _with_rows(args, kwargs, batch, rows)
    if not _REUSE[0]:
        return _traced(model, margs, mkwargs, training=training, outputs=outputs)[0]
    key = capture_key(model, margs, mkwargs, training=training, outputs=outputs, loss_fn=None)
    graph = _hit(key) or _hit(_reshaped(key))
    if graph is not None:
        return graph
    probe = _probe(model, args, kwargs, batch, training, outputs)
    why = probe if isinstance(probe, str) else None
    if why is None:
        try:
            graph = rebatch(probe[1], probe[0], rows)
            STATS.rebatched += 1
            _say(probe[2])
            return _keep(_reshaped(key), graph, probe[2])
        except Unproven as e:
            why = str(e)
            if rows > 1:  # (a value not linear in the batch: no other size will be proven either)
                _PROBES[capture_key(model, args, kwargs, training=training, outputs=outputs, loss_fn=None,
                                    rows=batch)] = why
    STATS.fallbacks.append(f"{type(model).__qualname__} at {rows} rows: {why}")
    return _keep(key, *_traced(model, margs, mkwargs, training=training, outputs=outputs))


@contextlib.contextmanager
def reuse(on: bool):
    """Within the block, captures are (``on``) or are not reused: without, every call captures
    afresh, at its own batch, and nothing is cached (for comparisons and benchmarks)."""
    before = _REUSE[0]
    _REUSE[0] = on
    try:
        yield
    finally:
        _REUSE[0] = before


def clear() -> None:
    """Forget every cached capture and reset ``STATS``."""
    _CACHE.clear()
    _PROBES.clear()
    STATS.__init__()


__all__ = ["LIMIT", "STATS", "Stats", "at_rows", "capture", "capture_for_plan", "capture_key", "clear", "reuse"]
