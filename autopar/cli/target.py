"""The user's model: ``import_target("MODULE:FACTORY")``, ``call_factory`` and the traceback helpers
that say where in the user's code something failed (``where_raised``, ``user_frame``).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import traceback
from typing import Any, Callable, Optional

from autopar.cli.args import IDENT
from autopar.cli.errors import USAGE, CLIError
from autopar.plans.format import clip


def where_raised(exc: BaseException, prefer: Optional[str] = None) -> str:
    """``file:line in func`` of the innermost traceback frame in file ``prefer`` (else the innermost)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{short_path(exc.filename)}:{exc.lineno}"
    frames = [f for f in frames if not f.filename.startswith("<")] or frames  # not importlib's frozen frames
    if not frames:
        return "?"
    mine = [f for f in frames if prefer and os.path.abspath(f.filename) == os.path.abspath(prefer)]
    f = (mine or frames)[-1]
    return f"{short_path(f.filename)}:{f.lineno} in {f.name}"


def user_frame(exc: BaseException) -> Optional[str]:
    """``file:line in func`` of the innermost frame that is neither torch's, autopar's (its model zoo
    counts as the user's) nor the standard library's; None when there is none."""
    import torch

    import autopar

    skip = [os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, autopar, os)]
    zoo = os.path.join(skip[1], "models") + os.sep
    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.abspath(f.filename)
        if path.startswith(zoo) or not (any(path.startswith(d) for d in skip) or f.filename.startswith("<")):
            return f"{short_path(f.filename)}:{f.lineno} in {f.name}"
    return None


def short_path(path: str) -> str:
    """``path`` relative to the current directory, unless that climbs more than one level up."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith(".." + os.sep + "..") else path


def exception_line(exc: BaseException) -> str:
    """``TypeName: first line of the message``."""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0]}" if msg else type(exc).__name__


def import_target(target: str):
    """``MODULE:FACTORY`` -> (display name, factory, module file). MODULE is a module name found in the current
    directory (else on PYTHONPATH or among installed packages), or a path to a ``.py`` file; FACTORY an attribute
    of it (dots allowed).

    Only the user's module is taken from the current directory (or the file's folder): that folder is appended
    to ``sys.path``, never put first, so the factory's own imports of sibling modules work while a sibling named
    like an installed package (an ``ortools.py`` next to it) never replaces the package autopar imports later."""
    modname, colon, attr = target.rpartition(":")
    if not colon or not modname.strip() or not attr.strip():
        raise CLIError(f"{target!r} is not MODULE:FACTORY; e.g. `autopar plan mymodels:make_gpt ...` where "
                       f"mymodels.py defines make_gpt(**kw) returning (model, example_inputs)", USAGE)
    modname, attr = modname.strip(), attr.strip()
    if not all(IDENT.match(a) for a in attr.split(".")):
        raise CLIError(f"{target!r}: FACTORY {attr!r} is not a Python name", USAGE)
    cwd = os.getcwd()
    if modname.endswith(".py") or os.sep in modname or "/" in modname:
        module, file = _import_file(modname)
    else:
        if not all(IDENT.match(p) for p in modname.split(".")):
            raise CLIError(f"{target!r}: MODULE {modname!r} is not a module name (like pkg.models) or a .py file", USAGE)
        module, file = _import_name(modname, cwd)
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = modname if i == 0 else f"{modname}:{'.'.join(attr.split('.')[:i])}"
            names = sorted(n for n, v in vars(obj).items() if callable(v) and not n.startswith("_")
                           and getattr(v, "__module__", None) == getattr(module, "__name__", None)) if i == 0 else []
            defines = f"; it defines {', '.join(names[:10])}" if names else ""
            raise CLIError(f"{owner} ({short_path(file)}) has no attribute {part!r}{defines}: "
                           f"name a function that returns (model, example_inputs)")
        obj = getattr(obj, part)
    name = f"{getattr(module, '__name__', modname)}:{attr}"
    if not callable(obj):
        raise CLIError(f"{name} is a {type(obj).__name__}, not a function: name a function that returns "
                       f"(model, example_inputs)")
    return name, obj, file


#: names of the user modules ``import_target`` has loaded (a later target may replace them)
_LOADED: set[str] = set()


def _append_path(folder: str) -> None:
    """Let the user's module import its siblings in ``folder``, after every installed package."""
    if folder not in sys.path and not (folder == os.getcwd() and "" in sys.path):
        sys.path.append(folder)


def _check_not_shadowing(name: str, origin: str, what: str) -> None:
    """CLIError when the user's module ``name`` (file ``origin``) has the name of another module: loading it
    under that name would replace the other for everything imported later (autopar's own lazy imports too)."""
    other = sys.modules.get(name)
    if other is not None and name in _LOADED:  # a user module this process loaded before (another target)
        return
    if other is not None:
        if os.path.abspath(getattr(other, "__file__", None) or "") == os.path.abspath(origin):
            return
        found = getattr(other, "__file__", None) or "built in"
    else:
        here = os.path.dirname(os.path.abspath(origin))
        if os.path.basename(origin) == "__init__.py":
            here = os.path.dirname(here)
        path = [p for p in sys.path if os.path.abspath(p or ".") != here]
        spec = importlib.machinery.PathFinder.find_spec(name, path) if name not in sys.builtin_module_names else None
        if spec is None and name not in sys.builtin_module_names:
            return
        found = (spec.origin if spec is not None else None) or "built in"
    raise CLIError(f"{what} ({short_path(origin)}) has the name of the installed module {name!r} ({found}); "
                   f"rename your file so that it does not shadow it")


