"""Hierarchical k-means quality: time, per-level SSE and NMI against the generating labels.

    python bench/bench_kmeans.py                 # 200k x 384, levels [4000, 400, 40, 10] (issue 13)
    python bench/bench_kmeans.py --quick         # 20k x 384, levels [400, 40, 4]
    python bench/bench_kmeans.py --variants before after kpp-20

Data (fp16, L2-normalised, as curation writes embeddings): 5,000 Gaussian clusters with Zipf
weights (p_j ~ 1/j) whose centres sit under 250 super-clusters; cosine of a point to its own
centre ~0.79. Every variant runs dinopipe's ``hierarchical_kmeans`` (sample sizes [1, 10, 5, 3],
10 resampling steps, "closest" sampling) on the same data in this process; ``before`` swaps in the
k-means dinopipe used before issue 13 (faiss.Kmeans: random seeding, 20 iterations). Level-l SSE
sums the squared distances of the level's items (points, then centroids) to their centroids; NMI
compares each point's level-1 cluster with its generating cluster, and its level-2 cluster with
its generating super-cluster. Prints ``name: value`` lines.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import faiss  # noqa: E402
import numpy as np  # noqa: E402

import curation.kmeans.hierarchical as K  # noqa: E402

VARIANTS = {  # name -> kmeans options (None: the pre-issue-13 faiss k-means)
    "before": None,
    "after": {},  # the defaults
    "random-50": {"init": "random"},
    "kpp-20": {"niter": 20, "tol": 0.0},
    "kpp-50-notol": {"tol": 0.0},
    "kpp-sample8": {"init_sample": 8},
    "kpp-sample16": {"init_sample": 16},
    "kpp-restarts2": {"n_init": 2},
}


def make_data(n: int, d: int = 384, n_clusters: int = 5000, n_super: int = 250,
              cos_to_centre: float = 0.79, seed: int = 0):
    """(n, d) fp16 unit rows, generating cluster labels, super-cluster labels."""
    rng = np.random.default_rng(seed)

    def unit(a):
        return a / np.linalg.norm(a, axis=1, keepdims=True)

    supers = unit(rng.standard_normal((n_super, d)))
    parent = rng.integers(n_super, size=n_clusters)
    centres = unit(supers[parent] + 0.8 * unit(rng.standard_normal((n_clusters, d))))
    p = 1.0 / np.arange(1, n_clusters + 1)
    labels = rng.choice(n_clusters, size=n, p=p / p.sum())
    sigma = np.sqrt(1.0 / cos_to_centre ** 2 - 1.0)  # |noise| = sigma -> cos = 1/sqrt(1+sigma^2)
    x = np.empty((n, d), np.float16)
    for s in range(0, n, 50_000):
        lab = labels[s:s + 50_000]
        noise = rng.standard_normal((len(lab), d)) * (sigma / np.sqrt(d))
        x[s:s + 50_000] = unit(centres[lab] + noise)
    return x, labels, parent[labels]


def faiss_kmeans_before(data, k, niter=20, seed=0, max_points_per_centroid=256, **_):
    """dinopipe's k-means before issue 13 (faiss random seeding, 20 iterations)."""
    rows = data if isinstance(data, K.Rows) else K.Rows(data)
    n, k = len(rows), int(min(k, len(rows)))
    rng = np.random.default_rng(seed)
    take = min(n, k * max_points_per_centroid)
    sample = np.sort(rng.choice(n, size=take, replace=False)) if take < n else np.arange(n)
    x = np.ascontiguousarray(rows.take(sample), dtype=np.float32)
    km = faiss.Kmeans(x.shape[1], k, niter=20, seed=seed, verbose=False, min_points_per_centroid=1,
                      max_points_per_centroid=max(take // k + 1, 1))
    km.train(x)
    return km.centroids.copy()


def run_variant(name: str, x, levels, sample_sizes, steps) -> dict:
    opts = VARIANTS[name]
    real = K.kmeans
    if opts is None:
        K.kmeans = faiss_kmeans_before
    try:
        t0 = time.perf_counter()
        tree = K.hierarchical_kmeans(x, levels, n_resampling_steps=steps, sample_size=sample_sizes,
                                     sampling="closest", seed=0, **(opts or {}))
        wall = time.perf_counter() - t0
    finally:
        K.kmeans = real
    return {"wall_s": wall, "tree": tree}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--levels", type=int, nargs="+", default=None)
    p.add_argument("--sample-sizes", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--variants", nargs="+", default=["before", "after"], choices=list(VARIANTS))
    a = p.parse_args(argv)
    from sklearn.metrics import normalized_mutual_info_score as nmi

    faiss.omp_set_num_threads(2)
    n = a.n or (20_000 if a.quick else 200_000)
    levels = a.levels or ([400, 40, 4] if a.quick else [4000, 400, 40, 10])
    sample_sizes = a.sample_sizes or [1, 10, 5, 3][: len(levels)]
    t0 = time.perf_counter()
    x, fine, coarse = make_data(n)
    print(f"data: {n} x {x.shape[1]} fp16, levels {levels}, sample sizes {sample_sizes}, "
          f"{a.steps} resampling steps ({time.perf_counter() - t0:.0f} s to generate)", flush=True)
    results = {}
    for name in a.variants:
        r = results[name] = run_variant(name, x, levels, sample_sizes, a.steps)
        tree = r["tree"]
        sse = [float(lvl.dist.sum(dtype=np.float64)) for lvl in tree]
        lab1 = tree[0].labels
        lab2 = tree[1].labels[lab1] if len(tree) > 1 else lab1
        r.update(sse=sse, nmi1=nmi(fine, lab1), nmi2=nmi(coarse, lab2))
        print(f"{name}_wall_s: {r['wall_s']:.1f}")
        for li, s in enumerate(sse):
            print(f"{name}_level{li + 1}_sse: {s:.1f}")
        print(f"{name}_level1_nmi: {r['nmi1']:.4f}")
        print(f"{name}_level2_nmi_super: {r['nmi2']:.4f}", flush=True)
    base = "before" if "before" in results else None
    for name, r in results.items():
        if base and name != base:
            print(f"{name}_vs_before_level1_sse_ratio: {r['sse'][0] / results[base]['sse'][0]:.4f}")
            print(f"{name}_vs_before_time_ratio: {r['wall_s'] / results[base]['wall_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
