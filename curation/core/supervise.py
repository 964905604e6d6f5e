"""Local tasks, supervised: one fresh process per task, watched through its sentinel (issue 48).

``multiprocessing.Pool`` never returns the result of a task whose worker was killed (SIGKILL, the OOM killer): the
orchestrator waited on it forever. Here every task is a :class:`multiprocessing.Process` of its own with a pipe for
its result, and the orchestrator waits on the pipes and the processes' sentinels together
(:func:`multiprocessing.connection.wait`), so a task that dies is seen the moment it dies:

* a task that raised -> its exception is raised here, with the task's traceback as its cause (as the pool did);
* a task that died without a result (killed by a signal, or exited before reporting) -> the other tasks of the
  call are stopped (SIGTERM, SIGKILL after :data:`GRACE_S`) and :class:`TaskDied` (an
  :class:`~dinopipe.utils.exits.UnfinishedError`) names the step, the task and the signal: ``curate`` exits 75,
  "rerun the same command".

No task is retried. Every task writes its parts atomically and a rerun skips finished parts, so a retry would be
safe, but a task killed by the OOM killer is most often killed again at once (the same rows, the same memory, while
the same neighbours run), and an automatic retry would hide from the operator that the machine is too small for
the plan; the rerun of the same command redoes only the missing parts. Finished parts of the call are kept.

The debug hook ``kill_task`` (dinopipe/utils/debug_hooks.py) makes a chosen task SIGKILL itself at a chosen point,
so the fault tests (tests/faults/test_task_faults.py) kill a task deterministically rather than by polling.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
from multiprocessing.connection import wait
from multiprocessing.pool import ExceptionWithTraceback
from typing import Callable

from dinopipe.utils import debug_hooks
from dinopipe.utils.exits import UnfinishedError

GRACE_S = 5.0
"""Seconds the other tasks of a failed call get to end after SIGTERM before SIGKILL."""
JOIN_S = 60.0
"""Seconds a task that delivered its result (or closed its pipe) gets to exit before it is killed."""

# The pipeline step the runner calls belong to (curation.pipeline.run_steps sets it): kept process-wide like the
# runner's recording, as the calls sit many frames below the step (issue 38).
_STEP: str | None = None
_CALLS: dict[tuple[str, str], int] = {}  # (step, task function) -> calls so far in this process (kill_task's #N)


class TaskDied(UnfinishedError):
    """A task of a call died without its result (killed by a signal, the OOM killer, a lost srun task): exit 75.
    ``why``: the clause the exit line adds after the message (dinopipe.utils.exits.run_command)."""

    why = "the parts finished tasks wrote are kept"


@contextlib.contextmanager
def step_named(name: str):
    """While open, the runner's calls belong to pipeline step ``name`` (named in a dead task's error)."""
    global _STEP
    old, _STEP = _STEP, name
    try:
        yield
    finally:
        _STEP = old


def current_step() -> str | None:
    return _STEP


def describe(task: int, num_tasks: int, fn_name: str) -> str:
    """"task 1 of 2 of step embed (embed_part_task)": numbered as the part files are (``-00001-of-00002``)."""
    return f"task {task} of {num_tasks} of step " + (f"{_STEP} ({fn_name})" if _STEP else fn_name)


def dies_at(fn_name: str, num_tasks: int) -> dict[int, str]:
    """The kill_task hook for this call: ``{task: "start" | "end"}`` for the task told to SIGKILL itself (at the
    start of the task, or after it returned: its parts written, its result not yet delivered); ``{}`` normally.

    ``kill_task=[STEP/]FN[#N]:T[:start|end]``: task ``T`` of the ``N``-th call (default the first) of task function
    ``FN`` in pipeline step ``STEP`` (any step when left out)."""
    spec = debug_hooks.get("kill_task")
    if not spec:
        return {}
    where, _, rest = spec.partition(":")
    task, _, when = rest.partition(":")
    step, _, fn = where.rpartition("/")
    fn, _, nth = fn.partition("#")
    key = (_STEP or "", fn_name)
    _CALLS[key] = _CALLS.get(key, 0) + 1
    if fn != fn_name or (step and step != _STEP) or _CALLS[key] != int(nth or 1) or int(task) >= num_tasks:
        return {}
    if (when or "start") not in ("start", "end"):
        raise ValueError(f"kill_task={spec!r}: the point is 'start' or 'end', not {when!r}")
    return {int(task): when or "start"}


def die_here(task: int, fn_name: str, when: str) -> None:
    """The kill_task hook's fault: this process SIGKILLs itself (as the OOM killer would), first saying when on
    stderr (the fault tests bound the time from this moment to the command's exit)."""
    import sys
    import time

    print(f"test hook: task {task} of {fn_name} SIGKILLs itself at its {when}, time {time.time():.3f}",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def signal_text(code: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if code is None or code >= 0:
        return f"exited with code {code} before reporting its result"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = ", e.g. the OOM killer" if -code == signal.SIGKILL else ""
    return f"was killed by signal {-code} ({name}{why})"


def _child(conn, target: Callable, args: tuple) -> None:
    try:
        msg = ("ok", target(*args))
    except BaseException as exc:  # noqa: BLE001 -- handed to the orchestrator, which raises it
        msg = ("err", ExceptionWithTraceback(exc, exc.__traceback__))
    try:
        conn.send(msg)
    except Exception as exc:  # noqa: BLE001 -- an unpicklable result or exception: say so instead
        conn.send(("err", ExceptionWithTraceback(RuntimeError(f"the task's result could not be sent back: "
                                                              f"{exc!r}"), None)))
    conn.close()


def _stop(procs) -> None:
    """End ``procs`` (SIGTERM, then SIGKILL after GRACE_S) and reap them."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()


def run_processes(target: Callable, calls: list[tuple], processes: int, fn_name: str) -> list:
    """``target(*calls[t])`` for every task ``t``, each in a fresh spawned process, ``processes`` at a time;
    their results in task order. Raises a task's exception, or UnfinishedError for a task that died."""
    ctx = mp.get_context("spawn")
    n = len(calls)
    results: list = [None] * n
    pending, running = list(range(n)), {}  # task -> (process, reader)
    try:
        while pending or running:
            while pending and len(running) < processes:
                t = pending.pop(0)
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child, args=(writer, target, calls[t]), daemon=True,
                                name=f"{fn_name}-task-{t}")
                p.start()
                writer.close()  # ours: the reader sees EOF when the task is gone
                running[t] = (p, reader)
            ready = set(wait([x for p, r in running.values() for x in (r, p.sentinel)]))
            for t, (p, reader) in sorted(running.items()):
                if reader not in ready and p.sentinel not in ready:
                    continue
                msg = None
                with contextlib.suppress(EOFError, OSError):
                    if reader.poll():
                        msg = reader.recv()
                del running[t]
                reader.close()
                # the task is exiting (a result in hand, or EOF: it is gone): never wait on it without end
                p.join(JOIN_S)
                if p.is_alive():
                    p.kill()
                    p.join()
                if msg is None:
                    raise TaskDied(f"{describe(t, n, fn_name)} {signal_text(p.exitcode)}")
                kind, value = msg
                if kind == "err":
                    raise value
                results[t] = value
    finally:
        _stop([p for p, _ in running.values()])
        for _, r in running.values():
            r.close()
    return results


__all__ = ["GRACE_S", "TaskDied", "current_step", "describe", "die_here", "dies_at", "run_processes", "signal_text",
           "step_named"]
