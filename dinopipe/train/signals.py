"""Preemption: SIGUSR1 (Slurm's ``--signal=USR1@...`` warning) or SIGTERM (scancel, preemption, ``scontrol
requeue``) asks the loop to save a checkpoint at the next step boundary and exit 124, so a requeue restarts it
from there.

Slurm signals *every* process of a job step, DataLoader workers included. A torch worker installs a C
SIGTERM handler that re-raises any SIGTERM not sent by its parent, so the worker dies and the main process
fails with "DataLoader worker ... is killed by signal: Terminated" before it can save. Workers therefore
ignore both signals unless their own parent sends them (``worker_ignore_signals`` as ``worker_init_fn``);
they still stop when the loader shuts them down (a sentinel on their index queue, or SIGTERM from the main
process) or when the main process dies (torch's watchdog). A worker forked before its ``worker_init_fn``
ran would still die, so workers are forked with the signals blocked (``signals_blocked``) and take them
only once their handling is in place: no window is left.

``maybe_test_signal`` is a test-only hook (the loop installs it through ``test_hooks_from_env`` only when a
test asked for it; a real run's step has no hook). The debug hook ``signal`` (``DINOPIPE_DEBUG_HOOKS=
"signal=step:N[:SIG][@RANK]"`` or ``"signal=save:N[:SIG][@RANK]"``, dinopipe/utils/debug_hooks.py) makes the
process signal its own process group (itself and its data workers, as Slurm would) in the middle of step N or
during the checkpoint save of step N; ``"signal=wait:N"`` holds step N until a signal comes from outside.
Tests use it to hit an exact point instead of polling.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator, Optional

from ..utils import debug_hooks

EXIT_PREEMPTED = 124  # what the loop exits with after a preemption save; the sbatch script requeues on it
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionFlag:
    def __init__(self, signals=PREEMPT_SIGNALS) -> None:
        self.received: Optional[int] = None
        self._old = {}
        for s in signals:
            try:
                self._old[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass

    def _handler(self, signum, frame) -> None:
        self.received = signum

    def __bool__(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}


def _serve_sigterm(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:  # the loader (or multiprocessing at exit) stopping its worker: obey
            os._exit(0)


def worker_ignore_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: a preemption signal is the main process's business, not the worker's.

    SIGUSR1 is ignored. SIGTERM stays blocked (workers are forked with it blocked, see ``signals_blocked``)
    and a thread takes it synchronously: sent by the main process (torch's fallback ``terminate()``,
    multiprocessing's at-exit clean-up of daemon children) the worker exits, as torch's own handler does;
    sent by anyone else (Slurm signalling the whole step) it is dropped."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # also discards one that arrived while blocked
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_serve_sigterm, args=(os.getppid(),), daemon=True, name="sigterm").start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Block the preemption signals in this thread while DataLoader workers are forked (they inherit the
    mask); a signal arriving meanwhile stays pending and is handled as soon as the block lifts."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPT_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _parse_test_signal(spec: str) -> tuple[str, int, int, Optional[int]]:
    where_step, _, rank = spec.partition("@")
    parts = where_step.split(":")
    if len(parts) not in (2, 3) or parts[0] not in ("step", "save", "wait"):
        raise ValueError(f"{debug_hooks.ENV} signal={spec!r}: expected 'step|save|wait:N[:SIG][@RANK]'")
    sig = getattr(signal, "SIG" + parts[2].upper().removeprefix("SIG")) if len(parts) == 3 else signal.SIGTERM
    return parts[0], int(parts[1]), int(sig), int(rank) if rank else None


def maybe_test_signal(where: str, step: int, rank: int, flag: Optional[PreemptionFlag] = None) -> None:
    """Test hook (see the module docstring); a no-op unless the debug hook ``signal`` is set. Several specs may
    be given, comma-separated. ``wait:N`` holds step N until a preemption signal comes from outside (a real
    Slurm test sends it with scancel/scontrol), so the signal lands at an exact step without a race."""
    spec = debug_hooks.get("signal")
    if not spec:
        return
    for one in spec.split(","):
        at, n, sig, only = _parse_test_signal(one.strip())
        if n != step or (only is not None and only != rank):
            continue
        if at == "wait" and where == "step" and flag is not None:
            print(f"test hook: step {step} waits for a preemption signal", flush=True)
            deadline = time.monotonic() + 900
            while not flag and time.monotonic() < deadline:
                time.sleep(0.05)
        elif at == where:
            if os.getpgid(0) != os.getpid():  # never signal whoever started us (pytest, a shell) by mistake
                raise RuntimeError(f"{debug_hooks.ENV} signal=... needs the process to lead its own process group")
            # Sent by another process, as slurmstepd does: a worker treats a SIGTERM from its own parent as
            # "shut down quietly", so signalling the group from here would not test what Slurm does.
            others = _group_members(os.getpgid(0))
            subprocess.run([sys.executable, "-S", "-c", "import os, sys; os.killpg(int(sys.argv[1]), int(sys.argv[2]))",
                            str(os.getpgid(0)), str(sig)], check=True, start_new_session=True)
            if sig != signal.SIGKILL:
                _wait_delivered(others, sig)
                dead = [p for p in others if p not in _group_members(os.getpgid(0))]
                print(f"test hook: signal {sig} sent to the process group at {where} {step}; "
                      f"{len(dead)} of its {len(others)} other processes died", flush=True)


def test_hooks_from_env() -> list:
    """The loop's per-step hooks a test asked for through the debug hook ``signal`` ([] in a real run), each
    called as ``hook(step, rank, preemption_flag)`` after the step's backward."""
    if not debug_hooks.get("signal"):
        return []
    return [lambda step, rank, flag: maybe_test_signal("step", step, rank, flag)]


def _group_members(pgid: int) -> dict[int, str]:
    """Live processes of a process group other than this one -> their /proc status text."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            if int(stat[2]) == pgid and stat[0] not in "ZX":
                out[int(d)] = open(f"/proc/{d}/status").read()
        except (OSError, IndexError, ValueError):
            continue
    return out


def _wait_delivered(pids, sig: int, limit_s: float = 30.0) -> None:
    """Return once none of ``pids`` still has ``sig`` pending (each handled, ignored or died of it; a dying
    one is given time to finish), so what the signal does to the data workers has happened."""
    bit = 1 << (sig - 1)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        live = {p: st for p, st in _group_members(os.getpgid(0)).items() if p in pids}
        if not any(int(ln.split()[1], 16) & bit for st in live.values() for ln in st.splitlines()
                   if ln.startswith(("SigPnd", "ShdPnd"))):
            time.sleep(0.2)  # one that took the signal's default action is exiting: let it finish
            return
        time.sleep(0.01)


__all__ = ["PreemptionFlag", "EXIT_PREEMPTED", "worker_ignore_signals", "signals_blocked", "maybe_test_signal",
           "test_hooks_from_env"]
