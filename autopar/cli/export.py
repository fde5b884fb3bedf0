"""``autopar export``: a saved plan as a DTensor + FSDP2 module or torchtitan settings (``autopar.export``)."""

from __future__ import annotations

import argparse
import os
import sys

from autopar.cli.errors import USAGE, CLIError


def add_export_parser(sub, common) -> argparse.ArgumentParser:
    """The ``export`` sub-parser, added to ``sub`` (the parser's sub-parsers)."""
    p = sub.add_parser("export", parents=[common],
                       help="write a saved plan as DTensor + FSDP2 code or torchtitan settings",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Project a saved plan onto module-level styles and write it as a Python module with "
                                   "parallelize(model, device_mesh) (--format dtensor) or as torchtitan job-config "
                                   "settings (--format torchtitan). With --model (the plan's MODULE:FACTORY and --kw), "
                                   "the projection is priced and every placement it changed is listed.",
                       epilog="examples:\n"
                              "  autopar export plan.json --format dtensor --model mymodels:make_llama --kw batch=64 "
                              "-o parallelize_llama.py\n"
                              "  autopar export plan.json --format torchtitan")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--format", required=True, choices=("dtensor", "torchtitan"))
    p.add_argument("--model", metavar="MODULE:FACTORY", help="the plan's model (needed by --format dtensor)")
    p.add_argument("--kw", action="append", default=[], metavar="NAME=VALUE",
                   help="an argument of FACTORY, read as a Python literal (else a string); repeatable")
    p.add_argument("-o", "--output", metavar="FILE", help="write the module or settings here (default: stdout)")
    p.set_defaults(func=cmd_export)
    return p


def cmd_export(args: argparse.Namespace) -> int:
    """``autopar export``: the text to ``-o`` (or stdout), the projection's report to stdout (or stderr)."""
    from autopar.cli.args import parse_kw
    from autopar.cli.commands import load
    from autopar.cli.target import call_factory, import_target

    if args.format == "dtensor" and args.model is None:
        raise CLIError("--format dtensor needs the plan's model: add --model MODULE:FACTORY (and its --kw)", USAGE)
    if args.output is not None and os.path.isdir(args.output):
        raise CLIError(f"-o {args.output!r} is a directory; give a file name such as 'parallelize_model.py'", USAGE)
    plan = load(args.plan)
    model, inputs, kwargs = None, (), None
    if args.model is not None:
        name, factory, file = import_target(args.model)
        model, inputs, kwargs = call_factory(name, factory, file, parse_kw(args.kw))

    import autopar

    try:
        out = plan.export(args.format, model, inputs, kwargs or None)
    except autopar.AutoparError as e:
        raise CLIError(f"exporting {args.plan} failed: {e}") from e
    if args.output is None:
        print(out.text)
        print(out.summary(), file=sys.stderr)
        return 0
    try:
        with open(args.output, "w") as f:
            f.write(out.text)
    except OSError as e:
        raise CLIError(f"cannot write {args.output!r}: {e.strerror or e}") from e
    print(out.summary())
    print(f"wrote {args.output}")
    return 0


__all__ = ["add_export_parser", "cmd_export"]
