"""docs/reliability.md shows exactly the fault table the tests run."""

from pathlib import Path

from tests.faults.table import BEGIN, END, all_rows, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


def test_doc_table_is_the_tested_table():
    text = DOC.read_text()
    assert BEGIN in text and END in text, "docs/reliability.md lacks the fault-table markers"
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert shown == render(all_rows()).strip(), "run: python -m tests.faults.table --render"


def test_rows_are_unique():
    ids = [r.id() for r in all_rows()]
    assert len(ids) == len(set(ids))
