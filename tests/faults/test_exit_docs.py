"""README.md's exit-code table and docs/exit-codes.md list every exit code the code defines (``EXIT_* = N`` anywhere
in dinopipe/ and curation/): a new code is documented where users look first (issue 48: 75 was missing)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def defined_codes() -> dict[int, str]:
    found = {}
    for path in [*REPO.glob("dinopipe/**/*.py"), *REPO.glob("curation/**/*.py")]:
        for name, code in re.findall(r"^(EXIT_[A-Z_]+) *= *(\d+)\b", path.read_text(), flags=re.M):
            found[int(code)] = f"{name} ({path.relative_to(REPO)})"
    return found


def table_codes(text: str, header: str) -> set[int]:
    """The codes in the first column of the markdown table that starts with ``header``."""
    rows = text.split(header, 1)[1].split("\n\n", 1)[0].splitlines()
    return {int(m.group(1)) for row in rows if (m := re.match(r"\| (\d+) \|", row))}


def test_every_exit_code_is_in_the_readme_and_the_exit_codes_page():
    codes = defined_codes()
    assert {1, 2, 75, 124} <= set(codes), codes
    readme = table_codes((REPO / "README.md").read_text(), "| code | meaning |\n")
    page = table_codes((REPO / "docs" / "exit-codes.md").read_text(), "| code | meaning | what to do |\n")
    assert not set(codes) - readme, f"README.md's exit table lacks {[codes[c] for c in set(codes) - readme]}"
    assert not set(codes) - page, f"docs/exit-codes.md lacks {[codes[c] for c in set(codes) - page]}"
