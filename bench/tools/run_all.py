"""Run every bench/bench_*.py in turn, each in its own interpreter (``make bench``).

    python bench/tools/run_all.py            # full runs
    python bench/tools/run_all.py --quick    # smoke run; --quick is passed to every script
    python bench/tools/run_all.py -k vit     # only scripts whose name contains "vit"

New benches are found by their file name, so adding ``bench/bench_<thing>.py`` is enough; each script must
accept ``--quick`` and print its results as ``name: X.XX`` lines. Exits non-zero if any script failed.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Run every bench/bench_*.py script.")
    p.add_argument("--quick", action="store_true", help="pass --quick to every script")
    p.add_argument("-k", dest="pattern", default="", help="only scripts whose file name contains this")
    args = p.parse_args(argv)

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/, this tool in bench/tools/
    scripts = sorted(s for s in glob.glob(os.path.join(here, "bench_*.py"))
                     if args.pattern in os.path.basename(s))
    if not scripts:
        print(f"no bench_*.py scripts in {here} match '{args.pattern}'", file=sys.stderr)
        return 2
    failed = []
    for script in scripts:
        name = os.path.basename(script)
        print(f"=== {name}{' --quick' if args.quick else ''}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, script] + (["--quick"] if args.quick else []))
        print(f"=== {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t0:.0f} s\n",
              flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"{len(failed)} of {len(scripts)} benches failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
