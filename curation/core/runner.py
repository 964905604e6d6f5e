"""One step shape, one runner.

A step is a picklable function ``fn(task_index, num_tasks, **kw)`` that reads memory-mapped arrays,
owns the rows :func:`task_rows` gives it, writes its results as part files atomically
(:func:`write_part`: tmp + ``os.replace``) and returns a small dict. It is rerun-safe: a task whose
part exists (:func:`part_done`) returns at once, so a killed task is simply started again.

:func:`run_step` launches ``W`` tasks of a step

* ``launcher="local"``: supervised processes on this machine (:mod:`curation.core.supervise`: a task that dies
  ends the call with exit 75 naming it; one fresh process per task, so each task's peak
  memory is its own and is reported back; the cores and the visible GPUs shared out between the tasks:
  CUDA_VISIBLE_DEVICES round-robin, :func:`task_gpus`);
* ``launcher="slurm"``: this process is one Slurm array task (SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT);
* ``launcher="dist"``: this process is one torch.distributed rank of the group the entry point made
  (``curate`` under torchrun / srun calls training's :func:`dinopipe.train.dist.init_distributed`, which has
  the srun-step guard; the curation layer itself never imports the train layer);
* ``launcher="srun"``: this process is the single process of a Slurm batch job allocated ``SLURM_NTASKS``
  tasks (``sbatch --nodes=K --ntasks=W``); each call starts one ``srun --ntasks=W`` job step running
  :mod:`curation.core.srun_task` -- the W tasks spread over the allocation's nodes; the call goes to them as
  an HMAC-signed spec file that a task checks before unpickling (:mod:`curation.core.srun`).

Each task's report carries its wall time and peak memory (:class:`PeakMemory`: RssAnon sampled, VmHWM), and with
``CURATE_TRACE_TASKS=1`` also tracemalloc's exact peak (:class:`TracedPeak`).

Rows are owned in whole blocks of ``block`` rows (:func:`task_rows`), so every block a task reads is
the one a single process would read: the same BLAS shapes, the same answer whatever ``W``.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
import tracemalloc
from typing import Callable

import numpy as np

from dinopipe.config import InputError
from dinopipe.utils.exits import UnfinishedError
from dinopipe.utils import debug_hooks
from dinopipe.utils.io import atomic_path
from dinopipe.utils.proc import map_large_allocations, usable_cores

from curation.core.supervise import die_here, dies_at, run_processes

# the srun launcher; its names stay importable from here
from curation.core.srun import run_srun

BLOCK = int(debug_hooks.get("curate_block") or 65536)
"""Rows per block: the unit a task owns, reads and (usually) writes (the debug hook ``curate_block``,
dinopipe/utils/debug_hooks.py: smaller blocks, so a small test pool still splits over several tasks)."""
LAUNCHERS = ("local", "slurm", "dist", "srun")


def task_rows(n: int, task_index: int, num_tasks: int, block: int | None = None) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``n`` owned by task ``task_index`` of ``num_tasks``: whole blocks, split evenly."""
    block = block or BLOCK
    if not 0 <= task_index < num_tasks:
        raise ValueError(f"task_index {task_index} is not in [0, {num_tasks})")
    nblocks = -(-n // block)
    lo, hi = nblocks * task_index // num_tasks, nblocks * (task_index + 1) // num_tasks
    return min(lo * block, n), min(hi * block, n)


def task_blocks(n: int, task_index: int, num_tasks: int, block: int | None = None):
    """The ``(start, stop)`` blocks of this task's rows."""
    block = block or BLOCK
    lo, hi = task_rows(n, task_index, num_tasks, block)
    return [(s, min(s + block, hi)) for s in range(lo, hi, block)]


def owned_pairs(first: np.ndarray, t: int, w: int) -> np.ndarray:
    """Indices of the pairs task ``t`` of ``w`` owns: the pairs whose first image is in its value range;
    the ranges split the pairs evenly at image boundaries (an image's pairs are all in one task)."""
    first = np.asarray(first, np.int64)
    if not len(first):
        return np.zeros(0, np.int64)
    s = np.sort(first)
    edges = [s[len(s) * i // w] for i in range(w)] + [s[-1] + 1]
    lo, hi = edges[t], edges[t + 1]
    return np.flatnonzero((first >= lo) & (first < hi)) if lo < hi else np.zeros(0, np.int64)


def part_path(folder: str, name: str, task_index: int, num_tasks: int) -> str:
    return os.path.join(folder, f"{name}-{task_index:05d}-of-{num_tasks:05d}.npz")


def part_done(path: str) -> bool:
    return os.path.exists(path)


def write_part(path: str, **arrays) -> None:
    """``np.savez`` to ``path`` atomically (a killed task leaves no half-written part)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_path(path, suffix=".npz") as tmp:
        np.savez(tmp, **arrays)


def save_blocks(path: str, values, dtype=None, block: int | None = None, fn=None) -> None:
    """``values`` (any sliceable of rows: an array, a memory-mapped one, unionfind.SparseRoots) saved as a (n,)
    ``.npy`` at ``path``, atomically (a killed write leaves no file), copied a block at a time: this process holds
    one block, never the whole array. ``fn(block, start)``: what is stored for a block (default: the block);
    ``dtype``: the file's type (default: ``values``' own)."""
    n, block = len(values), block or BLOCK
    dtype = np.dtype(dtype or values.dtype)
    with atomic_path(path, suffix=".npy") as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(n,))
        for s in range(0, n, block):
            v = np.asarray(values[s:s + block])
            out[s:s + len(v)] = v if fn is None else fn(v, s)
        out.flush()
        del out


def read_part(path: str) -> dict:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def part_blocks(path: str, block: int | None = None):
    """A part's arrays (all of one length, as :func:`write_part` stored them) ``block`` rows at a time: yields
    ``{name: rows [s, s + block)}``, read from the archive's members as they stream (np.savez stores them
    uncompressed), so the reader holds one block of each array, not the task's whole part."""
    import zipfile

    block = block or BLOCK
    with zipfile.ZipFile(path) as z:
        names = [n[:-4] for n in z.namelist() if n.endswith(".npy")]
        files, meta = {}, {}
        try:
            for k in names:
                f = files[k] = z.open(k + ".npy")
                version = np.lib.format.read_magic(f)
                header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _, dtype = header(f)
                if len(shape) != 1 or dtype.hasobject:
                    raise ValueError(f"{path}: part_blocks reads 1-d arrays of numbers, not {k} {shape} {dtype}")
                meta[k] = (shape[0], dtype)
            n = {m[0] for m in meta.values()}
            if len(n) > 1:
                raise ValueError(f"{path}: arrays of different lengths {sorted(n)}")
            n = n.pop() if n else 0
            for s in range(0, n, block):
                m = min(block, n - s)
                yield {k: np.frombuffer(files[k].read(m * meta[k][1].itemsize), meta[k][1], count=m) for k in names}
        finally:
            for f in files.values():
                f.close()


def parts(folder: str, name: str, num_tasks: int) -> list[str]:
    """All part files of a step; a missing one is an error naming it (a task that did not finish: exit 75, rerun;
    not the user's mistake, so not a FileNotFoundError, which the steps report as one)."""
    paths = [part_path(folder, name, t, num_tasks) for t in range(num_tasks)]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise UnfinishedError(f"{len(missing)} of {num_tasks} parts of '{name}' are missing "
                                f"(first: {missing[0]}): rerun those tasks")
    return paths


def read_rows(path: str, lo: int, hi: int, dtype=np.float32) -> np.ndarray:
    """Rows ``[lo, hi)`` of a ``.npy`` array, read through a mapping that is closed again, so a
    task's resident memory holds the block it works on, not every page of the file it walked."""
    m = np.load(path, mmap_mode="r")
    out = np.array(m[lo:hi], dtype=dtype)
    del m
    return out


class PeakMemory:
    """Peak anonymous memory (RssAnon, sampled) and peak RSS (VmHWM, incl. mapped file pages).

    The sampled RssAnon misses an allocation that lives shorter than ``every`` (faiss's 4096 x 1024
    fp32 distance tile in an IVF add, ~8-16 MB, is caught in some runs and not in others). VmHWM is the
    kernel's exact high-water mark: it is reset at the start (``clear_refs`` 5, Linux >= 4.0), so
    ``peak_rss - start_rss`` is exactly what the task added at its peak (``hwm_reset`` says if the reset
    worked; without it VmHWM also covers the interpreter's imports)."""

    def __init__(self, every: float = 0.05):
        self.peak_anon = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(every,), daemon=True)

    @staticmethod
    def _status() -> dict:
        out = {}
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k in ("RssAnon", "VmHWM", "VmRSS"):
                        out[k] = int(v.split()[0]) * 1024
        except OSError:
            pass
        return out

    def _run(self, every):
        while not self._stop.is_set():
            self.peak_anon = max(self.peak_anon, self._status().get("RssAnon", 0))
            self._stop.wait(every)

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS now
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        st = self._status()
        self.start_anon = st.get("RssAnon", 0)  # the interpreter + imports, before the task
        self.start_rss = st.get("VmRSS", 0)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak_anon = max(self.peak_anon, self._status().get("RssAnon", 0))
        hwm = self._status().get("VmHWM")
        self.peak_rss = hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


