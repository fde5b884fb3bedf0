"""The package's shape holds: files stay small, and the import contract (pyproject.toml,
``[tool.importlinter]``, run by ``make test``) both passes on the package and fails, naming the import,
when a module imports a layer above it."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autopar"
LINT = pathlib.Path(sys.executable).with_name("lint-imports")
MAX_LINES = 500


def test_no_file_over_the_size_guideline():
    long = {str(p.relative_to(ROOT)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these files (over {MAX_LINES} lines): {long}"


def _lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache", str(root / "pyproject.toml")], cwd=root, env=env,
                           capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[test]')")
@pytest.mark.gloo
def test_import_contract_holds_and_names_an_import_against_the_layers(tmp_path):
    assert _lint(ROOT).returncode == 0, _lint(ROOT).stdout[-3000:]
    shutil.copytree(PACKAGE, tmp_path / "autopar", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    graph = tmp_path / "autopar" / "ir" / "graph.py"
    graph.write_text(graph.read_text() + "\n\ndef _upward():\n    from autopar.passes.search import fold  # noqa: F401\n")
    out = _lint(tmp_path)
    assert out.returncode != 0
    assert "autopar.ir is not allowed to import autopar.passes" in out.stdout
    assert "autopar.ir.graph -> autopar.passes.search.fold" in out.stdout
