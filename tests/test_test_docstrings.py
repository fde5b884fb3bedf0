"""The test files' docstrings name modules that exist: every autopar module path a docstring of a
file under tests/ mentions (dotted, ``passes.lower.plain_local`` or ``cost_model.buckets.grad_time``,
or slashed, ``cost_model/casting.py``, with or without the leading ``autopar``) resolves to a module
of the package, or to a name defined in one. A newcomer follows these names to the code."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

TESTS = pathlib.Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "autopar"

#: The package's subpackages: a path that starts with one of these (or with ``autopar``) is checked.
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
#: ``autopar.x.y``, ``x.y.z`` and ``x/y/z.py`` with ``x`` a subpackage; a name ending a sentence
#: (``runtime.``) has no part after its dot, so it is not taken for a path.
PATH = re.compile(r"(?<![\w./])(?:autopar[./])?(?:" + "|".join(map(re.escape, SUBPACKAGES)) +
                  r")(?:[./][A-Za-z_]\w*)+")

#: Modules that the layout agreed between work in progress gives new homes (the planners, the
#: pipeline runtime and the stage cut); a docstring may name them before they land.
PLANNED = {
    "planner", "planner.intra", "planner.pipelined", "planner.factorize", "planner.report", "planner.options",
    "runtime.pipeline", "runtime.pipeline.eager", "runtime.pipeline.sharded", "runtime.pipeline.simulate",
    "runtime.pipeline.loss", "runtime.pipeline.state", "runtime.pipeline.schedule",
    "passes.lower.stages", "program.staged", "cost_model.pipeline_price", "plans.html.pipeline_section",
}


def _docstrings(path: pathlib.Path):
    """``(line, text)`` of the module's docstring and of each function's and class's."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield (node.body[0].lineno, doc)


def _resolves(mention: str) -> bool:
    """Whether ``mention`` names a module of autopar, or an attribute of one (the longest prefix
    that is a module, then the rest as attributes)."""
    parts = mention.removesuffix(".py").replace("/", ".").split(".")
    if parts[0] == "autopar":
        parts = parts[1:]
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in PLANNED:
            return True
        where = PACKAGE.joinpath(*parts[:cut])
        if not (where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()):
            continue
        obj = importlib.import_module(f"autopar.{module}")
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def stale_mentions() -> list[str]:
    """``file:line: mention`` for each module path in a test docstring that names nothing."""
    out = []
    for path in sorted(TESTS.glob("*.py")):
        for line, doc in _docstrings(path):
            for m in PATH.finditer(doc):
                if not _resolves(m.group(0)):
                    out.append(f"{path.name}:{line}: {m.group(0)}")
    return out


def test_test_docstrings_name_modules_that_exist():
    stale = stale_mentions()
    assert not stale, "test docstrings name modules or functions that do not exist:\n" + "\n".join(stale)


def test_the_check_catches_a_moved_module():
    """The check itself: a name that moved fails, its new home passes."""
    assert not _resolves("passes/cast.py") and _resolves("cost_model/casting.py")
    assert not _resolves("passes.buckets.grad_time") and _resolves("cost_model.buckets.grad_time")
    assert not _resolves("autopar.cost_model.buckets.no_such_function")
    assert _resolves("autopar.passes.lower.plain_local") and _resolves("planner.intra")
    assert PATH.fullmatch("passes.lower.plain_local") and not PATH.search("the runtime. It")
