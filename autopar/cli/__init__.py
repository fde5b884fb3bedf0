"""The ``autopar`` command line (also ``python -m autopar``).

    autopar plan MODULE:FACTORY --mesh dp=8,tp=8 [--device h100] [--profile P] [--kw batch=64 ...]
                 [--hint PATH=PLACEMENTS ...] [--inference] [--memory-budget 60GiB]
                 [--time-limit S] [--search-time S] [--recipe NAME] [--full] -o plan.json
    autopar show plan.json [--full] [--html plan.html]
    autopar explain plan.json MODULE_PATH
    autopar diff a.json b.json
    autopar replan plan.json MODULE:FACTORY --devices N [--checkpoint DIR] [--kw ...] -o replanned.json
    autopar demo [--quick] [--no-train]
    autopar calibrate [-o cpu-profile.json]
    autopar export plan.json --format dtensor|torchtitan [--model MODULE:FACTORY --kw ...] [-o FILE]

Every failure prints one line to stderr, ``autopar <command>: error: <what, where, what to do>``,
and exits 2 for a malformed command line (bad syntax, an unknown choice) or 1 for anything that
fails while doing the work (importing the model's module, calling its factory, planning, reading a
plan file). ``--debug`` (anywhere on the command line, or ``AUTOPAR_DEBUG=1``) adds the traceback.

Layout: ``build_parser`` (here) makes one sub-parser per command (``show``'s in ``add_show_parser``),
each with ``func`` set to its ``cmd_*`` function (``commands``); a ``cmd_*`` raises ``CLIError``
(``errors``) for every expected failure and ``main`` turns it into the one line and the exit code.
``args`` reads the command line's values, ``target`` imports the user's MODULE:FACTORY, ``demo`` is
``autopar demo`` and ``progress`` the terminal status line.

This module and ``demo`` import only the standard library (and the standard-library-only
``errors``) at the top: the demo's training ranks find ``autopar.cli.demo._train_rank`` by name.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from typing import NoReturn, Optional, Sequence

from autopar.cli.errors import FAILURE, USAGE, CLIError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and a CLIError), not the usage text plus a line."""

    def error(self, message: str) -> NoReturn:
        raise CLIError(f"{message} (see `{self.prog} --help`)", USAGE, self.prog)


def _common() -> argparse.ArgumentParser:
    """The options every command accepts (``--debug``)."""
    p = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's --debug is only set when given, so it never hides the top-level one.
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="on failure, also print the traceback")
    return p


