"""curate simulate: generate a pool whose answer is known, run the chain curate run ships on it (every step
after embedding, W tasks each: curation.pipeline.run_steps), print per step the wall time, the tasks it ran and
the peak memory of its largest task, and the recall of what was planted.

    curate simulate --n 1000000 --dim 384 --tasks 4 --work /tmp/sim [--config FILE] [key=value ...]

The simulation runs the config curate run loads from the same --config and overrides and differs from it only in
its inputs (INPUT_KEYS; curation.simulate.chain): generated embeddings and hashes with the pool's tar shards
of small JPEGs, generated eval rows (and seeds in the retrieval modes), and a planted-truth verifier standing in
for the pixel verification. Memory per task is the heap a
task allocated (sampled RssAnon above its start: a local task process's own, an inline task's above the
orchestrator's) and, for the orchestrating process, its own peak heap during the step; with CURATE_TRACE_TASKS=1
also tracemalloc's exact peaks (each task's, the orchestrator's) and what a step left allocated. Pixel verification
has no pixels here: its rate is measured on real images (bench/bench_copy.py) and the planner (curate plan)
extrapolates it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import glob
import hashlib
import json
import os
import shutil
import sys
import time
import tracemalloc

import numpy as np

from dinopipe.config import ConfigError, exit_on_config_error

from curation.core import runner, srun
from curation.simulate import chain
from curation.core.layout import RunLayout



INPUT_KEYS = {
    "input.paths": "the generated pool: its tar shards of small synthetic JPEGs (WORK/pool)",
    "output.dir": "--work",
    "input.seed_paths": "in the retrieval modes only (rebalance.mode sample | cluster): the generated seed set "
                        "(WORK/seeds: its JPEGs, its rows pre-embedded in embeddings/seeds/)",
}
"""The only keys of the simulation's config that differ from what `curate run` runs with the same ``--config``
and ``key=value`` overrides: its inputs (docs/curate.md, "curate simulate"). ``--tasks W`` is the override
``tasks.count=W`` (``processes=0``: ``tasks.launcher=inline``; ``isolate``: ``tasks.isolate=true``), given to
both; the eval rows (``embeddings/eval/``) and the planted-truth verifier are generated inputs outside the
config (curation.pipeline.ChainInputs)."""

_LEGACY = {"max_distance": ["hash_dedup.max_distance"], "nlist": ["knn.nlist"], "nprobe": ["dedup.nprobe"],
           "k": ["dedup.k"], "threshold": ["dedup.threshold", "decontaminate.threshold"],
           "levels": ["rebalance.levels"], "chunk_size": ["knn.chunk_size"]}
"""simulate()'s keyword settings (None: the config's) and the config keys each one overrides."""


def run_overrides(tasks: int | None = None, processes: int | None = None, isolate: bool = False,
                  overrides=(), **settings) -> list[str]:
    """The ``key=value`` overrides of the run simulated (what `curate run` would be given): W, the launcher,
    the keyword settings of :func:`simulate` that are not None, then ``overrides`` (they win)."""
    out = [f"tasks.count={tasks}"] if tasks is not None else []
    out += ["tasks.launcher=inline"] if processes == 0 else []
    out += ["tasks.isolate=true"] if isolate else []
    for name, value in settings.items():
        if value is not None:
            text = f"[{','.join(str(v) for v in value)}]" if isinstance(value, (list, tuple)) else str(value)
            out += [f"{key}={text}" for key in _LEGACY[name]]
    return out + list(overrides)


def chain_config(work: str, overrides=(), config: str | None = None):
    """The config `curate run --config CONFIG OVERRIDES` loads, with only :data:`INPUT_KEYS` set to the
    simulation's inputs (validated as `curate run` validates it: ConfigError on a user mistake)."""
    from dinopipe.config import load_config

    from curation.config import CurationConfig, validate

    cfg = load_config(CurationConfig, config, list(overrides))
    cfg.input.paths = [chain.pool_dir(work)]
    cfg.output.dir = work
    check = copy.deepcopy(cfg)
    if retrieval(cfg):  # the seeds are generated (after this check, as the pool is): given, not there yet
        cfg.input.seed_paths, check.input.seed_paths = [chain.seeds_dir(work)], [os.curdir]
    validate(check, "dedup")  # as `curate run` does, but input.paths: generated after this check
    return cfg


