"""curate simulate: generate a pool whose answer is known, run every step after embedding as W tasks,
print per step the wall time and the peak memory of its largest task, and the recall of what was planted.

    curate simulate --n 1000000 --dim 384 --tasks 4 --work /tmp/sim

Memory per task is reported twice: ``anon`` (sampled RssAnon: the heap a task allocates, what has to fit)
and ``rss`` (VmHWM: also the pages of memory-mapped files it walked, which the kernel shares between the
tasks of a node and evicts under pressure). Pixel verification has no pixels here: its rate is measured on
real images (bench/bench_copy.py) and the planner (curate plan) extrapolates it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time

import numpy as np

from ..index import HNSW_EF_SEARCH, HNSW_MIN_NLIST, QUANTIZERS, ivf_nlist, resolve_quantizer
from ..steps import sampling
from ..steps.runner import parts, read_part, run_step
from . import generate as gen
from . import tasks as T

TRAIN_MAX = 1 << 18
SIM_LIST_SIZE = 1000  # vectors per IVF list: N / 1000 lists from 1M rows on (curate run: index.LIST_SIZE)
STEP_ORDER = ("generate", "hash_pairs", "hash_group", "index_train", "index_add", "index_merge", "search",
              "group", "decontaminate", "kmeans_train", "kmeans_assign", "kmeans_upper", "sample")


def _timed(table: dict, name: str, fn, num_tasks: int, progress: str | None = None, **kw):
    t0 = time.perf_counter()
    res = run_step(fn, num_tasks, **kw)
    row = table.setdefault(name, {"wall_s": 0.0, "task_s": 0.0, "tasks": num_tasks, "peak_anon_mb": 0.0,
                                  "peak_rss_mb": 0.0})
    row["wall_s"] += time.perf_counter() - t0
    row["task_s"] += max(r["wall_s"] for r in res)  # the slowest task's own time (no process start / imports)
    row["peak_anon_mb"] = max(row["peak_anon_mb"], max(r["peak_anon"] for r in res) / 2**20)
    row["peak_rss_mb"] = max(row["peak_rss_mb"], max(r["peak_rss"] for r in res) / 2**20)
    if progress:  # one JSON line per finished step: a run stopped half-way still says what it measured
        with open(progress, "a") as f:
            f.write(json.dumps({"step": name, "time": time.strftime("%H:%M:%S"), **row,
                                "tasks_s": [round(r["wall_s"], 2) for r in res],
                                "tasks_anon_mb": [round(r["peak_anon"] / 2**20, 1) for r in res]}) + "\n")
    return res


def simulate(work: str, n: int, dim: int = 384, tasks: int = 4, n_clusters: int = 1000, n_eval: int = 10000,
             overlap: int = 1000, copy_rate: float = 0.01, hash_rate: float = 0.01, max_distance: int = 4,
             nlist: int | None = None, nprobe: int = 8, k: int = 4, threshold: float = 0.9,
             levels=(1000, 100, 10), points_per_centroid: int = 64, niter: int = 10, target: float = 0.5,
             seed: int = 0, processes: int | None = None, list_size: int = SIM_LIST_SIZE, quantizer: str = "auto",
             query_fraction: float = 1.0, progress: str | None = None) -> dict:
    """Run the chain in ``work`` (created; existing parts are reused: a rerun skips finished tasks).

    IVF: ``nlist`` lists (default :func:`curation.index.ivf_nlist`: max(sqrt(N), N / list_size)), HNSW coarse
    quantizer from HNSW_MIN_NLIST = 40,000 lists on (``quantizer='auto'``). ``query_fraction`` < 1: only the rows whose per-row
    key falls under it query the index (the whole pool is indexed); the search time is then measured on them
    and extrapolated to N (``steps.search.task_s_at_n``), and the copy recall counts the planted pairs with
    a queried end only. ``progress``: append one JSON line per finished step to this file."""
    W = tasks
    table: dict = {}
    kw = {"processes": processes, "progress": progress}
    gen.create_arrays(work, n, dim)
    _timed(table, "generate", gen.generate_task, W, folder=work, n=n, dim=dim, n_clusters=n_clusters, seed=seed,
           copy_rate=copy_rate, hash_rate=hash_rate, max_distance=max_distance, **kw)
    gen.make_eval(work, n, dim, n_clusters, n_eval, overlap, seed)
    _timed(table, "hash_pairs", T.hash_pairs, W, folder=work, max_distance=max_distance, **kw)
    _timed(table, "hash_group", T.hash_group, 1, folder=work, parts_of=W, **kw)
    nl = nlist or ivf_nlist(n, list_size, sqrt_factor=1.0)
    qz = resolve_quantizer(quantizer, nl)
    # 32 training rows per list, at most TRAIN_MAX (the coarse k-means costs sample x nlist x D: capped, it
    # grows as nlist ~ N instead of nlist^2)
    _timed(table, "index_train", T.index_train, 1, folder=work, nlist=nl, train_size=min(32 * nl, TRAIN_MAX), seed=seed,
           quantizer=qz, **kw)
    res = _timed(table, "index_add", T.index_add, W, folder=work, **kw)
    # its two halves, in the slowest task: the coarse assignment (cost per vector grows with nlist: the IVF
    # cost model) and encoding + appending (constant per vector)
    table["index_add"].update(assign_task_s=max(r["result"]["assign_s"] for r in res),
                              encode_task_s=max(r["result"]["encode_s"] for r in res))
    _timed(table, "index_merge", T.index_merge, 1, folder=work, parts_of=W, **kw)
    res = _timed(table, "search", T.search, W, folder=work, k=k, threshold=threshold, nprobe=nprobe,
                 query_fraction=query_fraction, **kw)
    queries = sum(r["result"]["queries"] for r in res)
    srow = table["search"]
    srow.update(queries=queries, query_fraction=query_fraction,
                task_s_at_n=srow["task_s"] * n / max(queries, 1), wall_s_at_n=srow["wall_s"] * n / max(queries, 1))
    _timed(table, "group", T.group, 1, folder=work, parts_of=W, **kw)
    _timed(table, "decontaminate", T.decontaminate, W, folder=work, threshold=threshold, nprobe=nprobe, **kw)
    roots = T.flagged_roots(work, W)
    T._save_npy(os.path.join(work, "roots.npy"), roots)
    _timed(table, "kmeans_train", T.kmeans_train, 1, folder=work, k=levels[0],
           points_per_centroid=points_per_centroid, niter=niter, seed=seed, **kw)
    _timed(table, "kmeans_assign", T.kmeans_assign, W, folder=work, **kw)
    _timed(table, "kmeans_upper", T.kmeans_upper, 1, folder=work, levels=list(levels), niter=niter, seed=seed, **kw)
    t0 = time.perf_counter()
    _timed(table, "sample", T.sample_hist, W, folder=work, k=levels[0], parts_of=W, seed=seed, **kw)
    hist = sum(read_part(p)["hist"] for p in parts(os.path.join(work, "parts"), "hist", W))
    sizes, parents = [hist.sum(1)], []
    for li in range(2, len(levels) + 1):
        lab = np.load(os.path.join(work, f"labels_level{li}.npy"))
        parents.append(lab)
        sizes.append(np.bincount(lab, weights=sizes[-1], minlength=int(lab.max()) + 1).astype(np.int64))
    n_alive = int(sizes[0].sum())
    q = sampling.quota(sizes, parents, int(round(target * n_alive)), np.random.default_rng(seed))
    byte, need = sampling.boundary(hist, q)
    T._save_npy(os.path.join(work, "sample_byte.npy"), byte)
    _timed(table, "sample", T.sample_boundary, W, folder=work, parts_of=W, seed=seed, **kw)
    got = [read_part(p) for p in parts(os.path.join(work, "parts"), "boundary", W)]
    thr = sampling.thresholds(np.concatenate([g["labels"] for g in got]), np.concatenate([g["keys"] for g in got]),
                              need)
    T._save_npy(os.path.join(work, "sample_thr.npy"), thr)
    _timed(table, "sample", T.decide, W, folder=work, parts_of=W, seed=seed, **kw)
    table["sample"]["wall_s"] = time.perf_counter() - t0
    return {"n": n, "dim": dim, "tasks": W, "steps": table,
            "index": {"nlist": nl, "quantizer": qz, "nprobe": nprobe, "list_size": n / nl,
                      "hnsw_ef_search": HNSW_EF_SEARCH if qz == "hnsw" else None},
            "query_fraction": query_fraction, "queries": queries,
            **_score(work, W, roots, query_fraction)}


def _score(work: str, W: int, roots: np.ndarray, query_fraction: float = 1.0) -> dict:
    """Recall of the planted answer, counts, and a digest of the decisions (to compare W=1 with W=4).
    With a query fraction, the planted copies count when at least one of the pair queried the index."""
    tr = gen.truth(work, W)
    if query_fraction < 1.0:
        src, dst = tr["copy_src"], tr["copy_dst"]
        asked = T.is_queried(src, query_fraction) | T.is_queried(dst, query_fraction)
        tr["copy_src"], tr["copy_dst"] = src[asked], dst[asked]
    hg = np.load(os.path.join(work, "hash_group.npy"), mmap_mode="r")
    comp = np.load(os.path.join(work, "component.npy"), mmap_mode="r")
    digest, counts = hashlib.sha256(), np.zeros(len(T.STATUS), np.int64)
    for p in parts(os.path.join(work, "parts"), "decisions", W):
        st = read_part(p)["status"]
        digest.update(st.tobytes())
        counts += np.bincount(st, minlength=len(T.STATUS))
    for name in ("hash_group.npy", "component.npy"):  # the groups too, not only the statuses
        arr = np.load(os.path.join(work, name), mmap_mode="r")
        for s in range(0, len(arr), 1 << 22):
            digest.update(np.ascontiguousarray(arr[s:s + (1 << 22)]).tobytes())
    ov = tr["overlap"]

    def rate(x):
        return float(np.mean(x)) if len(x) else 1.0

    return {"recall": {"hash_near_duplicates": rate(hg[tr["hash_src"]] == hg[tr["hash_dst"]]),
                       "copies": rate(comp[tr["copy_src"]] == comp[tr["copy_dst"]]),
                       "eval_overlap": rate(np.isin(comp[ov], roots))},
            "planted": {"hash": len(tr["hash_src"]), "copies": len(tr["copy_src"]), "overlap": len(ov)},
            "copies_recall_over": "all planted pairs" if query_fraction >= 1.0 else
            f"planted pairs with a queried end (query fraction {query_fraction:g})",
            "counts": dict(zip(T.STATUS, counts.tolist())), "decisions_sha256": digest.hexdigest()}


def render(res: dict) -> str:
    lines = [f"simulate: N={res['n']:,} D={res['dim']} W={res['tasks']}",
             f"{'step':<15} {'tasks':>5} {'wall s':>9} {'task s':>9} {'heap MB':>9} {'rss MB':>9}"]
    for name, r in res["steps"].items():
        lines.append(f"{name:<15} {r['tasks']:>5} {r['wall_s']:>9.1f} {r['task_s']:>9.1f} {r['peak_anon_mb']:>9.0f} "
                     f"{r['peak_rss_mb']:>9.0f}")
    rc, ix, sr = res["recall"], res.get("index", {}), res["steps"].get("search", {})
    if ix:
        lines.append(f"index: IVF{ix['nlist']} ({ix['quantizer']} coarse quantizer"
                     + (f", efSearch {ix['hnsw_ef_search']}" if ix.get("hnsw_ef_search") else "")
                     + f"), SQ8, nprobe {ix['nprobe']}, ~{ix['list_size']:.0f} vectors per list")
    ad = res["steps"].get("index_add", {})
    if "assign_task_s" in ad:
        lines.append(f"index add, slowest task: coarse assignment {ad['assign_task_s']:.1f} s (grows with nlist), "
                     f"encode + append {ad['encode_task_s']:.1f} s")
    if res.get("query_fraction", 1.0) < 1.0:
        lines.append(f"search: MEASURED on {res['queries']:,} of {res['n']:,} query rows (query fraction "
                     f"{res['query_fraction']:g}, rows picked by a per-row hash key; the whole pool is indexed); "
                     f"EXTRAPOLATED to all N rows: task {sr['task_s_at_n']:.1f} s, wall {sr['wall_s_at_n']:.1f} s. "
                     f"Copy recall over the planted pairs with a queried end ({res['planted']['copies']:,}).")
    lines += [f"recall: planted hash near-duplicates {rc['hash_near_duplicates']:.4f}, planted copies "
              f"{rc['copies']:.4f}, planted eval overlap {rc['eval_overlap']:.4f} (measured)",
              "counts: " + ", ".join(f"{v} {k}" for k, v in res["counts"].items()),
              f"decisions sha256: {res['decisions_sha256']}",
              "pixel verification: no pixels in a simulation -- its pairs/s is measured on real images "
              "(bench/bench_copy.py); its time at N is extrapolated by `curate plan`, as is every step on "
              "other hardware (memory and time above are measured here)."]
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
    p.add_argument("--nlist", type=int, default=None, help="IVF lists (default max(sqrt(N), N / --list-size))")
    p.add_argument("--list-size", type=int, default=SIM_LIST_SIZE, help="target vectors per IVF list")
    p.add_argument("--quantizer", choices=QUANTIZERS, default="auto",
                   help=f"IVF coarse quantizer (auto: HNSW from {HNSW_MIN_NLIST} lists on, else flat)")
    p.add_argument("--nprobe", type=int, default=8)
    p.add_argument("--query-fraction", type=float, default=1.0,
                   help="search only this fraction of the rows (picked by a per-row hash key; the whole pool "
                        "is indexed); the search time is extrapolated to N")
    p.add_argument("--levels", type=int, nargs="+", default=[1000, 100, 10])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--progress", default=None, help="append one JSON line per finished step here")
    p.add_argument("--clean", action="store_true", help="delete --work afterwards")
    a = p.parse_args(argv)
    if a.n < 2 or a.tasks < 1 or a.dim < 8 or not 0.0 < a.query_fraction <= 1.0 or a.list_size < 1:
        print("curate simulate: need --n >= 2, --tasks >= 1, --dim >= 8, 0 < --query-fraction <= 1, "
              "--list-size >= 1", file=sys.stderr)
        return 2
    res = simulate(a.work, a.n, a.dim, a.tasks, a.clusters, min(a.n_eval, a.n), min(a.overlap, a.n_eval, a.n),
                   nlist=a.nlist, nprobe=a.nprobe, levels=tuple(a.levels), seed=a.seed, processes=a.processes,
                   list_size=a.list_size, quantizer=a.quantizer, query_fraction=a.query_fraction,
                   progress=a.progress)
    print(render(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.clean:
        shutil.rmtree(a.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
