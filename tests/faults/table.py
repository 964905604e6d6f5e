"""The fault table: every row is a fault x a point x the expected end (issue 48).

Each ``rows_*.py`` module beside this one holds a ``ROWS`` list of :class:`Row`; the tests of that module run its
rows (``pytest.mark.parametrize("row", ROWS, ids=Row.id)``) and docs/reliability.md shows the table rendered from
the same lists (``python -m tests.faults.table --render``), so the documented table is the tested one.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Row:
    area: str        # "curation tasks", "store: training", "store: curation", "store: load", ...
    fault: str       # what is done: "SIGKILL", "503 storm 20 s (> budget)", "403", "truncated body", ...
    point: str       # where: "embed task", "checkpoint load", "latest", "pool walk", ...
    code: int        # the command's expected exit code (0 = the fault is absorbed)
    bound_s: float   # the command ends within this many seconds after the fault (or after the retry budget)
    kept: str        # what is kept / not written
    rerun: str = "equal to the undisturbed run"   # what the rerun must give
    slow: bool = False

    def id(self) -> str:
        return f"{self.point}-{self.fault}".replace(" ", "_")


def all_rows() -> list[Row]:
    """Every row of every ``rows_*`` module, in module-name order."""
    here = Path(__file__).parent
    rows: list[Row] = []
    for info in sorted(pkgutil.iter_modules([str(here)]), key=lambda m: m.name):
        if info.name.startswith("rows_"):
            rows += importlib.import_module(f"{__package__}.{info.name}").ROWS
    return rows


def render(rows: list[Row]) -> str:
    lines = ["| area | fault | point | exit | bound (s) | kept | rerun |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.area} | {r.fault} | {r.point} | {r.code} | {r.bound_s:g} | {r.kept} | {r.rerun} |")
    return "\n".join(lines) + f"\n\n{len(rows)} rows.\n"


BEGIN, END = "<!-- fault-table:begin -->", "<!-- fault-table:end -->"


def render_into(doc: Path) -> bool:
    """Replace the table between the markers of ``doc``; True when it changed."""
    text = doc.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    new = f"{head}{BEGIN}\n{render(all_rows())}{END}{tail}"
    if new != text:
        doc.write_text(new)
    return new != text


if __name__ == "__main__":
    doc = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
    if "--render" in sys.argv:
        print("changed" if render_into(doc) else "unchanged")
    else:
        print(render(all_rows()))