def add_show_parser(sub, common) -> argparse.ArgumentParser:
    """The ``show`` sub-parser, added to ``sub`` (the parser's sub-parsers)."""
    from autopar.cli.commands import cmd_show

    p = sub.add_parser("show", parents=[common], help="print a saved plan's summary table",
                       description="Print the summary table of a plan file: placements per module, time, bytes moved, "
                                   "memory, the recipes it was compared with.")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--full", action="store_true", help="every module (the table stops at 60 otherwise)")
    p.add_argument("--html", metavar="PATH", help="write a self-contained HTML page of the plan instead")
    p.set_defaults(func=cmd_show)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The ``autopar`` argument parser: one sub-parser per command, each with ``func`` its ``cmd_*``."""
    from autopar.cli.args import (
        device_choices,
        device_preset,
        parse_bytes,
        positive_float,
        positive_int,
    )
    from autopar.cli.commands import (
        cmd_calibrate,
        cmd_demo,
        cmd_diff,
        cmd_explain,
        cmd_plan,
        cmd_replan,
    )
    from autopar.validate import RECIPE_NAMES as NAMES
    from autopar.cli.export import add_export_parser

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
                              "--hint input:0=dp=S(0) -o plan.json\n"
                              "  autopar plan mymodels:make_llama --mesh pp=4,dp=2,tp=8 --pipeline schedule=1F1B,"
                              "microbatches=16 -o plan.json\n"
                              "  autopar plan mymodels:make_llama --devices 64 -o plan.json")
    p.add_argument("target", metavar="MODULE:FACTORY",
                   help="a module importable from here or PYTHONPATH (or a .py path) and a function in it")
    p.add_argument("--mesh", metavar="NAME=SIZE,...", help="mesh axes in order, e.g. dp=8,tp=8 (an axis named pp "
                                                            "pipelines: pp=4,dp=2,tp=8)")
    p.add_argument("--devices", type=positive_int, metavar="N",
                   help="instead of --mesh: N devices, the planner chooses pp x dp x tp (tp within a node of "
                        "--devices-per-node) and lists the shapes it compared")
    p.add_argument("--pipeline", metavar="KEY=VALUE,...",
                   help="pin the pipeline: schedule=1F1B|GPipe|Interleaved1F1B|ZBVZeroBubble, microbatches=M, "
                        "virtual_stages=V (with a pp mesh axis; without one, microbatches=M accumulates gradients)")
    p.add_argument("--device", type=device_preset, default="h100",
                   help=f"hardware preset to price on: {', '.join(device_choices())} (default h100)")
    p.add_argument("--profile", metavar="PATH", help="a hardware profile from `autopar calibrate`")
    p.add_argument("--devices-per-node", type=positive_int, metavar="N",
                   help="devices per node (default: the preset's, 8 for GPUs); axes spanning nodes are priced on NIC rails")
    p.add_argument("--nics-per-node", type=positive_int, metavar="N",
                   help="network cards per node (default: the preset's, 8 for GPUs: one rail per GPU)")
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
    add_export_parser(sub, common)

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

    p = sub.add_parser("replan", parents=[common], help="plan a saved plan's model again for the devices left",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Plan MODULE:FACTORY (the model PLAN.json was made for) again for the devices left "
                                   "after a failure, on the plan's hardware and precision; check that the checkpoint "
                                   "saved under the old plan holds the model's state (torch.distributed.checkpoint "
                                   "reshards it into the new plan's blocks on load); print the new step time and what "
                                   "moved; save the new plan.",
                       epilog="example:\n  autopar replan plan.json mymodels:make_llama --devices 56 --checkpoint "
                              "ckpt/step_1000 -o replanned.json")
    p.add_argument("plan", metavar="PLAN.json", help="the plan the job ran under")
    p.add_argument("target", metavar="MODULE:FACTORY", help="the model's factory, as `autopar plan` takes it")
    p.add_argument("--devices", type=positive_int, required=True, metavar="N",
                   help="the devices left; the planner chooses pp x dp x tp for them")
    p.add_argument("--checkpoint", metavar="DIR", help="a torch.distributed.checkpoint directory saved under PLAN.json")
    p.add_argument("--kw", action="append", default=[], metavar="NAME=VALUE",
                   help="an argument of FACTORY, read as a Python literal (else a string); repeatable")
    p.add_argument("--time-limit", type=positive_float, metavar="S", help="wall-clock limit of the solver (seconds)")
    p.add_argument("--search-time", type=positive_float, metavar="S",
                   help="solver effort in deterministic seconds (default 20); lower is faster")
    p.add_argument("-o", "--output", required=True, metavar="NEW.json", help="where to save the new plan")
    p.set_defaults(func=cmd_replan)

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
    p.add_argument("--nprocs", type=int, default=2,
                   help="measure inside this many concurrent gloo processes, the ranks of the runs the profile "
                        "is for (1: this process alone, the preset's link)")
    p.add_argument("--quick", action="store_true")
    p.set_defaults(func=cmd_calibrate)
    return parser


def _one_line(message: str, limit: int = 600) -> str:
    """``message`` as one line of at most ``limit`` characters (a long message says --debug shows more)."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    text = "; ".join(lines) if len(lines) <= 6 else lines[0] + " [more with --debug]"
    return text if len(text) <= limit else text[: limit - 20] + " ... [more with --debug]"


def _drop_cwd_from_front() -> None:
    """``python -m autopar`` puts the current directory first on ``sys.path``: take it off, so that a file there
    named like a package autopar imports later (``ortools.py``) is not imported in its place. The user's
    factory module is found in the current directory all the same (``target.import_target``)."""
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.getcwd():
        del sys.path[0]


def _error_line(prog: str, message: str) -> str:
    """``<prog>: error: <message as one line>``, its control characters escaped (``plans.format.printable``)."""
    from autopar.plans.format import printable

    return printable(f"{prog}: error: {_one_line(message)}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``) -> the exit status: 0, ``FAILURE`` or ``USAGE``."""
    if argv is None:
        _drop_cwd_from_front()
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
        print(_error_line(e.prog or prog, e.message), file=sys.stderr)
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
        from autopar.cli.target import exception_line, where_raised
        from autopar.errors import AutoparError

        if isinstance(e, AutoparError):
            msg = str(e)
        else:
            msg = (f"internal error in `{prog}`: {exception_line(e)} (at {where_raised(e)}); "
                   f"rerun with --debug for the traceback and report it")
        print(_error_line(prog, msg), file=sys.stderr)
        return FAILURE


__all__ = ["FAILURE", "USAGE", "CLIError", "add_show_parser", "build_parser", "main"]
