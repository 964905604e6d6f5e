"""The rates `curate plan` multiplies by: each one measured (with where, when, on what, by which command) or
ASSUMED, never a bare number.

A rates file (``curation/plan_rates.json``, written by ``bench/tools/rates_from_bench.py`` from the JSON of
``bench/bench_curation_scale.py`` and ``bench/bench_verify.py``)::

    {"rates": {"hash_dedup": {"value": 118000.0, "unit": "rows/s per task",
                              "source": {"bench": "bench/bench_curation_scale.py", "date": "2026-11-27",
                                         "machine": "...", "command": "...", "run": "N=1,000,000 W=1 ..."}},
               ...}}

A key the file does not have falls back to :data:`DEFAULTS`: a value measured once on this kind of machine and
cited (``source``), or ASSUMED (``source`` None). A wrong file is an InputError (exit 2), named.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from dinopipe.config import InputError

# Package data (pyproject.toml), so an installed copy plans with the measured rates, not the fallbacks.
DEFAULT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_rates.json")

_ENV = {"bench": "ENVIRONMENT.md (faiss-cpu, 200k x 384 normalised fp32)", "date": "2026-11-21",
        "machine": "2-core shared CPU box, 2 threads", "command": "faiss IVF nprobe 16 search / IndexFlatIP search"}


@dataclass(frozen=True)
class Rate:
    value: float
    unit: str
    source: dict | None = None  # None: ASSUMED

    @property
    def measured(self) -> bool:
        return self.source is not None

    def mark(self) -> str:
        """``measured (<bench>, <date>, <run>)`` or ``ASSUMED``: what the plan prints next to the rate."""
        if not self.measured:
            return "ASSUMED"
        s = self.source
        bench = os.path.basename(str(s.get("bench", "?")).split(" ")[0])
        bits = [bench, s.get("date"), s.get("label") or s.get("run")]
        return "measured (" + ", ".join(str(b) for b in bits if b) + ")"

    def where(self) -> str:
        """Bench, date, machine and command of the measurement (one line; '' if ASSUMED)."""
        s = self.source or {}
        return "; ".join(str(s[k]) for k in ("bench", "date", "machine") if s.get(k)) + \
            (f"; `{s['command']}`" if s.get("command") else "")


# name: (value, unit, source or None). The per-step rows/s of a task are the benches' (curation/plan_rates.json);
# these are what the plan uses where the rates file has no entry.
DEFAULTS: dict[str, tuple[float, str, dict | None]] = {
    "hash_dedup": (7e4, "rows/s per task", None),
    "grouping": (1.5e7, "rows/s (one process)", None),  # the former simulation's 10M figure: not in the chain's JSON
    "sampling": (4e6, "rows/s per task", None),
    "decisions": (1e5, "rows/s per task", None),
    "verification": (588.0, "pairs/s per core", {
        "bench": "bench/bench_verify.py", "date": "2026-11-26", "machine": "2-core CPU box, quiet, 1 thread",
        "command": "python bench/bench_verify.py --max-pairs 1000",
        "run": "574 tiles, 1,000 pairs, JPEG decoding included (docs/curation.md)", "label": "1 thread"}),
    "write_shards": (2e8, "bytes/s per task", None),
    "merge": (5e8, "bytes/s", None),
    "network": (1e10, "bytes/s per rank", None),
    "cpu_scan": (2.3e9, "dim-ops/s per core", {**_ENV, "run": "IVF SQfp16 scan, nprobe 16", "label": "faiss IVF scan"}),
    "cpu_gemm": (7e10, "FLOP/s per core", {**_ENV, "run": "IndexFlatIP exact search", "label": "faiss flat GEMM"}),
}
"""The ASSUMED ones are replaced by measured ones as the benches cover them (bench/tools/rates_from_bench.py)."""

USED = ("hash_dedup", "verification", "grouping", "sampling", "decisions", "write_shards", "merge", "network",
        "cpu_scan", "cpu_gemm")
"""The rates `curate plan` multiplies by. The bench's rows/s of the index add, the searches and the k-means
(index_add, search, decontaminate, kmeans in curation/plan_rates.json) are kept for reference: those steps' times are the
cost model's op counts over the device rates (cpu_scan, cpu_gemm, the GPU table), since they depend on D, nlist,
nprobe and k, which the bench fixes."""


def load_rates(path: str | None = None) -> dict[str, Rate]:
    """DEFAULTS overlaid with the rates file ``path`` (None: curation/plan_rates.json when it exists)."""
    rates = {k: Rate(v, u, s) for k, (v, u, s) in DEFAULTS.items()}
    if path is None:
        if not os.path.exists(DEFAULT_FILE):
            return rates
        path = DEFAULT_FILE
    try:
        with open(path) as f:
            doc = json.load(f)
        entries = doc["rates"]
        for name, e in entries.items():
            value = float(e["value"])
            if not value > 0:
                raise ValueError(f"rate {name!r} is {value}, must be > 0")
            rates[name] = Rate(value, str(e.get("unit", rates.get(name, Rate(0, "")).unit)), e.get("source") or None)
    except FileNotFoundError:
        raise InputError(f"--rates {path}: no such file (bench/tools/rates_from_bench.py writes one)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"--rates {path}: not a rates file ({type(e).__name__}: {e}); expected "
                         '{"rates": {"name": {"value": x, "unit": ..., "source": {...} or null}}}') from None
    return rates
