"""Per-rank memory of the distributed hierarchical k-means (every level sharded), at two k.

    python bench/bench_kmeans_shards.py --work /tmp/kms --n 32000 --dim 256 --ks 8000 32000 --nproc 1 3

Writes N clustered fp16 rows, then runs `curate kmeans` (torchrun, gloo) for each k and world size with
pieces of --piece-mb and two levels, k and k / --upper (level 2 clusters level 1's k centroids, resampled
once with 4 per cluster), and prints per level the centroid bytes each rank holds (its pieces + one received
piece + one piece of sums: tracked exactly) and each rank's peak RSS (ru_maxrss: the interpreter, torch,
faiss, its rows' blocks)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from curation.core.embstore import mark_task_done, save_shard, shard_stem  # noqa: E402


def write_pool(path: str, n: int, d: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((1000, d))
    x = c[rng.integers(0, 1000, n)] + 0.5 * rng.standard_normal((n, d))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)
    for i, s in enumerate(range(0, n, 8192)):
        ids = [f"img{j:08d}" for j in range(s, min(s + 8192, n))]
        save_shard(path, shard_stem(0, i), x[s:s + 8192], {"ids": ids, "sources": ["synthetic"] * len(ids),
                                                           "hashes": ["0"] * len(ids), "unreadable": []})
    mark_task_done(path, 0, 1, {"n": n})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True)
    p.add_argument("--n", type=int, default=32000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--ks", type=int, nargs="+", default=[4000, 16000])
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    p.add_argument("--piece-mb", type=float, default=1.0)
    p.add_argument("--niter", type=int, default=2)
    p.add_argument("--upper", type=int, default=4, help="level 2 has k / UPPER clusters")
    a = p.parse_args()
    emb = os.path.join(a.work, "emb")
    if not os.path.isdir(emb):
        write_pool(emb, a.n, a.dim)
    rows = []
    for k in a.ks:
        for nproc in a.nproc:
            out = os.path.join(a.work, f"k{k}-w{nproc}")
            port = 29700 + len(rows)
            launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                                              f"--master-port={port}"]
            env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MASTER_PORT=str(port))
            cmd = [sys.executable, *launcher, "-m", "curation.cli", "kmeans", "--emb-dir", emb, "--out", out,
                   "--levels", str(k), str(k // a.upper), "--sample-sizes", "1", "4", "--steps", "1",
                   "--niter", str(a.niter),
                   "--init", "random", "--piece-mb", str(a.piece_mb), "--max-points-per-centroid", "8"]
            r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
            if r.returncode:
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
            with open(os.path.join(out, "kmeans.json")) as f:
                summary = json.load(f)
            for li, lv in enumerate(summary["per_level"], start=1):
                rows.append((li, lv["k"], lv["rows"], nproc, lv["pieces"], lv["centroid_bytes_per_rank"],
                             summary["level1"]["peak_rss_bytes"], summary["wall_s"]))
    print(f"N={a.n:,} D={a.dim} pieces of {a.piece_mb} MB, {a.niter} Lloyd iterations, gloo on CPU")
    print("| level | k | rows | ranks | pieces | k x D fp32 (MB) | centroid MB held per rank | peak RSS per rank (MB) "
          "| wall s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for li, k, n, w, pcs, held, rss, wall in rows:
        print(f"| {li} | {k:,} | {n:,} | {w} | {pcs} | {k * a.dim * 4 / 2**20:.1f} | {held / 2**20:.1f} | "
              f"{' / '.join(f'{x / 2**20:.0f}' for x in rss)} | {wall:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