TRACE_ENV = "CURATE_TRACE_TASKS"
"""Set (to anything but ``0``): every task also runs under :class:`TracedPeak` (tests/curation/test_step_memory.py,
`curate simulate`); off by default, tracemalloc slows allocation-heavy Python code down."""


def tracing_tasks() -> bool:
    return os.environ.get(TRACE_ENV, "0") not in ("", "0")


class TracedPeak:
    """tracemalloc's peak around one task: the Python objects and numpy buffers it allocated at its peak, above
    what was allocated when it started (``peak``), and what it left allocated (``held``).

    Exact where RssAnon is sampled, and blind to mapped file pages (a memory-mapped array costs nothing until
    a task copies rows out of it). When tracemalloc already runs (an inline task under a caller that traces
    itself, e.g. `curate simulate`'s orchestrator), the caller's peak so far is kept in ``outer_peak`` before
    the task resets it, and ``base`` is what the caller held when the task started."""

    def __enter__(self):
        self.own = not tracemalloc.is_tracing()
        if self.own:
            tracemalloc.start()
        self.base, self.outer_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        return self

    def __exit__(self, *exc):
        cur, peak = tracemalloc.get_traced_memory()
        self.peak, self.held = peak - self.base, cur - self.base
        if self.own:
            tracemalloc.stop()
        else:
            tracemalloc.reset_peak()  # the caller's peak from here on (its earlier one is in outer_peak)

    def record(self) -> dict:
        return {"traced_peak": self.peak, "traced_held": self.held, "traced_base": self.base,
                "traced_outer_peak": None if self.own else self.outer_peak}


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES when set (ids or UUIDs, as given), else
    torch.cuda.device_count()'s 0..G-1; [] without GPUs (or without torch)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    try:
        import torch
    except ImportError:
        return []
    return [str(i) for i in range(torch.cuda.device_count())]


