"""The test hooks: one documented variable, read in one module; a real run's environment turns nothing on."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from dinopipe.utils import debug_hooks

REPO = Path(__file__).resolve().parents[2]


def test_hooks_are_off_unless_the_variable_names_them(monkeypatch):
    monkeypatch.delenv(debug_hooks.ENV, raising=False)
    assert all(debug_hooks.get(k) is None for k in debug_hooks.HOOKS)
    monkeypatch.setenv(debug_hooks.ENV, "signal=save:4:USR1@1,step:6:KILL; stale_latest=1")
    assert debug_hooks.get("signal") == "save:4:USR1@1,step:6:KILL" and debug_hooks.get("stale_latest") == "1"
    assert debug_hooks.get("curate_block") is None


def test_a_typo_is_an_error_not_a_silent_no_op(monkeypatch):
    monkeypatch.setenv(debug_hooks.ENV, "stale_lastest=1")
    with pytest.raises(ValueError, match="stale_lastest"):
        debug_hooks.get("signal")
    with pytest.raises(KeyError):
        debug_hooks.get("nope")
    with pytest.raises(ValueError):
        debug_hooks.env(sginal="step:1")


def test_env_reaches_a_child_process():
    import os

    e = dict(os.environ, PYTHONPATH=str(REPO), **debug_hooks.env(curate_block=8192, stale_latest=0))
    out = subprocess.run([sys.executable, "-c", "from curation.core import runner; print(runner.BLOCK)"],
                         env=e, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "8192"


def _environ_reads(path: Path) -> list[str]:
    """String keys of ``os.environ.get(...)`` / ``os.environ[...]`` / ``os.getenv(...)`` in a file."""
    keys = []
    for node in ast.walk(ast.parse(path.read_text())):
        arg = None
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv") and node.args:
            arg = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            arg = node.slice
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            keys.append(arg.value)
    return keys


def test_production_code_reads_no_test_variable_of_its_own():
    found = []
    for pkg in ("dinopipe", "curation"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            if path.name == "debug_hooks.py":
                continue
            found += [f"{path.relative_to(REPO)}: {k}" for k in _environ_reads(path)
                      if "TEST" in k or k in ("CURATE_BLOCK", debug_hooks.ENV)]
    assert not found, found
