"""The ``autopar`` command line (also ``python -m autopar``).

    autopar plan MODULE:FACTORY --mesh dp=8,tp=8 [--device h100] [--profile P] [--kw batch=64 ...]
                 [--hint PATH=PLACEMENTS ...] [--inference] [--memory-budget 60GiB]
                 [--time-limit S] [--search-time S] [--recipe NAME] [--full] -o plan.json
    autopar show plan.json [--full] [--html plan.html]
    autopar explain plan.json MODULE_PATH
    autopar diff a.json b.json
    autopar demo [--quick] [--no-train]
    autopar calibrate [-o cpu-profile.json]

Every failure prints one line to stderr, ``autopar <command>: error: <what, where, what to do>``,
and exits 2 for a malformed command line (bad syntax, an unknown choice) or 1 for anything that
fails while doing the work (importing the model's module, calling its factory, planning, reading a
plan file). ``--debug`` (anywhere on the command line, or ``AUTOPAR_DEBUG=1``) adds the traceback.

Layout: ``build_parser`` makes one sub-parser per command (``show``'s in ``add_show_parser``), each
with ``func`` set to its ``cmd_*`` function; a ``cmd_*`` raises ``CLIError`` for every expected
failure and ``main`` turns it into the one line and the exit code. The demo lives in
``autopar/cli_demo.py``, the terminal status line in ``autopar/cli_progress.py``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
import warnings
from typing import Any, Callable, NoReturn, Optional, Sequence

#: Exit codes: a malformed command line, and a failure while doing the work.
USAGE, FAILURE = 2, 1


class CLIError(Exception):
    """A failure the CLI reports as one line: ``message`` says what, where and what to do."""

    def __init__(self, message: str, code: int = FAILURE, prog: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and a CLIError), not the usage text plus a line."""

    def error(self, message: str) -> NoReturn:
        raise CLIError(f"{message} (see `{self.prog} --help`)", USAGE, self.prog)


# -- reading the command line ---------------------------------------------------------------------

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=8,tp=8"`` -> ``{"dp": 8, "tp": 8}`` (axis order kept)."""
    example = "expected NAME=SIZE[,NAME=SIZE...] in mesh order, e.g. --mesh dp=8,tp=8"
    axes: dict[str, int] = {}
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise CLIError(f"--mesh {text!r}: {example}", USAGE)
    for part in parts:
        name, eq, size = (s.strip() for s in part.partition("="))
        if not eq or not _IDENT.match(name):
            raise CLIError(f"--mesh {text!r}: {part!r} is not NAME=SIZE; {example}", USAGE)
        if not size.isdigit() or int(size) < 1:
            raise CLIError(f"--mesh {text!r}: axis {name!r} has size {size!r}; sizes are positive integers "
                           f"(use 1 for an unused axis)", USAGE)
        if name in axes:
            raise CLIError(f"--mesh {text!r}: axis {name!r} appears twice; axis names must be distinct", USAGE)
        axes[name] = int(size)
    return axes


def parse_kw(items: Sequence[str]) -> dict[str, Any]:
    """``["batch=64", "name=gpt"]`` -> ``{"batch": 64, "name": "gpt"}``: values are Python literals
    (``ast.literal_eval``), or the raw string when they are not one."""
    out: dict[str, Any] = {}
    for item in items:
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or not _IDENT.match(name):
            raise CLIError(f"--kw {item!r}: expected NAME=VALUE with NAME a Python identifier, e.g. --kw batch=64 "
                           f"--kw dtype='\"bf16\"'", USAGE)
        if name in out:
            raise CLIError(f"--kw {item!r}: {name!r} is given twice; pass each factory argument once", USAGE)
        try:
            out[name] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            out[name] = value  # not a literal: the raw string (e.g. --kw size=125M)
    return out


