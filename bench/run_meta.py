"""Where a bench's JSON was measured: date, machine, command (bench/tools/rates_from_bench.py cites them)."""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time


def machine() -> str:
    """CPU model, cores, memory and load: enough to tell two machines (and a busy one) apart."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
        mem = f", {kib / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return f"{model}, {os.cpu_count()} cores{mem}{load}"


def run_meta(argv=None) -> dict:
    """``{"date", "machine", "command"}`` of this run (UTC date; the command as typed)."""
    args = sys.argv[1:] if argv is None else list(argv)
    script = os.path.relpath(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] else "?"
    return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "time": time.strftime("%H:%M UTC", time.gmtime()),
            "machine": machine(), "command": "python " + " ".join(shlex.quote(x) for x in [script, *args])}
