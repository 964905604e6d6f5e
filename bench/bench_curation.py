"""Curation benchmarks (issue 3), each a pair measured in one run; prints ``name: value`` lines + a table.

1. copy-dedup on N x 384 clustered synthetic embeddings (fp16 .npy, memory-mapped) with the default
   index (IVF for N > 50k) vs exact flat search. Exact search over all N queries would take hours on 2
   cores, so it is timed on a subset of Q queries and extrapolated *linearly in the number of queries*
   (exact search cost is the same for every query: one pass over the N vectors); index build is added
   once. Recall: pairs with cosine > 0.6 found by exact search for those Q queries (half of them are
   rows of planted duplicate pairs, half random rows) that IVF's 64-NN lists also contain -- from either
   end, since copy_dedup queries every row and links a pair when one end lists the other (the one-sided
   figure, b in a's list, is printed too).
   Goal: >= 5x faster at >= 0.98 recall.
2. embedding throughput of the full step (files -> DataLoader workers decode + resize -> model ->
   fp16 shards) over model-only forward throughput on the same (pre-transformed) images; vit_s14
   (random init; speed does not depend on the weights) on CPU, ~64 real photos. Goal >= 0.8.
3. hierarchical k-means (4 levels, Vo et al. resampling) on N x 384: wall time and peak memory
   (resident high-water mark of a fresh subprocess, VmHWM reset at its start -- ru_maxrss would
   inherit the parent's peak across fork+exec; it includes the touched pages of the memory-mapped file).

    python bench/bench_curation.py            # N = 1M (about 15 min on 2 cores)
    python bench/bench_curation.py --quick    # N = 100k
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
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from bench.common import interleaved_times, paired_ratio, print_ratio, print_table, setup  # noqa: E402

THRESHOLD = 0.6


# ----------------------------------------------------------------------------- synthetic data


def synth_embeddings(path: str, n: int, d: int = 384, n_centers: int = 2000, dup_frac: float = 0.01,
                     seed: int = 0, chunk: int = 100_000) -> np.ndarray:
    """Clustered unit vectors (Zipf cluster sizes; cosine ~0.6 to the centre, ~0.36 within a cluster,
    ~0 across) with ``dup_frac`` of rows replaced by perturbed copies of other rows (cosine 0.7..0.98).
    Written as fp16 .npy; returns the (M, 2) planted pairs (copy row, original row)."""
    from numpy.lib.format import open_memmap

    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((n_centers, d)).astype(np.float32)
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    p = 1.0 / np.arange(1, n_centers + 1)
    p /= p.sum()
    mm = open_memmap(path, mode="w+", dtype=np.float16, shape=(n, d))
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        lab = rng.choice(n_centers, size=m, p=p)
        u = rng.standard_normal((m, d)).astype(np.float32)
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        x = 0.6 * centers[lab] + 0.8 * u
        mm[s:s + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
    n_dup = int(dup_frac * n)
    rows = rng.choice(n, size=2 * n_dup, replace=False)
    copies, originals = rows[:n_dup], rows[n_dup:]
    for s in range(0, n_dup, chunk):
        c, o = copies[s:s + chunk], originals[s:s + chunk]
        u = rng.standard_normal((len(c), d)).astype(np.float32)
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        x = mm[o].astype(np.float32) + rng.uniform(0.2, 1.0, (len(c), 1)).astype(np.float32) * u
        mm[c] = x / np.linalg.norm(x, axis=1, keepdims=True)
    mm.flush()
    del mm
    return np.stack([copies, originals], axis=1)


# ----------------------------------------------------------------------------- 1. copy dedup


def bench_dedup(path: str, pairs: np.ndarray, n_queries: int, nprobe: int, seed: int = 0) -> dict:
    import curation.dedup.copies as dedup_mod
    from curation.dedup.copies import copy_dedup
    from curation.knn.index import build_index

    mm = np.load(path, mmap_mode="r")
    n = len(mm)
    ids = np.array([f"{i:09d}" for i in range(n)], dtype=object)
    captured = {}
    orig_build = dedup_mod.build_index

    def _capture(*a, **kw):  # keep the index copy_dedup built, to read its kNN lists afterwards
        captured["index"] = orig_build(*a, **kw)
        return captured["index"]

    dedup_mod.build_index = _capture
    try:
        t0 = time.perf_counter()
        res = copy_dedup(mm, ids, k=64, threshold=THRESHOLD, index_kind="auto", nprobe=nprobe,
                         use_gpu=False, progress=True)
        t_default = time.perf_counter() - t0
    finally:
        dedup_mod.build_index = orig_build
    rng = np.random.default_rng(seed)
    dup_rows = np.unique(pairs.ravel())
    q = np.unique(np.concatenate([rng.choice(dup_rows, size=min(n_queries // 2, len(dup_rows)),
                                             replace=False),
                                  rng.choice(n, size=n_queries // 2, replace=False)]))
    t0 = time.perf_counter()
    flat = build_index(mm, kind="flat", use_gpu=False)
    t_flat_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    exact = _knn_dict(flat, mm, q)
    t_flat_search = time.perf_counter() - t0
    approx = _knn_dict(captured["index"], mm, q)
    gt = {(a, b) for a, (s, i) in exact.items() for b, v in zip(i, s) if v > THRESHOLD and b >= 0}
    found = {(a, b) for a, (s, i) in approx.items() for b, v in zip(i, s) if v > THRESHOLD and b >= 0}
    # copy_dedup queries every row, so a pair {a, b} becomes an edge when either end lists the other:
    # query the partners too (their approximate lists are exactly what copy_dedup saw).
    partners = np.array(sorted({b for _, b in gt} - set(approx)), dtype=np.int64)
    back = _knn_dict(captured["index"], mm, partners) if len(partners) else {}
    back.update(approx)
    found_either = {(a, b) for a, b in gt if (a, b) in found or a in back[b][1][back[b][0] > THRESHOLD]}
    comp = res.component
    same_comp = sum(comp[a] == comp[b] for a, b in gt)
    t_flat = t_flat_build + t_flat_search * n / len(q)
    return {"n": n, "queries_exact": len(q), "index": res.index_kind, "nprobe": nprobe,
            "t_default": t_default, "t_flat_build": t_flat_build, "t_flat_search_subset": t_flat_search,
            "t_flat_extrapolated": t_flat, "speedup": t_flat / t_default,
            "gt_pairs": len(gt), "directed_recall": len(gt & found) / max(len(gt), 1),
            "pair_recall": len(found_either) / max(len(gt), 1),
            "component_recall": same_comp / max(len(gt), 1),
            "duplicates_removed": res.n_duplicates, "planted_copies": len(pairs)}


def _knn_dict(index, mm, q) -> dict:
    from curation.knn.index import Rows, iter_knn

    out = {}
    # The queries are a subset, so positions in the query view are not row ids: fetch one more
    # neighbour and drop the row itself by its id (iter_knn's exclude_self assumes all rows).
    for pos, sims, idx in iter_knn(index, Rows(mm, q), 65):
        for j, p in enumerate(pos):
            a = int(q[p])
            keep = idx[j] != a
            out[a] = (sims[j][keep][:64], idx[j][keep][:64])
    return out


# ----------------------------------------------------------------------------- 2. embedding


def bench_embed(n_images: int, batch_size: int, num_workers: int, repeats: int) -> dict:
    import torch

    from curation.embed.embedder import build_embedder
    from curation.embed.embeddings import embed_pool
    from dinopipe.data.decode import safe_decode
    from dinopipe.data.samples import encode, make_copy, real_photos
    from dinopipe.data.sources import as_multi

    photos = real_photos()
    names = sorted(photos)
    tmp = Path(tempfile.mkdtemp(prefix="bench_embed_"))
    img_dir = tmp / "photos"
    img_dir.mkdir()
    kinds = ("", "resize", "crop", "jpeg")
    i = 0
    while i < n_images:  # the photos, then copies of them: all real image bytes of varied sizes
        name, kind = names[i % len(names)], kinds[(i // len(names)) % len(kinds)]
        arr = photos[name] if not kind else make_copy(photos[name], kind)
        (img_dir / f"{i:04d}_{name}.jpg").write_bytes(encode(arr, quality=90))
        i += 1
    emb = build_embedder("vit_s14", image_size=224, device="cpu", precision="fp32")
    src = as_multi([str(img_dir)])
    tensors = [emb.transform(safe_decode(src.read(r))[0]) for r in src.refs()]
    batches = [torch.stack(tensors[s:s + batch_size]) for s in range(0, len(tensors), batch_size)]
    runs = [0]

    def full():
        runs[0] += 1
        out = tmp / f"emb{runs[0]}"
        embed_pool([str(img_dir)], emb, str(out), batch_size=batch_size, num_workers=num_workers,
                   transform=emb.transform, hash_name=None, progress=False)
        shutil.rmtree(out)

    def model_only():
        with torch.no_grad():
            for b in batches:
                emb(b)

    times = interleaved_times({"full": full, "model": model_only}, repeats=repeats, warmup=1)
    shutil.rmtree(tmp)
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"images": len(tensors), "batch_size": batch_size, "num_workers": num_workers,
            "full_img_s": len(tensors) / med["full"], "model_img_s": len(tensors) / med["model"],
            "ratio": paired_ratio(times["model"], times["full"])}


# ----------------------------------------------------------------------------- 3. hierarchical k-means


def probe_hkmeans(path: str, levels: list[int], resampling: int) -> None:
    """Run in a fresh interpreter: hierarchical k-means on the memmap; print JSON (time, ru_maxrss)."""
    from curation.kmeans.hierarchical import hierarchical_kmeans

    mm = np.load(path, mmap_mode="r")
    # ru_maxrss survives fork+exec (Linux keeps the parent's high-water mark), so the peak is read
    # as VmHWM after resetting it here; ru_maxrss is printed too, for what it is worth.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    tree = hierarchical_kmeans(mm, levels, n_resampling_steps=resampling, sample_size=10,
                               progress=True)
    wall = time.perf_counter() - t0
    peak = _status_bytes("VmHWM")
    print(json.dumps({"wall_s": wall, "peak_rss": peak, "baseline_rss": base,
                      "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "level_sizes": [len(l.sizes) for l in tree]}))


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))


def bench_hkmeans(path: str, levels: list[int], resampling: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--_probe-hkmeans", path,
                           "--levels", *map(str, levels), "--resampling", str(resampling)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"hierarchical k-means probe failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N = 100k instead of 1M")
    p.add_argument("--n", type=int, default=None, help="synthetic embeddings (default 1M, 100k quick)")
    p.add_argument("--queries", type=int, default=4000, help="exact-search queries to extrapolate from")
    p.add_argument("--nprobe", type=int, default=16)
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--levels", type=int, nargs="+", default=[1000, 300, 100, 30])
    p.add_argument("--resampling", type=int, default=10)
    p.add_argument("--only", choices=("dedup", "embed", "hkmeans"), nargs="+", default=None)
    p.add_argument("--workdir", default=None, help="where the synthetic .npy goes (default: tmp)")
    p.add_argument("--_probe-hkmeans", dest="probe", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    setup(threads=2)
    if a.probe:
        probe_hkmeans(a.probe, a.levels, a.resampling)
        return 0
    n = a.n or (100_000 if a.quick else 1_000_000)
    only = set(a.only or ("dedup", "embed", "hkmeans"))
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench_curation_"))
    work.mkdir(parents=True, exist_ok=True)
    path = str(work / f"synth_{n}.npy")
    rows, out = [], {}
    t0 = time.perf_counter()
    pairs = synth_embeddings(path, n) if only & {"dedup", "hkmeans"} else None
    if pairs is not None:
        print(f"synthetic {n} x 384 fp16 ({os.path.getsize(path) / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    if "dedup" in only:
        r = out["dedup"] = bench_dedup(path, pairs, a.queries, a.nprobe)
        rows += [
            (f"copy-dedup {n:,} x 384, {r['index']} nprobe={r['nprobe']} (k=64)", f"{r['t_default']:.1f} s",
             "the whole step: build + all queries + union-find"),
            ("copy-dedup exact flat (extrapolated)", f"{r['t_flat_extrapolated']:.1f} s",
             f"build {r['t_flat_build']:.1f} s + {r['t_flat_search_subset']:.1f} s for "
             f"{r['queries_exact']} queries x {n / r['queries_exact']:.0f}"),
            ("  speed-up (goal >= 5x)", f"{r['speedup']:.1f}x", ""),
            ("  recall of exact pairs cos > 0.6 (goal >= 0.98)", f"{r['pair_recall']:.4f}",
             f"{r['gt_pairs']} pairs from the exact subset, found from either end (as copy_dedup does)"),
            ("  one-sided recall", f"{r['directed_recall']:.4f}", "b in a's IVF 64-NN list, a the query"),
            ("  same-component recall", f"{r['component_recall']:.4f}", "pairs ending in one copy group"),
        ]
    if "embed" in only:
        r = out["embed"] = bench_embed(a.images, a.batch_size, a.workers, a.repeats)
        rows += [
            (f"embed full step, vit_s14 CPU, {r['images']} photos, {r['num_workers']} workers",
             f"{r['full_img_s']:.1f} img/s", "decode + resize + model + fp16 shards"),
            ("embed model-only forward", f"{r['model_img_s']:.1f} img/s", "same images, pre-transformed"),
            ("  full / model-only (goal >= 0.8)", f"{r['ratio']:.2f}", "median of paired rounds"),
        ]
    if "hkmeans" in only:
        r = out["hkmeans"] = bench_hkmeans(path, a.levels, a.resampling)
        rows += [
            (f"hierarchical k-means {n:,} x 384, levels {r['level_sizes']}, {a.resampling} resampling",
             f"{r['wall_s']:.1f} s", ""),
            ("  peak resident memory (VmHWM)", f"{r['peak_rss'] / 2**30:.2f} GiB",
             f"fresh process, {r['baseline_rss'] / 2**30:.2f} GiB before; incl. mapped file pages"),
        ]
    print_table(f"bench_curation ({'quick' if a.quick else 'full'}, 2 threads)", rows,
                ("measurement", "value", "how"))
    print()
    if "dedup" in out:
        print_ratio("copy_dedup_ivf_speedup_vs_flat", out["dedup"]["speedup"])
        print(f"copy_dedup_ivf_pair_recall: {out['dedup']['pair_recall']:.4f}")
        print(f"copy_dedup_ivf_one_sided_recall: {out['dedup']['directed_recall']:.4f}")
    if "embed" in out:
        print_ratio("embed_full_over_model_throughput", out["embed"]["ratio"])
    if "hkmeans" in out:
        print(f"hkmeans_4level_wall_s: {out['hkmeans']['wall_s']:.1f}")
        print(f"hkmeans_4level_peak_rss_gib: {out['hkmeans']['peak_rss'] / 2**30:.2f}")
    if not a.workdir:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
