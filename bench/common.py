"""Shared helpers for the benches: interleaved timing, peak memory, a GEMM FLOP-rate reference, reporting.

Why these choices (the machines are small and shared, so timings are noisy):

- **Timing.** Variants that are compared run *interleaved* in one loop (A B, B A, A B, ...), after warm-up,
  and a ratio is the median of the per-round ratios. Load from other processes then hits both sides of a
  pair alike, and the alternating order cancels slow drift. Raw medians are printed too.
- **Peak memory on CPU.** Two honest measures, both "bytes above what was live before the call":
  1. ``torch_peak_bytes``: every allocation and free that torch's CPU allocator makes during the call is
     recorded by ``torch.profiler`` (``profile_memory=True``); the running sum's maximum is the peak of live
     tensor bytes. This is the CPU analogue of ``torch.cuda.max_memory_allocated`` and is exact for tensor
     memory (it does not see malloc fragmentation or library scratch buffers outside torch's allocator).
  2. ``rss_peak_bytes``: the process's resident-set high-water mark (``VmHWM``, reset through
     ``/proc/self/clear_refs``) minus the resident set before the call. Run it in a fresh subprocess
     (``run_probe``) with glibc's mmap threshold pinned so that large freed buffers go back to the OS and
     are not silently reused from the heap (which would under-count). It sees everything the process
     touches, at page granularity. Linux only.
  On CUDA, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` is used instead.
- **OpenMP wait policy.** ``OMP_WAIT_POLICY`` defaults to ``PASSIVE`` here (set before torch loads; an
  explicit value in the environment wins). With libgomp's default spin-waiting, on a 2-core machine that
  other jobs also load, idle team threads spin on cores the working thread needs: measured here, a 6 MB
  ``index_add`` took ~75 ms with 2 threads vs ~2 ms with 1 thread or with PASSIVE, and a 2313x384x1536
  GEMM 36 ms vs 28 ms. Short memory-bound ops suffer most, which skews comparisons of code paths that
  differ in how many such ops they launch (e.g. subset stochastic depth). The policy is printed.
- **FLOP-rate reference.** A fp32 2048 x 2048 GEMM (2 n^3 FLOPs), timed in the same loop as the model so
  that the MFU compares rates measured under the same load.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterable, Optional

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # silence the profiler's start/stop chatter on stderr
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see the module docstring; must precede `import torch`

import torch  # noqa: E402

# Pinning the threshold disables glibc's dynamic raise (up to 32 MiB) after a large free, so buffers above
# it always come from mmap and return to the OS on free: the RSS high-water mark then tracks live memory.
PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "MALLOC_TRIM_THRESHOLD_": str(128 * 1024)}


# -- setup ---------------------------------------------------------------------------------------
def setup(threads: int = 2, seed: int = 0) -> None:
    """Fix the thread count (the machines have 2 cores shared with others) and the RNG."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# -- timing --------------------------------------------------------------------------------------
def interleaved_times(
    fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1, device: str = "cpu",
    cpu_times: Optional[dict[str, list[float]]] = None,
) -> dict[str, list[float]]:
    """Seconds per call of each function, run round-robin (order reversed every round) after warm-up.

    If ``cpu_times`` is given, it is filled with each call's process CPU seconds as well (``time.process_time``,
    all threads of this process). On a loaded shared machine CPU time is far steadier than wall time (it does
    not count time spent descheduled; measured here: a step's wall time ranged 1.8-8 s while its CPU time
    stayed within ~10%), but it does not see how well the work is spread over threads.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    if cpu_times is not None:
        cpu_times.update({name: [] for name in names})
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            fns[name]()
            sync(device)
            times[name].append(time.perf_counter() - t0)
            if cpu_times is not None:
                cpu_times[name].append(time.process_time() - c0)
    return times


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of num[i] / den[i] (both measured in the same round, so under the same load)."""
    return median(a / b for a, b in zip(num, den))


# -- FLOP-rate reference -------------------------------------------------------------------------
class Gemm:
    """fp32 n x n GEMM; call it to run ``inner`` products. ``rate(seconds)`` turns a call's time into FLOP/s."""

    def __init__(self, n: int = 2048, inner: int = 4, device: str = "cpu", dtype=torch.float32) -> None:
        self.n, self.inner = n, inner
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.b = torch.randn(n, n, device=device, dtype=dtype)
        self.c = torch.empty(n, n, device=device, dtype=dtype)

    def __call__(self) -> None:
        for _ in range(self.inner):
            torch.mm(self.a, self.b, out=self.c)

    @property
    def flops(self) -> float:
        return 2.0 * self.n**3 * self.inner

    def rate(self, seconds: float) -> float:
        return self.flops / seconds


# -- memory --------------------------------------------------------------------------------------
def torch_peak_bytes(fn: Callable[[], object], device: str = "cpu",
                     before: Optional[Callable[[], object]] = None) -> int:
    """Peak live tensor bytes allocated by ``fn`` above those live before it (see module docstring).

    ``before`` runs outside the measurement (e.g. drop old grads), so that frees of tensors allocated before
    profiling, which the CPU profiler cannot size, do not happen inside it.
    """
    if before is not None:
        before()
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == DeviceType.CPU and e.nbytes()]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()  # positive on allocation, negative on free
        peak = max(peak, live)
    return peak


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (RSS probes need Linux)")


def rss_peak_bytes(fn: Callable[[], object]) -> int:
    """Resident-set high-water mark during ``fn`` minus the resident set before it (Linux)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def run_probe(script: str, args: list[str], timeout: float = 900) -> dict:
    """Run ``script args`` in a fresh interpreter with PROBE_ENV; it must print one JSON line last."""
    env = dict(os.environ, **PROBE_ENV)
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe {script} {' '.join(args)} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- FLOPs (the analytic model is the planner's: dinopipe.plan.crop_forward_flops) -------------------
def counted_flops(fn: Callable[[], object]) -> int:
    """FLOPs of ``fn`` as torch.utils.flop_counter counts them (matmuls, convs, attention; fwd and bwd)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


# -- reporting -----------------------------------------------------------------------------------
def print_table(title: str, rows: list[tuple[str, ...]], header: Optional[tuple[str, ...]] = None) -> None:
    rows = [tuple(str(c) for c in r) for r in rows]
    all_rows = ([header] if header else []) + rows
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(all_rows[0]))]
    print(f"\n{title}")
    fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    if header:
        print(fmt.format(*header))
        print("  " + "  ".join("-" * w for w in widths))
    for r in rows:
        print(fmt.format(*r))


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_ratio(name: str, value: float) -> None:
    """The machine-readable line ``name: X.XX`` (goals go in the human-readable table)."""
    print(f"{name}: {value:.2f}")


__all__ = [
    "setup", "sync", "interleaved_times", "median", "paired_ratio", "Gemm", "torch_peak_bytes",
    "rss_peak_bytes", "run_probe", "counted_flops", "print_table",
    "fmt_s", "fmt_bytes", "print_ratio", "meets_goal",
]


def meets_goal(value: float, goal: str) -> bool:
    """``goal`` is '>= X' or '<= X'."""
    op, target = goal.split()
    return value >= float(target) if op == ">=" else value <= float(target)
