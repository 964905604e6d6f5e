"""dinopipe.utils.proc.map_large_allocations: a task that frees arrays gives their pages back.

glibc serves allocations below its (rising) mmap threshold from the heap and keeps the freed pages when they
are not at its top; a curation task with many mid-sized arrays (its share of hashes, an inverted list) then holds
more resident memory than its live arrays. Checked in a fresh process (the setting is process-wide): a 16 MB block
freed (glibc's threshold rises to 16 MB), then 8 arrays of 8 MB, every other one freed -- with large allocations
mapped the resident heap drops by the 32 MB freed (glibc's default here keeps all 64 MB resident)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import json, sys
import numpy as np
from dinopipe.utils.proc import map_large_allocations

def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon"))

ok = map_large_allocations() if sys.argv[1] == "1" else False
warm = np.ones(16 << 20, np.uint8); del warm  # a mapped block freed: glibc's threshold rises to 16 MB
base = anon()
arrays = [np.ones(8 << 20, np.uint8) for _ in range(8)]
full = anon()
del arrays[::2]  # holes in the middle: a heap keeps them
print(json.dumps({"ok": ok, "base": base, "full": full, "after": anon()}))
"""


def _run(mapped: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", CODE, "1" if mapped else "0"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_arrays_go_back_to_the_system_once_large_allocations_are_mapped():
    got = _run(True)
    if not got["ok"]:
        pytest.skip("not glibc: mallopt is not available")
    mb = 1 << 20
    assert got["full"] - got["base"] >= 60 * mb  # the 8 arrays were resident
    # 4 of the 8 arrays (32 MB) freed: back to base + the 4 live ones (32 MB), within a few MB
    assert got["after"] - got["base"] <= 36 * mb, got
