"""Sharded kNN (curation.knn.shards): 4 search tasks run one after another vs 1 task, on an fp16 memmap.

    python bench/bench_sharded.py [--n 500000] [--dim 384] [--tasks 4] [--quick] [--keep]

The pool: unit vectors with 10% planted near-copies (cosine ~0.9), fp16, memory-mapped from a file
under $TMPDIR (deleted afterwards unless --keep). One IVF index (fp16 codes) is trained and saved,
then every search task runs in its own subprocess (so ``ru_maxrss`` is that task's peak memory).
Prints ``name: value`` lines: total time ratio (4 tasks / 1 task), peak RSS per task, whether the
merged pairs are identical, and pair recall against exact search on a sample of queries.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

K, THRESHOLD, NPROBE = 64, 0.6, 16


def make_pool(path: str, n: int, dim: int, seed: int = 0, block: int = 100_000) -> None:
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n, dim))
    rng = np.random.default_rng(seed)
    for s in range(0, n, block):
        x = rng.standard_normal((min(block, n - s), dim)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        cp = np.flatnonzero(rng.random(len(x)) < 0.1)
        cp = cp[cp > 0]
        src = (rng.random(len(cp)) * cp).astype(np.int64)  # an earlier row of the block
        y = x[src] + 0.5 * rng.standard_normal((len(cp), dim)).astype(np.float32) / np.sqrt(dim)
        x[cp] = y / np.linalg.norm(y, axis=1, keepdims=True)
        mm[s:s + len(x)] = x.astype(np.float16)
    mm.flush()
    del mm


def task(args) -> None:
    """One array task (run in a subprocess): search its chunks, report wall time and peak RSS."""
    from curation.knn.index import Rows
    from curation.knn.shards import KnnJob

    rows = Rows(np.load(args.data, mmap_mode="r"))
    with open("/proc/self/status") as f:  # what the imports (numpy, faiss, torch via curation) hold
        base = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = KnnJob(args.job).search_pairs(rows, args.task, args.tasks, use_gpu=False)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out.update(seconds=time.perf_counter() - t0, cpu_seconds=ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime,
               maxrss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, base_mib=base)
    print(json.dumps(out))


def run_tasks(data: str, job_dir: str, tasks: int) -> list[dict]:
    res = []
    for t in range(tasks):  # one after another, as a 1-node array would on this 2-core machine
        r = subprocess.run([sys.executable, __file__, "--task", str(t), "--tasks", str(tasks), "--data", data,
                            "--job", job_dir], capture_output=True, text=True, check=True)
        res.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return res


def exact_pairs(mm, queries: np.ndarray, block: int = 200_000) -> set:
    """The k nearest others of each sampled query by brute force (fp32 matmul), kept above the
    threshold when their exact float64 cosine is."""
    q = mm[queries].astype(np.float32)
    sims = np.full((len(q), K + 1), -np.inf, np.float32)
    idx = np.full((len(q), K + 1), -1, np.int64)
    for s in range(0, len(mm), block):
        x = np.asarray(mm[s:s + block], np.float32)
        d = q @ x.T
        cat_s, cat_i = np.concatenate([sims, d], 1), np.concatenate([idx, np.arange(s, s + len(x))[None].repeat(len(q), 0)], 1)
        top = np.argpartition(-cat_s, K, axis=1)[:, :K + 1]
        sims, idx = np.take_along_axis(cat_s, top, 1), np.take_along_axis(cat_i, top, 1)
    out = set()
    for qi, row_i in zip(queries, idx):
        for j in row_i:
            if j != qi:
                c = float(np.dot(mm[qi].astype(np.float64), mm[j].astype(np.float64)))
                if c > THRESHOLD:
                    out.add((min(qi, j), max(qi, j)))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=500_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="50k rows")
    p.add_argument("--keep", action="store_true", help="keep the memmap and index")
    p.add_argument("--task", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.task is not None:
        task(args)
        return 0
    from curation.knn.index import Rows
    from curation.knn.shards import KnnJob, merge_pairs

    n = 50_000 if args.quick else args.n
    root = tempfile.mkdtemp(prefix="bench_sharded_")
    try:
        data = os.path.join(root, "pool.npy")
        t0 = time.perf_counter()
        make_pool(data, n, args.dim)
        print(f"pool: {n} x {args.dim} fp16 memmap, {os.path.getsize(data) / 2**20:.0f} MiB "
              f"(generated in {time.perf_counter() - t0:.0f} s)", flush=True)
        rows = Rows(np.load(data, mmap_mode="r"))
        params = {"k": K, "threshold": THRESHOLD, "kind": "ivf", "nprobe": NPROBE, "rows": "bench"}
        one, many = os.path.join(root, "one"), os.path.join(root, "many")
        t0 = time.perf_counter()
        meta = KnnJob(one).build(rows, params, use_gpu=False)
        print(f"index: {meta['kind']}, {meta['index_bytes'] / 2**20:.0f} MiB, trained + filled in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        shutil.copytree(os.path.join(one, "knn"), os.path.join(many, "knn"))
        r1 = run_tasks(data, one, 1)
        rn = run_tasks(data, many, args.tasks)
        t1, tn = r1[0]["seconds"], sum(r["seconds"] for r in rn)
        print(f"sharded_total_time_ratio ({args.tasks} tasks / 1 task): {tn / t1:.2f}  ({tn:.0f} s vs {t1:.0f} s)")
        c1, cn = r1[0]["cpu_seconds"], sum(r["cpu_seconds"] for r in rn)
        print(f"sharded_cpu_time_ratio ({args.tasks} tasks / 1 task): {cn / c1:.2f}  ({cn:.0f} s vs {c1:.0f} s; "
              "CPU time is less sensitive than wall time to other jobs on the machine)")
        print(f"peak_rss_1_task_mib: {r1[0]['maxrss_mib']:.0f} (after imports: {r1[0]['base_mib']:.0f})")
        print(f"peak_rss_per_task_mib ({args.tasks} tasks): {max(r['maxrss_mib'] for r in rn):.0f} "
              "(each: " + ", ".join(f"{r['maxrss_mib']:.0f}" for r in rn) + f"; after imports: {rn[0]['base_mib']:.0f})")
        pa = [KnnJob(d).read(n) for d in (one, many)]
        m1, mn = (merge_pairs(r["a"], r["b"], r["sim"]) for r in pa)
        same = all(np.array_equal(u, v) for u, v in zip(m1, mn))
        print(f"pairs_identical: {same} ({len(m1[0])} pairs)")
        rng = np.random.default_rng(1)
        sample = np.sort(rng.choice(n, size=min(n, 1000), replace=False))
        mm = np.load(data, mmap_mode="r")
        truth = exact_pairs(mm, sample)
        found = set(zip(m1[0].tolist(), m1[1].tolist()))
        hit = sum(1 for pr in truth if pr in found)
        print(f"pair_recall_vs_exact: {hit / max(1, len(truth)):.4f} ({hit} of {len(truth)} exact pairs "
              f"of {len(sample)} sampled queries)")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