def task_gpus(gpus: list[str], task_index: int, num_tasks: int) -> list[str]:
    """Task ``task_index``'s share of ``gpus``, round-robin: with G >= W GPUs, every W-th one starting at its
    index (each task G/W of them, none shared); with fewer GPUs than tasks, GPU ``task_index % G`` (tasks
    share)."""
    if not gpus:
        return []
    if len(gpus) >= num_tasks:
        return gpus[task_index::num_tasks]
    return [gpus[task_index % len(gpus)]]


def run_measured(fn: Callable, task_index: int, num_tasks: int, kw: dict, gpus: list[str] | None = None,
              die: str | None = None) -> dict:
    """One task, measured. ``die`` ("start" / "end"): the kill_task debug hook's SIGKILL of this task process
    (curation.core.supervise.dies_at), before ``fn`` or after it returned."""
    if die == "start":
        die_here(task_index, getattr(fn, "__name__", "task"), die)
    if gpus:  # a fresh task process, CUDA not yet initialised: it sees only its share
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(task_gpus(gpus, task_index, num_tasks))
    map_large_allocations()  # a freed array's pages go back at once (the task holds its live arrays only)
    t0 = time.perf_counter()
    traced = TracedPeak() if tracing_tasks() else None
    with PeakMemory() as mem, (traced or contextlib.nullcontext()):
        out = fn(task_index, num_tasks, **kw) or {}
    if die == "end":
        die_here(task_index, getattr(fn, "__name__", "task"), die)
    return {"task": task_index, "wall_s": time.perf_counter() - t0, "peak_anon": mem.peak_anon,
            "start_anon": mem.start_anon, "peak_rss": mem.peak_rss, "start_rss": mem.start_rss,
            "hwm_reset": mem.hwm_reset, "result": out, **(traced.record() if traced else {})}