def retrieval(cfg) -> bool:
    """The rebalance modes that retrieve around seed images (the simulation generates a seed set for them)."""
    return cfg.rebalance.mode in ("sample", "cluster")
    return cfg


def chain_steps(cfg) -> tuple[str, ...]:
    """The steps the simulation runs: `curate run`'s, but embedding (the pool is generated)."""
    from curation.pipeline import steps_of

    return tuple(s for s in steps_of("run", cfg) if s != "embed")


def _row(records: list, wall: float, mem, traced: dict | None = None) -> dict:
    runs = []
    for r in records:
        rep = r["reports"]
        runs.append({"fn": r["fn"], "tasks": r["tasks"], "inline": r["inline"],
                     "task_s": round(max(x["wall_s"] for x in rep), 3),
                     "task_heap_mb": round(max(x["peak_anon"] - x["start_anon"] for x in rep) / 2**20, 1),
                     "task_rss_mb": round(max(x["peak_rss"] for x in rep) / 2**20, 1),
                     # peak RSS above the task's start (VmHWM reset when it started): what tracemalloc misses too
                     # (faiss's and torch's native allocations, mapped pages the task touched)
                     "task_rss_added_mb": round(max(max(x["peak_rss"] - x["start_rss"], 0) for x in rep) / 2**20, 1)})
        if "traced_peak" in rep[0]:  # CURATE_TRACE_TASKS: tracemalloc's exact peak of each task, in bytes
            runs[-1]["task_traced_peaks"] = [x["traced_peak"] for x in rep]
    return {"wall_s": wall, "tasks": max([r["tasks"] for r in runs] or [1]),
            "task_s": sum(r["task_s"] for r in runs),
            "task_heap_mb": max([r["task_heap_mb"] for r in runs] or [0.0]),
            "orchestrator_heap_mb": round(max(mem.peak_anon - mem.start_anon, 0) / 2**20, 1),
            "orchestrator_rss_added_mb": round(max(mem.peak_rss - mem.start_rss, 0) / 2**20, 1), "runs": runs,
            **(traced or {})}


@contextlib.contextmanager
def _traced_step(records: list):
    """With CURATE_TRACE_TASKS: the orchestrating process's own tracemalloc peak during a step (bytes above its
    start; inline tasks' peaks are theirs, not its: what it held while they ran is), and the allocations of
    the step still alive at its end (blocks, bytes: what it retained). Fills the yielded dict."""
    got: dict = {}
    if not runner.tracing_tasks():
        yield got
        return
    with runner.TracedPeak() as outer:
        yield got
        gc.collect()  # cycles not collected yet are garbage, not retained
        blocks = len(tracemalloc.take_snapshot().traces)
    inner = [x["traced_outer_peak"] for r in records for x in r["reports"] if x.get("traced_outer_peak") is not None]
    got.update({"orchestrator_traced_peak": max([outer.peak] + [p - outer.base for p in inner]),
                "retained_blocks": blocks, "retained_bytes": outer.held})


