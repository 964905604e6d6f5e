"""The srun launcher of the step runner (``tasks.launcher=srun``, :func:`curation.core.runner.run_step`).

This process is the single process of a Slurm batch job allocated ``SLURM_NTASKS`` tasks; each runner call
starts one ``srun --ntasks=W`` job step running :mod:`curation.core.srun_task`. The call (``fn`` and its
keywords, the picklable objects the local launcher sends through multiprocessing) goes to the tasks as a spec
file, authenticated as multiprocessing authenticates its messages: a fresh random key per call, passed to the
tasks only through the environment, and an HMAC-SHA256 of the pickle beside it; a task checks it before
unpickling (:func:`load_signed`), so a spec file nobody of this call wrote does not run. Each task's report
comes back the same way; a task that raised reports its exception (raised here, as the local launcher does), and a
task that left no report (killed by a signal, the OOM killer, a lost node) ends the call with
:class:`~curation.core.supervise.TaskDied` naming the step and the task: exit 75, rerun the same command.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pickle
import re
import secrets
import shlex
import subprocess
from typing import Callable

from dinopipe.config import InputError
from dinopipe.utils.io import atomic_write

from curation.core.supervise import TaskDied, describe, dies_at

KEY_ENV = "CURATE_SRUN_KEY"
"""The environment variable that carries a call's key (hex) from the orchestrator to its srun tasks."""
# Kept process-wide (issue 38): srun calls sit many frames below run_steps' `with spool(...)`, which alone sets it
# (and restores it on exit); outside one, the environment / working directory decide as before.
_SPOOL: str | None = None


@contextlib.contextmanager
def spool(folder: str):
    """While open, srun calls put their spec and report files under ``folder`` (``curate``: the output
    folder's steps/srun, on the file system every node of the job sees). Otherwise: CURATE_SRUN_DIR, else
    ./.curate-srun."""
    global _SPOOL
    old, _SPOOL = _SPOOL, os.path.abspath(folder)
    try:
        yield
    finally:
        _SPOOL = old


class Refused(InputError):
    """A spec or report file whose HMAC is missing or does not match the key (or no key): not unpickled."""