def split_hint(item: str) -> tuple[str, str]:
    """``"layers.*.wq.weight=S(0),B"`` -> ``("layers.*.wq.weight", "S(0),B")``.

    The path ends at the first ``=``: parameter FQNs (with ``*`` wildcards), ``input:N`` and keyword
    input names never contain one, while a placement may (``input:0=dp=S(0)`` names the mesh axis)."""
    path, eq, placements = item.partition("=")
    if not eq or not path.strip() or not placements.strip():
        raise CLIError(f"--hint {item!r}: expected PATH=PLACEMENTS, e.g. --hint 'layers.*.attn.qkv.weight=S(0),B' "
                       f"or --hint input:0=dp=S(0)", USAGE)
    return path.strip(), placements.strip()


def parse_hints(items: Sequence[str], axis_names: Sequence[str]) -> dict[str, str]:
    """``--hint`` values checked against the mesh (placement syntax, axis names, one entry per axis);
    whether a path names a parameter is known only after capture (autopar's HintError says)."""
    from autopar.ir.placement import PlacementError, parse

    out: dict[str, str] = {}
    for item in items:
        path, text = split_hint(item)
        try:
            placed = parse(text, axis_names=list(axis_names), ndim=len(axis_names))
        except PlacementError as e:
            raise CLIError(f"--hint {item!r}: {e}", USAGE) from e
        if path in out and parse(out[path], axis_names=list(axis_names)) != placed:
            raise CLIError(f"--hint {item!r}: {path!r} is hinted twice, as {out[path]!r} and {text!r}", USAGE)
        out[path] = text
    return out


_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``"60GiB"`` -> 64424509440; ``GB`` is 10^9, ``GiB`` and a bare ``G`` 2^30; no unit: bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 60GiB, 80GB or 6e10 (bytes), got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


# -- the user's model -----------------------------------------------------------------------------