def _import_name(modname: str, cwd: str):
    """Import module ``modname`` -> (module, its file): its top-level package from ``cwd`` when it is there
    (loaded by location, so ``cwd`` never goes first on ``sys.path``), else by name; CLIError on every failure."""
    top = modname.split(".")[0]
    try:
        spec = importlib.machinery.PathFinder.find_spec(top, [cwd])
        _append_path(cwd)
        if spec is not None and spec.origin and (top not in sys.modules or top in _LOADED):
            _check_not_shadowing(top, spec.origin, f"module {top!r}")
            for loaded in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
                del sys.modules[loaded]  # an earlier target's module of this name, and its submodules
            module = importlib.util.module_from_spec(spec)
            sys.modules[top] = module  # pickling (and dataclasses) look the module up by name
            _LOADED.add(top)
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(top, None)
                raise
        elif spec is not None and spec.origin:
            _check_not_shadowing(top, spec.origin, f"module {top!r}")
        module = importlib.import_module(modname)
    except CLIError:
        raise
    except ModuleNotFoundError as e:
        top = modname.split(".")
        if e.name and any(e.name == ".".join(top[:i + 1]) for i in range(len(top))):
            raise CLIError(f"cannot import module {modname!r}: no module named {e.name!r} in the current directory "
                           f"({cwd}) or on PYTHONPATH; run autopar where {top[0]}.py (or the package {top[0]}/) is, "
                           f"add its directory to PYTHONPATH, or give the file's path (path/to/{top[-1]}.py:FACTORY)"
                           ) from e
        raise CLIError(f"importing module {modname!r} failed at {where_raised(e)}: {exception_line(e)}; install the missing "
                       f"module or fix the import") from e
    except SyntaxError as e:
        raise CLIError(f"importing module {modname!r} failed: {where_raised(e)}: SyntaxError: {e.msg}; fix the file") from e
    except Exception as e:  # the module's own code raised
        raise CLIError(f"importing module {modname!r} raised {exception_line(e)} (at {where_raised(e)}); fix the module") from e
    return module, getattr(module, "__file__", None) or modname


def _import_file(path: str):
    """Import the ``.py`` file at ``path`` as a module -> (module, its absolute path); CLIError on every failure."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise CLIError(f"cannot import {path!r}: no such file (relative paths start at {os.getcwd()})")
    name = os.path.splitext(os.path.basename(full))[0]
    if not IDENT.match(name):
        raise CLIError(f"cannot import {path!r}: {name!r} is not a valid module name; rename the file")
    _check_not_shadowing(name, full, f"{path!r}")
    _append_path(os.path.dirname(full))  # so that it can import its neighbours (after installed packages)
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise CLIError(f"cannot import {path!r}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pickling (and dataclasses) look the module up by name
    _LOADED.add(name)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(name, None)  # not a half-run module for the next import to find
        raise CLIError(f"importing {path!r} failed: {where_raised(e)}: SyntaxError: {e.msg}; fix the file") from e
    except Exception as e:
        sys.modules.pop(name, None)
        raise CLIError(f"importing {path!r} raised {exception_line(e)} (at {where_raised(e, full)}); fix the module") from e
    return module, full


def _call_text(name: str, kw: dict) -> str:
    """``name(k=v, ...)`` as the user would write the call."""
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in kw.items())})"


def call_factory(target: str, factory: Callable, file: str, kw: dict):
    """``factory(**kw)`` checked to return ``(model, example_inputs)``; -> (model, args, kwargs)."""
    import torch

    call = _call_text(target, kw)
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(**kw)
        except TypeError as e:
            raise CLIError(f"{call}: {e}; the factory is {target.rpartition(':')[2]}{sig}: pass its arguments as "
                           f"--kw NAME=VALUE", USAGE) from e
    try:
        out = factory(**kw)
    except Exception as e:
        raise CLIError(f"{call} raised {exception_line(e)} (at {where_raised(e, file)}); fix the factory or its --kw "
                       f"arguments") from e
    what = f"{call} must return (model, example_inputs)"
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        got = f"{type(out).__name__} of {len(out)} items" if isinstance(out, (tuple, list)) else \
            f"{type(out).__name__} {clip(repr(out), 40)}"
        raise CLIError(f"{what}, it returned {got}; return a pair such as `return model, (tokens, targets)`")
    model, inputs = out
    if not isinstance(model, torch.nn.Module):
        raise CLIError(f"{what}: the first item is {type(model).__name__} {clip(repr(model), 40)}, not a "
                       f"torch.nn.Module")
    if isinstance(inputs, torch.Tensor):
        return model, (inputs,), {}
    if isinstance(inputs, dict) and all(isinstance(k, str) for k in inputs):
        return model, (), dict(inputs)
    if isinstance(inputs, (tuple, list)) and inputs and any(isinstance(x, torch.Tensor) for x in inputs):
        return model, tuple(inputs), {}
    desc = f"an empty {type(inputs).__name__}" if isinstance(inputs, (tuple, list, dict)) and not inputs else \
        f"{type(inputs).__name__} {clip(repr(inputs), 40)}"
    raise CLIError(f"{what}: example_inputs is {desc}; give a tensor, a tuple of the forward's positional inputs "
                   f"(tensors), or a dict of keyword inputs")


__all__ = ["call_factory", "exception_line", "import_target", "short_path", "user_frame", "where_raised"]