def dump_signed(obj, path: str, key: bytes) -> None:
    """``obj`` pickled to ``path`` and HMAC-SHA256(key, the pickle bytes) to ``path.hmac`` (each atomically;
    the HMAC first, so a pickle is never there without it)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    atomic_write(path + ".hmac", hmac.new(key, data, hashlib.sha256).hexdigest())
    atomic_write(path, data)


def load_signed(path: str, key: bytes | None):
    """The object :func:`dump_signed` wrote to ``path`` with ``key``; :class:`Refused` before unpickling when
    there is no key, no HMAC or a different one (the bytes checked are the bytes unpickled: read once)."""
    if not key:
        raise Refused(f"{path}: no key ({KEY_ENV} is not set): a spec is run only by the srun tasks of the "
                      f"`curate` call that wrote it")
    try:
        with open(path + ".hmac") as f:
            mac = f.read().strip()
    except FileNotFoundError:
        raise Refused(f"{path}: no {os.path.basename(path)}.hmac beside it: not unpickled") from None
    with open(path, "rb") as f:
        data = f.read()
    if not hmac.compare_digest(mac, hmac.new(key, data, hashlib.sha256).hexdigest()):
        raise Refused(f"{path}: its HMAC does not match this call's key (a file this call did not write, or "
                      f"changed since): not unpickled")
    return pickle.loads(data)


def report_path(folder: str, task_index: int) -> str:
    return os.path.join(folder, f"report-{task_index:05d}.pkl")


def srun_tasks() -> int:
    """The tasks of this Slurm job allocation (SLURM_NTASKS); InputError outside one."""
    n = os.environ.get("SLURM_NTASKS") or os.environ.get("SLURM_NPROCS")
    if not n:
        raise InputError("tasks.launcher=srun: not inside a Slurm job allocation (SLURM_NTASKS is not set): "
                         "submit the job with sbatch --ntasks=W (slurm/submit_curation.sh --finish-tasks W), or "
                         "use tasks.launcher=local")
    return int(n)


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _first_failed(stderr: str, failed: list[int]) -> tuple[int, str]:
    """The task that failed first and how, from srun's own lines (``srun: error: NODE: task 1: Killed``, then
    ``task 0: Terminated`` for the ones --kill-on-bad-exit stopped); else the first task without a report."""
    for line in stderr.splitlines():
        m = re.match(r"srun: error: \S+: tasks? (\d+)[\d,\-]*: (.+)$", line.strip())
        if m and int(m.group(1)) in failed:
            return int(m.group(1)), m.group(2).strip()
    return failed[0], ""


def run_srun(fn: Callable, num_tasks: int, kw: dict) -> list[dict]:
    """One ``srun --ntasks=W`` job step: the W tasks of ``fn`` (:mod:`curation.core.srun_task`) -> their reports."""
    import shutil
    import sys

    have = srun_tasks()
    if num_tasks > have:
        raise InputError(f"tasks.launcher=srun: {num_tasks} tasks asked for (tasks.count), but this job has "
                         f"SLURM_NTASKS={have}: submit it with --ntasks={num_tasks} or lower tasks.count")
    env = os.environ
    root = _SPOOL or env.get("CURATE_SRUN_DIR") or os.path.join(os.getcwd(), ".curate-srun")
    name = getattr(fn, "__name__", "task")
    folder = os.path.abspath(os.path.join(root, f"{name}-{secrets.token_hex(6)}"))
    os.makedirs(folder)
    key = secrets.token_bytes(32)  # fresh per call: a spec of another call (or person) fails the check
    spec = os.path.join(folder, "spec.pkl")
    dump_signed({"fn": fn, "num_tasks": num_tasks, "kw": kw, "die": dies_at(name, num_tasks)}, spec, key)
    cpus = env.get("SLURM_CPUS_PER_TASK")
    cmd = shlex.split(env.get("CURATE_SRUN") or "srun") + [
        f"--ntasks={num_tasks}", "--kill-on-bad-exit=1", "--export=ALL", f"--error={folder}/task-%t.err"]
    if cpus:  # srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05)
        cmd.append(f"--cpus-per-task={cpus}")
    if env.get("SLURM_GPUS_PER_TASK"):  # each task its own GPUs (else CUDA_VISIBLE_DEVICES as Slurm sets it)
        cmd.append(f"--gpus-per-task={env['SLURM_GPUS_PER_TASK']}")
    cmd += [sys.executable, "-m", "curation.core.srun_task", spec]
    child = dict(env, **{KEY_ENV: key.hex(),
                         "OMP_NUM_THREADS": env.get("CURATE_TASK_THREADS") or cpus or "1"})
    try:
        r = subprocess.run(cmd, env=child, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        shutil.rmtree(folder, ignore_errors=True)
        raise InputError(f"tasks.launcher=srun: '{cmd[0]}' is not a command here (CURATE_SRUN="
                         f"{env.get('CURATE_SRUN', '')!r}): run inside a Slurm job, or set CURATE_SRUN") from None
    if r.stderr:
        sys.stderr.write(r.stderr)
    errs = [os.path.join(folder, f"task-{t}.err") for t in range(num_tasks)]
    got = {t: load_signed(report_path(folder, t), key) for t in range(num_tasks)
           if os.path.exists(report_path(folder, t))}
    raised = [t for t in sorted(got) if "error" in got[t]]
    if raised:  # a task raised: its exception, as the local launcher raises it (a bug: 1; the user's: 2; ...)
        shutil.rmtree(folder, ignore_errors=True)
        raise got[raised[0]]["error"]
    missing = [t for t in range(num_tasks) if t not in got]
    if r.returncode != 0 or missing:  # killed (a signal, the OOM killer, a node lost): exit 75, rerun
        failed = missing or list(range(num_tasks))
        tails = "\n".join(f"--- task {t} of {num_tasks} (stderr tail, {errs[t]}):\n{_tail(errs[t])}"
                          for t in failed[:3] if _tail(errs[t]))
        first, why = _first_failed(r.stderr, failed)
        sys.stderr.write(f"{r.stderr[-1500:]}{tails}\n")
        shutil.rmtree(folder, ignore_errors=True)  # the rerun's call writes its own spec
        raise TaskDied(f"{describe(first, num_tasks, name)} ended without its report under srun "
                       f"({why or 'srun exited ' + str(r.returncode)}; {len(missing)} of {num_tasks} tasks left none)")
    reports = [got[t] for t in range(num_tasks)]
    sys.stderr.write(f"[srun] {name}: {num_tasks} tasks on {','.join(sorted({r['host'] for r in reports}))}: "
                     f"procids {','.join(str(r['procid']) for r in reports)}, "
                     f"pids {','.join(str(r['pid']) for r in reports)}, "
                     f"wall {max(r['wall_s'] for r in reports):.1f} s\n")
    for t, e in enumerate(errs):  # what the tasks printed (warnings): into this job's log
        text = _tail(e, 4000)
        if text.strip():
            sys.stderr.write(f"[{name} task {t}/{num_tasks}] {text}" + ("" if text.endswith("\n") else "\n"))
    shutil.rmtree(folder, ignore_errors=True)
    return reports