def env_task(launcher: str) -> tuple[int, int]:
    """``(task_index, num_tasks)`` of this process under ``launcher`` ('slurm' or 'dist')."""
    if launcher == "slurm":
        env = os.environ
        if "SLURM_ARRAY_TASK_ID" not in env:
            raise InputError("launcher=slurm: SLURM_ARRAY_TASK_ID is not set (submit with sbatch --array)")
        t = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        return t, int(env.get("SLURM_ARRAY_TASK_COUNT", "1"))
    if launcher == "dist":  # the group is made by the entry point (curation/cli.py: training's init_distributed)
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise InputError("launcher=dist: no process group; start through `curate` under torchrun or srun, "
                               "which sets it up as training does (dinopipe.train.dist.init_distributed)")
        return dist.get_rank(), dist.get_world_size()
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")


# Kept process-wide (issue 38): run_step is called many frames below the `with recording()` that wants its reports
# (simulate -> run_steps -> a step -> knn -> run_step), set only inside that block and restored on exit.
_RECORD: list | None = None


@contextlib.contextmanager
def recording():
    """While open, every :func:`run_step` of this process appends ``{"fn", "tasks", "inline", "reports"}`` to
    the yielded list (`curate simulate` and the growth bench: per step, how many tasks ran and each one's
    peak memory)."""
    global _RECORD
    old, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = old


@contextlib.contextmanager
def phase(name: str):
    """A single-process part of a step (index train, merge, grouping): while :func:`recording`, recorded like a
    one-task inline runner call named ``name`` (its wall time and heap), so the growth bench's JSON has it;
    otherwise nothing is measured."""
    if _RECORD is None:
        yield
        return
    t0 = time.perf_counter()
    with PeakMemory() as mem:
        yield
    _RECORD.append({"fn": name, "tasks": 1, "inline": True, "phase": True, "reports": [{
        "task": 0, "wall_s": time.perf_counter() - t0, "peak_anon": mem.peak_anon, "start_anon": mem.start_anon,
        "peak_rss": mem.peak_rss, "start_rss": mem.start_rss, "hwm_reset": mem.hwm_reset, "result": {}}]})


def task_record(report: dict) -> dict:
    """One task's report without its result, in MB: what a progress line keeps."""
    mb = 2 ** 20
    return {"task": report["task"], "wall_s": round(report["wall_s"], 3),
            "heap_mb": round(max(report["peak_anon"] - report["start_anon"], 0) / mb, 1),
            "peak_rss_mb": round(report["peak_rss"] / mb, 1),
            "rss_added_mb": round(max(report["peak_rss"] - report["start_rss"], 0) / mb, 1),
            "hwm_reset": report["hwm_reset"]}


@contextlib.contextmanager
def step_log(path: str | None, step: str):
    """Around one step of `curate run --progress FILE`: append one JSON line to ``path`` when the step ends:
    its wall time, the orchestrating process's peak heap and peak RSS, and every :func:`run_step` call it made
    with each task's record (:func:`task_record`). ``path`` None: nothing is measured."""
    if not path:
        yield
        return
    import json

    t0 = time.perf_counter()
    with recording() as rec, PeakMemory() as mem:
        yield
    line = {"step": step, "time": time.strftime("%H:%M:%S"), "wall_s": round(time.perf_counter() - t0, 3),
            "orchestrator_heap_mb": round(max(mem.peak_anon - mem.start_anon, 0) / 2 ** 20, 1),
            "orchestrator_peak_rss_mb": round(mem.peak_rss / 2 ** 20, 1),
            "runs": [{"fn": r["fn"], "tasks": r["tasks"], "inline": r["inline"], "phase": r.get("phase", False),
                      "reports": [task_record(x) for x in r["reports"]]} for r in rec]}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:  # appended as each step ends: a run stopped half-way still says what it measured
        f.write(json.dumps(line) + "\n")


