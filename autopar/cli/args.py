"""Reading the command line's values: mesh, factory keywords, hints, sizes, seconds, device presets.

Each parser raises ``CLIError(..., USAGE)`` (or argparse's ``ArgumentTypeError``, which argparse
turns into a usage error) with the value, what was expected and an example.
"""

from __future__ import annotations

import argparse
import ast
import re
from typing import Any, Sequence

from autopar.cli.errors import USAGE, CLIError
from autopar.errors import ArgumentError
from autopar.validate import parse_size

#: a Python identifier: mesh axis names, factory keywords, module and attribute names
IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=8,tp=8"`` -> ``{"dp": 8, "tp": 8}`` (axis order kept)."""
    example = "expected NAME=SIZE[,NAME=SIZE...] in mesh order, e.g. --mesh dp=8,tp=8"
    axes: dict[str, int] = {}
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise CLIError(f"--mesh {text!r}: {example}", USAGE)
    for part in parts:
        name, eq, size = (s.strip() for s in part.partition("="))
        if not eq or not IDENT.match(name):
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
        if not eq or not IDENT.match(name):
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


def parse_bytes(text: str) -> int:
    """``"60GiB"`` -> 64424509440; ``GB`` is 10^9, ``GiB`` and a bare ``G`` 2^30; no unit: bytes
    (``autopar.validate.parse_size``, which ``autopar.plan(memory_budget=...)`` uses too)."""
    try:
        return int(parse_size(text))
    except ArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_float(text: str) -> float:
    """``--time-limit``/``--search-time``: a positive, finite number of seconds."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


def positive_int(text: str) -> int:
    """``--devices-per-node``/``--nics-per-node``: a positive whole number."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return v


def device_choices() -> list[str]:
    """The hardware preset names ``--device`` accepts."""
    from autopar.cost_model.hardware import PRESETS

    return list(PRESETS)


def device_preset(text: str) -> str:
    """``--device``: a hardware preset name, lower-cased; an unknown one names the presets."""
    name = text.strip().lower()
    choices = device_choices()
    if name not in choices:
        raise argparse.ArgumentTypeError(f"unknown device preset {text!r}; presets are {', '.join(choices)} "
                                         f"(measure this machine with `autopar calibrate` and pass --profile)")
    return name


def parse_pipeline(text: str) -> dict:
    """``--pipeline schedule=1F1B,microbatches=16[,virtual_stages=2]`` as ``plan``'s ``pipeline=`` dict
    (the values checked by the planner, which names what is wrong)."""
    example = "expected KEY=VALUE[,KEY=VALUE...], e.g. --pipeline schedule=1F1B,microbatches=16"
    out: dict = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not key or not value:
            raise CLIError(f"--pipeline {text!r}: {part!r} is not KEY=VALUE; {example}", USAGE)
        if key not in ("schedule", "microbatches", "virtual_stages"):
            raise CLIError(f"--pipeline {text!r}: unknown key {key!r}; the keys are schedule, microbatches and "
                           f"virtual_stages", USAGE)
        if key == "schedule":
            out[key] = value
        else:
            try:
                out[key] = int(value)
            except ValueError:
                raise CLIError(f"--pipeline {text!r}: {key} must be a whole number, got {value!r}", USAGE) from None
    return out


__all__ = ["IDENT", "device_choices", "device_preset", "parse_bytes", "parse_hints", "parse_kw", "parse_mesh",
           "parse_pipeline", "positive_float", "split_hint"]
