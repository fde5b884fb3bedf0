"""docs/user_guide.md documents every public keyword of ``autopar.plan``, ``compile``, ``simulate``,
``launch``, ``Mesh`` and ``Mesh.devices`` (read from their signatures, and for ``plan``/``compile`` the
keywords they pass on to the planner, ``planner.options.KEYWORDS``), every command and flag of the ``autopar``
command line (read from its argparse parser), and quotes no plan schema version but the code's."""

from __future__ import annotations

import argparse
import inspect
import pathlib
import re

import autopar
from autopar.planner.options import KEYWORDS as PLAN_KEYWORDS
from autopar.cli import build_parser
from autopar.plans import SCHEMA_VERSION

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "user_guide.md"
SKIPPED = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)


def _keywords(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.name != "self" and p.kind not in SKIPPED]


def _mentioned(text: str, name: str) -> bool:
    """As code: ``name=`` (a keyword given) or `` `name` ``."""
    return f"{name}=" in text or f"`{name}`" in text


def test_every_public_keyword_is_in_the_user_guide():
    text = GUIDE.read_text()
    apis = {
        "autopar.plan": _keywords(autopar.plan) + list(PLAN_KEYWORDS),
        "autopar.compile": _keywords(autopar.compile) + list(PLAN_KEYWORDS),
        "autopar.simulate": _keywords(autopar.simulate),
        "autopar.launch": _keywords(autopar.launch),
        "autopar.Mesh": _keywords(autopar.Mesh.__init__),
        "autopar.Mesh.devices": _keywords(autopar.Mesh.devices),
    }
    missing = [f"{api}: keyword {name!r} (write it as `{name}=` or `{name}`)"
               for api, names in apis.items() for name in dict.fromkeys(names) if not _mentioned(text, name)]
    assert not missing, "docs/user_guide.md does not document:\n  " + "\n  ".join(missing)


def test_every_cli_command_and_flag_is_in_the_user_guide():
    text = GUIDE.read_text()
    parser = build_parser()
    missing = [f"the top-level flag {o}" for a in parser._actions for o in a.option_strings
               if o.startswith("--") and o != "--help" and o not in text]
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command, sub in commands.items():
        if f"autopar {command}" not in text:
            missing.append(f"the command `autopar {command}`")
        missing += [f"`autopar {command}`'s flag {o}" for a in sub._actions for o in a.option_strings
                    if o.startswith("--") and o != "--help" and o not in text]
    assert not missing, "docs/user_guide.md does not document:\n  " + "\n  ".join(missing)


def test_the_guide_quotes_the_codes_schema_version():
    """The guide names the version the code writes by its constant, and any number it quotes as the version
    written is the code's."""
    text = GUIDE.read_text()
    quoted = [int(n) for n in re.findall(r"writes (?:plan |schema )*version (\d+)", text)]
    assert all(n == SCHEMA_VERSION for n in quoted), (
        f"docs/user_guide.md says plans are written as version {quoted}, the code writes {SCHEMA_VERSION}")
    assert "SCHEMA_VERSION" in text