def run_step(fn: Callable, num_tasks: int, launcher: str = "local", processes: int | None = None,
             **kw) -> list[dict]:
    """Run ``fn`` as ``num_tasks`` tasks; per task: wall time, peak memory and ``fn``'s result
    (recorded by :func:`recording`)."""
    map_large_allocations()  # the orchestrator too: it merges the parts
    res = _run_step(fn, num_tasks, launcher, processes, **kw)
    if _RECORD is not None:
        _RECORD.append({"fn": getattr(fn, "__name__", str(fn)), "tasks": num_tasks,
                        "inline": processes == 0 or (launcher == "srun" and num_tasks == 1 and processes != 1),
                        "reports": res})
    return res


def launch(launcher: str, num_tasks: int) -> dict:
    """:func:`run_step`'s ``launcher`` / ``processes`` for ``tasks.launcher`` (the plan's, curation.config.task_plan)
    and W: inline, or one srun task -> one after another in this process; srun -> W srun tasks; local -> W fresh
    processes (one too: the plan says local at W = 1 only under ``tasks.isolate``)."""
    if launcher == "inline" or (num_tasks == 1 and launcher != "local"):
        return {"launcher": "local", "processes": 0}
    if launcher == "srun":
        return {"launcher": "srun"}
    return {"launcher": "local", "processes": None}


def launch_one(launcher: str) -> dict:
    """:func:`run_step`'s arguments for a step that is ONE task but should not run in this process (the IVF
    training: its sample and k-means are then the task's memory, not the orchestrator's): srun -> an srun job
    step of one task (``processes=1``; :func:`launch` runs one srun task inline); anything else -> one fresh
    local process, which sees all of this process's cores and GPUs."""
    if launcher == "srun":
        return {"launcher": "srun", "processes": 1}
    return {"launcher": "local", "processes": None}


def launch_alone(launcher: str, num_tasks: int) -> dict:
    """:func:`run_step`'s arguments for a one-task call of a step planned as ``num_tasks`` tasks under ``launcher``:
    in this process when the step's tasks run inline, else :func:`launch_one` (a process or srun step of its own)."""
    return {"launcher": "local", "processes": 0} if inline(launcher, num_tasks) else launch_one(launcher)


def inline(launcher: str, num_tasks: int) -> bool:
    """Whether :func:`launch` runs the tasks in this process (else they reopen their inputs from files)."""
    return launch(launcher, num_tasks).get("processes") == 0


def _run_step(fn: Callable, num_tasks: int, launcher: str = "local", processes: int | None = None,
              **kw) -> list[dict]:
    """Run ``fn`` as ``num_tasks`` tasks; per task: wall time, peak memory and ``fn``'s result.

    local: all tasks, ``processes`` at a time (default ``num_tasks``), each in a fresh process;
    ``processes=0``: one after another in this process (tests, tiny pools).
    srun: all tasks, as one srun job step in this Slurm allocation (:func:`run_srun`); one task runs in this
    process unless ``processes=1`` (:func:`launch_one`).
    slurm / dist: only this process's own task (the others run in their own processes).
    """
    if launcher == "srun":
        if processes == 0 or (num_tasks == 1 and processes != 1):  # nothing to spread: as local inline
            return [run_measured(fn, t, num_tasks, kw) for t in range(num_tasks)]
        return run_srun(fn, num_tasks, kw)
    if launcher == "local":
        if processes == 0:
            return [run_measured(fn, t, num_tasks, kw) for t in range(num_tasks)]
        procs = min(processes or num_tasks, num_tasks)
        name = getattr(fn, "__name__", "task")
        old = os.environ.get("OMP_NUM_THREADS")
        # the cores shared out between the tasks running at once (faiss / BLAS would each take them all)
        os.environ["OMP_NUM_THREADS"] = os.environ.get("CURATE_TASK_THREADS") or str(max(1, usable_cores() // procs))
        # and the GPUs: each task its share of this process's visible GPUs (none: nothing changes)
        gpus = visible_gpus() if num_tasks > 1 else []
        die = dies_at(name, num_tasks)
        try:  # supervised: a task that dies ends the call with UnfinishedError (exit 75), never a hang
            return run_processes(run_measured, [(fn, t, num_tasks, kw, gpus, die.get(t)) for t in range(num_tasks)],
                                 procs, name)
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old
    t, w = env_task(launcher)
    if w != num_tasks:
        raise InputError(f"{launcher}: this job has {w} tasks, the step was asked for {num_tasks}")
    return [run_measured(fn, t, w, kw)]
