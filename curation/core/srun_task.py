"""One srun task of a runner call (``tasks.launcher=srun``, :func:`curation.core.srun.run_srun`).

    python -m curation.core.srun_task SPEC

runs as task ``SLURM_PROCID`` of ``SLURM_NTASKS`` of the job step the orchestrating ``curate`` process started:
it checks SPEC's HMAC with the call's key (the environment's CURATE_SRUN_KEY, which only that process's
srun passes on) before unpickling anything -- a spec without the key, without its HMAC or with another one
exits 2 and runs nothing -- then runs ``fn(task_index, num_tasks, **kw)`` through the runner's measuring
wrapper (wall time, peak memory) and writes its report beside SPEC, signed with the same key (a task that raised:
its exception, which the orchestrator raises; then exit 1). A task whose
part files already exist returns at once (the tasks' own rerun-safety).
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from multiprocessing.pool import ExceptionWithTraceback

from dinopipe.utils.proc import exit_now

from curation.core.runner import run_measured
from curation.core.srun import KEY_ENV, Refused, dump_signed, load_signed, report_path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m curation.core.srun_task SPEC (started by the step runner's srun launcher)",
              file=sys.stderr)
        return 2
    spec_path = os.path.abspath(args[0])
    key_hex = os.environ.pop(KEY_ENV, "")  # not passed on to whatever the task starts
    try:
        key = bytes.fromhex(key_hex) if key_hex else None
    except ValueError:
        key = None
    try:
        spec = load_signed(spec_path, key)
    except (Refused, FileNotFoundError) as exc:
        print(f"srun_task: refused: {exc}", file=sys.stderr)
        return 2
    t = int(os.environ.get("SLURM_PROCID", "-1"))
    w = int(os.environ.get("SLURM_NTASKS") or os.environ.get("SLURM_NPROCS") or "0")
    if w != spec["num_tasks"] or not 0 <= t < w:
        print(f"srun_task: this is task {t} of {w} (SLURM_PROCID / SLURM_NTASKS), the call has "
              f"{spec['num_tasks']} tasks", file=sys.stderr)
        return 2
    try:
        rep = run_measured(spec["fn"], t, w, spec["kw"], die=spec.get("die", {}).get(t))
    except Exception as exc:  # noqa: BLE001 -- reported to the orchestrator, which raises it as the local launcher does
        traceback.print_exc()
        try:
            dump_signed({"error": ExceptionWithTraceback(exc, exc.__traceback__)},
                        report_path(os.path.dirname(spec_path), t), key)
        except Exception:  # noqa: BLE001 -- an unpicklable exception: no report, the orchestrator says 75
            traceback.print_exc()
        return 1
    rep.update(procid=t, pid=os.getpid(), host=socket.gethostname())
    dump_signed(rep, report_path(os.path.dirname(spec_path), t), key)
    return 0


if __name__ == "__main__":
    # the report is written and closed: end without interpreter finalisation, where the teardown of a task's gloo
    # group (the k-means tree's ranks) can abort a finished task and fail the srun step
    exit_now(main())