def _where(exc: BaseException, prefer: Optional[str] = None) -> str:
    """``file:line in func`` of the innermost traceback frame in file ``prefer`` (else the innermost)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{_short(exc.filename)}:{exc.lineno}"
    frames = [f for f in frames if not f.filename.startswith("<")] or frames  # not importlib's frozen frames
    if not frames:
        return "?"
    mine = [f for f in frames if prefer and os.path.abspath(f.filename) == os.path.abspath(prefer)]
    f = (mine or frames)[-1]
    return f"{_short(f.filename)}:{f.lineno} in {f.name}"


def _user_frame(exc: BaseException) -> Optional[str]:
    """``file:line in func`` of the innermost frame that is neither torch's, autopar's (its model zoo
    counts as the user's) nor the standard library's; None when there is none."""
    import torch

    import autopar

    skip = [os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, autopar, os)]
    zoo = os.path.join(skip[1], "models") + os.sep
    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.abspath(f.filename)
        if path.startswith(zoo) or not (any(path.startswith(d) for d in skip) or f.filename.startswith("<")):
            return f"{_short(f.filename)}:{f.lineno} in {f.name}"
    return None


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith(".." + os.sep + "..") else path


def _exc_text(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0]}" if msg else type(exc).__name__


def import_target(target: str):
    """``MODULE:FACTORY`` -> (display name, factory, module file). MODULE is a module name importable from the current
    directory or PYTHONPATH, or a path to a ``.py`` file; FACTORY an attribute of it (dots allowed)."""
    modname, colon, attr = target.rpartition(":")
    if not colon or not modname.strip() or not attr.strip():
        raise CLIError(f"{target!r} is not MODULE:FACTORY; e.g. `autopar plan mymodels:make_gpt ...` where "
                       f"mymodels.py defines make_gpt(**kw) returning (model, example_inputs)", USAGE)
    modname, attr = modname.strip(), attr.strip()
    if not all(_IDENT.match(a) for a in attr.split(".")):
        raise CLIError(f"{target!r}: FACTORY {attr!r} is not a Python name", USAGE)
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    if modname.endswith(".py") or os.sep in modname or "/" in modname:
        module, file = _import_file(modname)
    else:
        if not all(_IDENT.match(p) for p in modname.split(".")):
            raise CLIError(f"{target!r}: MODULE {modname!r} is not a module name (like pkg.models) or a .py file", USAGE)
        module, file = _import_name(modname, cwd)
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = modname if i == 0 else f"{modname}:{'.'.join(attr.split('.')[:i])}"
            names = sorted(n for n, v in vars(obj).items() if callable(v) and not n.startswith("_")
                           and getattr(v, "__module__", None) == getattr(module, "__name__", None)) if i == 0 else []
            defines = f"; it defines {', '.join(names[:10])}" if names else ""
            raise CLIError(f"{owner} ({_short(file)}) has no attribute {part!r}{defines}: "
                           f"name a function that returns (model, example_inputs)")
        obj = getattr(obj, part)
    name = f"{getattr(module, '__name__', modname)}:{attr}"
    if not callable(obj):
        raise CLIError(f"{name} is a {type(obj).__name__}, not a function: name a function that returns "
                       f"(model, example_inputs)")
    return name, obj, file


def _import_name(modname: str, cwd: str):
    try:
        module = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        top = modname.split(".")
        if e.name and any(e.name == ".".join(top[:i + 1]) for i in range(len(top))):
            raise CLIError(f"cannot import module {modname!r}: no module named {e.name!r} in the current directory "
                           f"({cwd}) or on PYTHONPATH; run autopar where {top[0]}.py (or the package {top[0]}/) is, "
                           f"add its directory to PYTHONPATH, or give the file's path (path/to/{top[-1]}.py:FACTORY)"
                           ) from e
        raise CLIError(f"importing module {modname!r} failed at {_where(e)}: {_exc_text(e)}; install the missing "
                       f"module or fix the import") from e
    except SyntaxError as e:
        raise CLIError(f"importing module {modname!r} failed: {_where(e)}: SyntaxError: {e.msg}; fix the file") from e
    except Exception as e:  # the module's own code raised
        raise CLIError(f"importing module {modname!r} raised {_exc_text(e)} (at {_where(e)}); fix the module") from e
    return module, getattr(module, "__file__", None) or modname


def _import_file(path: str):
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise CLIError(f"cannot import {path!r}: no such file (relative paths start at {os.getcwd()})")
    name = os.path.splitext(os.path.basename(full))[0]
    if not _IDENT.match(name):
        raise CLIError(f"cannot import {path!r}: {name!r} is not a valid module name; rename the file")
    folder = os.path.dirname(full)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so that it can import its neighbours
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise CLIError(f"cannot import {path!r}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pickling (and dataclasses) look the module up by name
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise CLIError(f"importing {path!r} failed: {_where(e)}: SyntaxError: {e.msg}; fix the file") from e
    except Exception as e:
        raise CLIError(f"importing {path!r} raised {_exc_text(e)} (at {_where(e, full)}); fix the module") from e
    return module, full


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _call_text(name: str, kw: dict) -> str:
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
        raise CLIError(f"{call} raised {_exc_text(e)} (at {_where(e, file)}); fix the factory or its --kw "
                       f"arguments") from e
    what = f"{call} must return (model, example_inputs)"
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        got = f"{type(out).__name__} of {len(out)} items" if isinstance(out, (tuple, list)) else \
            f"{type(out).__name__} {_clip(repr(out), 40)}"
        raise CLIError(f"{what}, it returned {got}; return a pair such as `return model, (tokens, targets)`")
    model, inputs = out
    if not isinstance(model, torch.nn.Module):
        raise CLIError(f"{what}: the first item is {type(model).__name__} {_clip(repr(model), 40)}, not a "
                       f"torch.nn.Module")
    if isinstance(inputs, torch.Tensor):
        return model, (inputs,), {}
    if isinstance(inputs, dict) and all(isinstance(k, str) for k in inputs):
        return model, (), dict(inputs)
    if isinstance(inputs, (tuple, list)) and inputs and any(isinstance(x, torch.Tensor) for x in inputs):
        return model, tuple(inputs), {}
    desc = f"an empty {type(inputs).__name__}" if isinstance(inputs, (tuple, list, dict)) and not inputs else \
        f"{type(inputs).__name__} {_clip(repr(inputs), 40)}"
    raise CLIError(f"{what}: example_inputs is {desc}; give a tensor, a tuple of the forward's positional inputs "
                   f"(tensors), or a dict of keyword inputs")


# -- commands -------------------------------------------------------------------------------------

def _device_choices() -> list[str]:
    from autopar.cost_model.hardware import PRESETS

    return list(PRESETS)


def _device(text: str) -> str:
    name = text.strip().lower()
    choices = _device_choices()
    if name not in choices:
        raise argparse.ArgumentTypeError(f"unknown device preset {text!r}; presets are {', '.join(choices)} "
                                         f"(measure this machine with `autopar calibrate` and pass --profile)")
    return name


def cmd_plan(args: argparse.Namespace) -> int:
    axes = parse_mesh(args.mesh)
    kw = parse_kw(args.kw)
    hints = parse_hints(args.hint, list(axes))
    out = args.output
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise CLIError(f"-o {out!r}: the directory {folder!r} does not exist; create it or write elsewhere", USAGE)
    if os.path.isdir(out):
        raise CLIError(f"-o {out!r} is a directory; give a file name such as {os.path.join(out, 'plan.json')!r}", USAGE)

    import autopar
    from autopar.cli_progress import PLAN_PHASES, Progress, is_terminal
    from autopar.cost_model.mesh import MeshError

    try:
        mesh = autopar.Mesh(axes, device=args.device, profile=args.profile)
    except MeshError as e:
        if args.profile and "profile" in str(e):
            raise CLIError(f"--profile {args.profile!r}: {e}") from e
        raise CLIError(f"--mesh {args.mesh!r} --device {args.device}: {e}", USAGE) from e
    name, factory, file = import_target(args.target)
    model, inputs, kwargs = call_factory(name, factory, file, kw)

    plan_kw: dict[str, Any] = dict(training=not args.inference, hints=hints or None, memory_budget=args.memory_budget,
                                   time_limit=args.time_limit)
    if args.search_time is not None:
        plan_kw["deterministic_time"] = args.search_time
    if args.recipe:
        plan_kw["recipe"] = args.recipe
    what = f"planning {name} for mesh {axes} ({args.device})"
    tty = is_terminal()
    try:
        with Progress("planning", PLAN_PHASES, enabled=tty):
            plan = autopar.plan(model, mesh, inputs, kwargs or None, progress=tty, **plan_kw)
    except autopar.AutoparError as e:
        msg = str(e)
        for path in hints:  # say it in the command line's words
            msg = msg.replace(f"hints[{path!r}]", f"--hint {path}={hints[path]}")
        raise CLIError(f"{what} failed: {msg}") from e
    except Exception as e:
        user = _user_frame(e)
        if user is not None:  # the model's forward (or its inputs) went wrong while being captured
            raise CLIError(f"{what} failed in the model's code at {user}: {_exc_text(e)}; check that "
                           f"model(*example_inputs) runs" + ("" if args.inference else " and returns the loss")) from e
        raise CLIError(f"{what} failed: internal error {_exc_text(e)} (at {_where(e)}); rerun with --debug "
                       f"for the traceback and report it") from e
    try:
        plan.save(out)
    except OSError as e:
        raise CLIError(f"cannot write the plan to {out!r}: {e.strerror or e}") from e
    print(plan.summary(full=args.full))
    print(f"\nsaved the plan to {out}; show it again with `autopar show {out}`, "
          f"explain a module with `autopar explain {out} MODULE_PATH`")
    return 0


def load(path: str):
    """``autopar.load_plan`` with CLI wording for the usual mistakes."""
    import autopar

    if not os.path.exists(path):
        raise CLIError(f"no plan file at {path!r}: make one with `autopar plan MODULE:FACTORY --mesh ... -o {path}`")
    try:
        return autopar.load_plan(path)
    except autopar.PlanError as e:
        raise CLIError(f"{e} (a plan file is what `autopar plan -o` or Plan.save writes)") from e
    except OSError as e:
        raise CLIError(f"cannot read the plan file {path!r}: {e.strerror or e}") from e


def cmd_show(args: argparse.Namespace) -> int:
    plan = load(args.plan)
    if args.html is not None:
        try:
            from autopar.plan_html import write_html
        except ModuleNotFoundError as e:
            if e.name not in ("autopar.plan_html", "autopar"):
                raise
            raise CLIError("--html: the HTML plan view is not available in this autopar (no autopar.plan_html); "
                           "use `autopar show` without --html for the terminal table") from e
        try:
            write_html(plan, args.html)
        except OSError as e:
            raise CLIError(f"--html {args.html!r}: cannot write the page: {e.strerror or e}") from e
        print(f"wrote {args.html}")
        return 0
    print(plan.summary(full=args.full))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    import autopar

    plan = load(args.plan)
    try:
        text = plan.explain(args.module_path)
    except autopar.PlanError as e:
        raise CLIError(f"{args.plan}: {e}; `autopar show {args.plan} --full` lists every module") from e
    print(text)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    a, b = load(args.a), load(args.b)
    print(a.diff(b))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from autopar.cli_demo import demo

    return demo(quick=args.quick, train=not args.no_train, steps=args.steps)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from autopar.cost_model.calibrate import calibrate

    hw = calibrate(args.output, nprocs=args.nprocs, quick=args.quick)
    print(f"wrote {args.output}: {hw.name}; use it with autopar.Mesh(..., device='cpu', profile='{args.output}')")
    return 0


# -- the parser -----------------------------------------------------------------------------------

def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's --debug is only set when given, so it never hides the top-level one.
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="on failure, also print the traceback")
    return p


def add_show_parser(sub, common) -> argparse.ArgumentParser:
    p = sub.add_parser("show", parents=[common], help="print a saved plan's summary table",
                       description="Print the summary table of a plan file: placements per module, time, bytes moved, "
                                   "memory, the recipes it was compared with.")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--full", action="store_true", help="every module (the table stops at 60 otherwise)")
    p.add_argument("--html", metavar="PATH", help="write a self-contained HTML page of the plan instead")
    p.set_defaults(func=cmd_show)
    return p


def build_parser() -> argparse.ArgumentParser:
    from autopar.recipes import NAMES

    common = _common()
    parser = _Parser(prog="autopar", description="Automatic parallelization of PyTorch models.", parents=[common],
                     epilog="Exit status: 0 success, 1 failure, 2 malformed command line. "
                            "`autopar COMMAND --help` describes a command.")
    parser.set_defaults(debug=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plan", parents=[common], help="plan a model for a mesh and save the plan as JSON",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Plan MODULE:FACTORY for a mesh: FACTORY(**kw) returns (model, example_inputs); "
                                   "the model may be on the meta device.",
                       epilog="examples:\n"
                              "  autopar plan mymodels:make_gpt --mesh dp=8,tp=8 --device h100 "
                              "--kw batch=64 --kw seq=2048 -o plan.json\n"
                              "  autopar plan mymodels.py:make --mesh dp=4 --hint 'blocks.*.mlp.fc.weight=S(0)' "
                              "--hint input:0=dp=S(0) -o plan.json")
    p.add_argument("target", metavar="MODULE:FACTORY",
                   help="a module importable from here or PYTHONPATH (or a .py path) and a function in it")
    p.add_argument("--mesh", required=True, metavar="NAME=SIZE,...", help="mesh axes in order, e.g. dp=8,tp=8")
    p.add_argument("--device", type=_device, default="h100",
                   help=f"hardware preset to price on: {', '.join(_device_choices())} (default h100)")
    p.add_argument("--profile", metavar="PATH", help="a hardware profile from `autopar calibrate`")
    p.add_argument("--kw", action="append", default=[], metavar="NAME=VALUE",
                   help="an argument of FACTORY, read as a Python literal (else a string); repeatable")
    p.add_argument("--hint", action="append", default=[], metavar="PATH=PLACEMENTS",
                   help="pin a parameter (FQN, * wildcards), input:N or keyword input: 'S(0),B' per axis or "
                        "'dp=S(0)' by axis name; repeatable")
    p.add_argument("--inference", action="store_true", help="plan the forward pass only")
    p.add_argument("--memory-budget", type=parse_bytes, metavar="SIZE",
                   help="per-device memory budget, e.g. 60GiB (default 90%% of the device's memory)")
    p.add_argument("--time-limit", type=positive_float, metavar="S", help="wall-clock limit of the solver (seconds)")
    p.add_argument("--search-time", type=positive_float, metavar="S",
                   help="solver effort in deterministic seconds (default 20); lower is faster")
    p.add_argument("--recipe", choices=NAMES, help="use this hand-written recipe instead of searching")
    p.add_argument("-o", "--output", required=True, metavar="PLAN.json", help="where to save the plan")
    p.add_argument("--full", action="store_true", help="show every module in the summary table")
    p.set_defaults(func=cmd_plan)

    add_show_parser(sub, common)

    p = sub.add_parser("explain", parents=[common], help="explain the plan of one module or parameter",
                       description="Chosen strategies, reshardings and alternatives of one module (or a parameter's "
                                   "module) of a saved plan.")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("module_path", metavar="MODULE_PATH", help="e.g. blocks.0.mlp, or a parameter FQN")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("diff", parents=[common], help="what differs between two saved plans")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("demo", parents=[common],
                       help="plan a GPT-2-style model for 8 H100s, then train a small one on 4 local processes",
                       description="Plans GPT-2 125M for 8 H100s (dp=2 x tp=4) and shows the plan next to the "
                                   "hand-written recipes; plans a small GPT for 4 local CPU processes, trains it "
                                   "there (gloo) and prints the loss next to the same model trained on one device.")
    p.add_argument("--quick", action="store_true", help="small models and short searches everywhere (seconds)")
    p.add_argument("--no-train", action="store_true", help="plan only; start no processes")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 5; --quick: 2)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("calibrate", parents=[common],
                       help="measure this machine (matmul, memory, gloo links) into a profile")
    p.add_argument("-o", "--output", default="cpu-profile.json")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.set_defaults(func=cmd_calibrate)
    return parser


# -- entry point ----------------------------------------------------------------------------------

def _one_line(message: str, limit: int = 600) -> str:
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    text = "; ".join(lines) if len(lines) <= 6 else lines[0] + " [more with --debug]"
    return text if len(text) <= limit else text[: limit - 20] + " ... [more with --debug]"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("AUTOPAR_DEBUG", "") not in ("", "0")
    prog = "autopar"
    if not debug:
        warnings.simplefilter("ignore")
    try:
        args = build_parser().parse_args(argv)
        prog = f"autopar {args.command}"
        return int(args.func(args) or 0)
    except CLIError as e:
        if debug:
            traceback.print_exc()
        print(f"{e.prog or prog}: error: {_one_line(e.message)}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `autopar show plan.json | head`: the reader left, that is fine
        try:  # keep Python's flush at exit from failing on the closed pipe
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except Exception as e:  # a bug, or another engineer's half-finished pass: still one line
        if debug:
            traceback.print_exc()
        from autopar.errors import AutoparError

        if isinstance(e, AutoparError):
            msg = _one_line(str(e))
        else:
            msg = (f"internal error in `{prog}`: {_exc_text(e)} (at {_where(e)}); "
                   f"rerun with --debug for the traceback and report it")
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return FAILURE


if __name__ == "__main__":
    sys.exit(main())