def simulate(work: str, n: int, dim: int = 384, tasks: int = 4, n_clusters: int = 1000, n_eval: int = 10000,
             overlap: int = 1000, copy_rate: float = 0.01, hash_rate: float = 0.01, max_distance: int | None = None,
             nlist: int | None = None, nprobe: int | None = None, k: int | None = None,
             threshold: float | None = None, levels=None, seed: int = 0, processes: int | None = None,
             progress: str | None = None, chunk_size: int | None = None, query_fraction: float = 1.0,
             isolate: bool = False, overrides=(), config: str | None = None, n_seeds: int | None = None) -> dict:
    """Generate the pool in ``work`` (existing parts are reused: a rerun skips finished tasks), then run
    `curate run`'s steps after embedding on it with ``tasks.count=tasks`` (``processes=0``: the tasks inline,
    one after another in this process; else local processes; ``isolate``: W = 1 too, ``tasks.isolate``).
    ``progress``: one JSON line per finished step.
    ``query_fraction`` < 1: only that fraction of the rows queries the copy search (every row is indexed;
    :class:`curation.pipeline.ChainInputs`); the copies' recall then counts the planted pairs with a queried end."""
    from curation.pipeline import ChainInputs, run_steps
    from curation.embed.step import build_tables

    table: dict = {}
    block = runner.BLOCK
    t0 = time.perf_counter()
    cfg = chain_config(work, run_overrides(tasks, processes, isolate, overrides, max_distance=max_distance,
                                           nlist=nlist, nprobe=nprobe, k=k, threshold=threshold, levels=levels,
                                           chunk_size=chunk_size), config)
    w = cfg.tasks.count or tasks
    how = runner.launch(cfg.tasks.launcher, w) if cfg.tasks.launcher == "srun" else {
        "launcher": "local", "processes": processes}
    with runner.recording() as rec, runner.PeakMemory() as mem, _traced_step(rec) as traced, \
            srun.spool(RunLayout(work).steps("srun")):
        runner.run_step(chain.pool_task, w, **how, work=work, n=n, dim=dim, n_clusters=n_clusters, seed=seed,
                        copy_rate=copy_rate, hash_rate=hash_rate, max_distance=cfg.hash_dedup.max_distance,
                        block=block)
        # the path table as W tasks right after the pool's parts, as the embed step does after embedding
        build_tables(work, cfg.tasks)
        chain.write_eval(work, n, dim, n_clusters, n_eval, overlap, seed)
        if retrieval(cfg):
            chain.write_seeds(work, n_seeds or max(10, min(10_000, n // 100)), dim, n_clusters, seed)
    table["generate"] = _row(rec, time.perf_counter() - t0, mem, traced)
    inputs = ChainInputs(verifier=chain.planted_factory(work, n, block), eval_embedded=True,
                         query_fraction=query_fraction, seeds_embedded=retrieval(cfg))
    results = {}
    for step in chain_steps(cfg):
        t0 = time.perf_counter()
        with runner.recording() as rec, runner.PeakMemory() as mem, _traced_step(rec) as traced:
            results[step] = run_steps(cfg, [step], None, "simulate", inputs=inputs)[step]
        table[step] = _row(rec, time.perf_counter() - t0, mem, traced)
        if progress:  # a run stopped half-way still says what it measured
            with open(progress, "a") as f:
                f.write(json.dumps({"step": step, "time": time.strftime("%H:%M:%S"), **table[step]}) + "\n")
    return {"n": n, "dim": dim, "tasks": w, "config": dataclasses.asdict(cfg), "query_fraction": query_fraction,
            "chain": list(chain_steps(cfg)),
            "steps": table, "step_results": {s: r for s, r in results.items() if s != "write"},
            "arrays_sha256": step_digests(work), **_score(work, n, block, query_fraction)}


def _score(work: str, n: int, block: int, query_fraction: float = 1.0) -> dict:
    """Recall of the planted answer, counts (the manifest's, read from the decisions parts) and a digest of
    decisions.tsv (to compare W=1 with W=4)."""
    from curation.core.stepfiles import load_step
    from curation.core.status import DECONTAM, HASH_DUP

    tr = chain.truth(work, n, block)
    hg = np.load(RunLayout(work).steps("hash", "group.npy"), mmap_mode="r")
    dd, dc = load_step(work, "dedup", mmap=True), load_step(work, "decontaminate", mmap=True)
    comp = dd["component"]
    digest = hashlib.sha256()
    with open(RunLayout(work).decisions_tsv, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    with open(RunLayout(work).manifest) as f:
        counts = json.load(f)["counts"]
    src, dst = tr["copy_src"], tr["copy_dst"]
    if query_fraction < 1.0:  # a planted copy can be found when one of its rows queried the index
        from curation.knn.candidates import is_queried

        asked = is_queried(src, query_fraction) | is_queried(dst, query_fraction)
        src, dst = src[asked], dst[asked]
    ov = tr["overlap"]
    ov = ov[dd["status"][ov] != HASH_DUP]  # a hash duplicate left before decontamination

    def rate(x):
        return float(np.mean(x)) if len(x) else 1.0

    return {"recall": {"hash_near_duplicates": rate(hg[tr["hash_src"]] == hg[tr["hash_dst"]]),
                       "copies": rate(comp[src] == comp[dst]),
                       "eval_overlap": rate(dc["status"][comp[ov]] == DECONTAM)},
            "planted": {"hash": len(tr["hash_src"]), "copies": len(tr["copy_src"]), "overlap": len(ov),
                        **({"copies_with_a_queried_end": len(src)} if query_fraction < 1.0 else {})},
            "counts": counts, "decisions_sha256": digest.hexdigest()}


def step_digests(work: str) -> dict:
    """sha256 of every array a step wrote (``steps/**.npy``, ``knn/*.npy``; not the generated inputs), by path
    under ``work``."""
    out = {}
    for path in sorted(glob.glob(RunLayout(work).steps("**", "*.npy"), recursive=True)
                       + glob.glob(RunLayout(work).knn("*.npy"))):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        out[os.path.relpath(path, work)] = h.hexdigest()
    return out


def differing(digests: list[dict]) -> list[str]:
    """Paths whose digests are not the same in every run (missing in one counts as differing)."""
    paths = sorted(set().union(*digests)) if digests else []
    return [p for p in paths if len({d.get(p) for d in digests}) > 1]


def render(res: dict) -> str:
    qf = res.get("query_fraction", 1.0)
    lines = [f"simulate: N={res['n']:,} D={res['dim']} W={res['tasks']} (the chain of `curate run`: "
             f"{' -> '.join(res['chain'])})" + (f"; copy search: a query fraction of {qf:g} (every row indexed; "
                                                f"recall over the planted copies with a queried end)" if qf < 1 else ""),
             f"{'step':<15} {'tasks':>5} {'wall s':>9} {'task s':>9} {'task heap MB':>13} {'orch. heap MB':>14}"]
    for name, r in res["steps"].items():
        lines.append(f"{name:<15} {r['tasks']:>5} {r['wall_s']:>9.1f} {r['task_s']:>9.1f} {r['task_heap_mb']:>13.0f} "
                     f"{r['orchestrator_heap_mb']:>14.0f}")
        for run in r["runs"]:
            lines.append(f"  {run['fn']:<22} {run['tasks']:>3} task(s){' inline' if run['inline'] else ''}: "
                         f"{run['task_s']:.1f} s, heap {run['task_heap_mb']:.0f} MB")
    rc = res["recall"]
    lines += [f"recall: planted hash near-duplicates {rc['hash_near_duplicates']:.4f}, planted copies "
              f"{rc['copies']:.4f}, planted eval overlap {rc['eval_overlap']:.4f} (measured)",
              "counts: " + ", ".join(f"{v} {k}" for k, v in res["counts"].items()),
              f"decisions.tsv sha256: {res['decisions_sha256']}",
              "pixel verification: no pixels in a simulation (a planted-truth verifier runs in its place) -- its "
              "pairs/s is measured on real images (bench/bench_copy.py); its time at N is extrapolated by "
              "`curate plan`, as is every step on other hardware (memory and time above are measured here)."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="curate simulate", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100_000, help="pool rows")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--tasks", type=int, default=4, help="W: tasks of every sharded step")
    p.add_argument("--processes", type=int, default=None, help="local processes at a time (default: W)")
    p.add_argument("--work", required=True, help="scratch folder (embeddings, parts, index)")
    p.add_argument("--clusters", type=int, default=1000)
    p.add_argument("--eval", type=int, default=10000, dest="n_eval")
    p.add_argument("--overlap", type=int, default=1000)
    p.add_argument("--n-seeds", type=int, default=None,
                   help="seed images generated for rebalance.mode=sample|cluster (default: N/100, 10..10,000)")
    p.add_argument("--config", default=None, help="the YAML that curate run --config takes (default: its defaults)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, as curate run takes them (e.g. rebalance.mode=hierarchical)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--query-fraction", type=float, default=1.0,
                   help="only this fraction of the rows queries the copy search (a per-row key; every row is "
                        "indexed): the search's cost at sizes this machine cannot search whole")
    p.add_argument("--isolate", action="store_true",
                   help="W = 1 too: each task in a fresh process (tasks.isolate; its peak memory is its own)")
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--progress", default=None, help="append one JSON line per finished step here")
    p.add_argument("--clean", action="store_true", help="delete --work afterwards")
    a = p.parse_intermixed_args(argv)
    if a.n < 2 or a.tasks < 1 or a.dim < 8 or not 0.0 < a.query_fraction <= 1.0:
        print("curate simulate: need --n >= 2, --tasks >= 1, --dim >= 8, 0 < --query-fraction <= 1", file=sys.stderr)
        return 2
    try:
        res = simulate(a.work, a.n, a.dim, a.tasks, a.clusters, min(a.n_eval, a.n), min(a.overlap, a.n_eval, a.n),
                       seed=a.seed, processes=a.processes, progress=a.progress, query_fraction=a.query_fraction,
                       isolate=a.isolate, overrides=a.overrides, config=a.config, n_seeds=a.n_seeds)
    except ConfigError as exc:  # before anything is written (chain_config runs first)
        exit_on_config_error(exc)
    print(render(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.clean:
        shutil.rmtree(a.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
