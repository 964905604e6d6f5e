"""One status table (curation/core/status.py): the step arrays' codes, decisions.tsv's names and the manifest's counts
all come from it."""

from __future__ import annotations

import ast
import pathlib

from curation.core import decisions
from curation.report import plots as report
from curation.core import stepfiles
from curation.write import shards as write
from curation.core.status import KEPT, STATUS_NAMES, STATUSES, UNREADABLE


def test_every_module_reads_the_one_table():
    assert decisions.STATUS_NAMES is STATUS_NAMES and decisions.UNREADABLE == UNREADABLE
    assert write.STATUSES is STATUSES and report.STATUSES is STATUSES
    assert stepfiles.KEPT == KEPT
    assert sorted(STATUSES) == sorted(STATUS_NAMES) and len(set(STATUS_NAMES)) == len(STATUS_NAMES)


def test_no_other_module_spells_the_names_out():
    """A tuple or dict literal holding two or more status names anywhere in curation/ but status.py is a second
    table (the three there were had two orders)."""
    names = set(STATUS_NAMES)
    root = pathlib.Path(__file__).resolve().parents[2] / "curation"
    found = []
    for path in root.rglob("*.py"):
        if path.name == "status.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else \
                node.values if isinstance(node, ast.Dict) else []
            strs = {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            if len(strs & names) >= 2:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found
