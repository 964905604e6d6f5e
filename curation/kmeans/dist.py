"""Hierarchical k-means over many processes (torch.distributed: gloo on CPU, NCCL on GPUs): every level
sharded, rows and centroids.

    torchrun --nproc-per-node 8 -m curation.cli kmeans --emb-dir OUT/embeddings --out OUT/kmeans \\
        --levels 4000 400 40 10 --sample-sizes 1 10 5 3
    srun --ntasks 24 curate kmeans --emb-dir ... --out ...   # Slurm: one step
    torchrun ... -m curation.cli kmeans --curate --config C.yaml output.dir=OUT [k=v ...]

The process group comes from the one launcher training uses (``curate kmeans`` calls
:func:`dinopipe.train.dist.init_distributed`: torchrun or an srun step, with its guard against a batch
script that believes SLURM_NTASKS); ``curate run`` with ``tasks.count`` W > 1 starts W local processes
through the step runner (curation/kmeans/tree.py). This module only uses the group it is given.

``--curate``: the k-means of ``curate rebalance`` (mode=hierarchical) -- the rows kept after dedup +
decontamination, the config's rebalance.* settings -- written to rebalance.kmeans_dir, where
``curate rebalance rebalance.kmeans_dir=...`` checks (:func:`load_tree`) and selects from it.

Every level is the same sharded k-means (:func:`level_kmeans`; pieces and collectives in
curation/kmeans/shards.py). Level 1's rows are the embeddings, level l's are level l-1's centroids, which
their owners wrote into ``centroids_level{l-1}.npy``: each rank reads its own blocks of rows (memory-mapped,
as level 1 reads the embeddings) and owns k/W of the level's centroids in fixed pieces. Seeding: random rows
(``init=auto`` above 20k clusters) are drawn from one seeded generator on every rank, and each piece's
owner reads its own seed rows (nothing is sent); k-means++ (at most 20k clusters x ``init_sample`` rows, a
bounded sample) runs on rank 0 and its pieces go to their owners. Resampling ("closest": the s rows of
each cluster nearest its centroid; "random": the s with the smallest per-row hash key): each rank offers its
own s best per cluster to the cluster's owner only (:meth:`Comm.exchange`), the owner keeps the global s
and answers which were kept; the kept rows (a part file per rank, read as one array) are k-means'd by the
same sharded k-means. Sizes are reduced a piece at a time to the owners, who write them.

Same answer for any number of ranks, bit for bit (tested with 1, 2 and 3 gloo processes): the row
ranges are cut at multiples of ``block`` rows, so every block (hence every BLAS call) is the one a
single process would make, and each row's nearest centroid and distance come from its RERANK candidates'
distances recomputed in float64 (:class:`curation.kmeans.hierarchical.Nearest`), the same on any thread count -- faiss's
BLAS distances are not, and W one-thread tasks picked other "closest" rows than one two-thread process until
then (at 3M rows: other decisions); the per-cluster sums are exact (float64 for the fp16 embeddings, int64
fixed point for the fp32 centroids of the levels above), so the reduction order cannot change a centroid;
the objective (used only for the early stop) is summed in float64, where a different order moves it by
~1e-16 relative -- it could flip the stop only if the relative change landed that close to ``tol``.

Outputs in ``--out``: ``level1_labels.npy`` / ``level1_dist.npy`` (int64 / fp32, one per row of the
embeddings), ``centroids_level{l}.npy``, ``labels_level{l}.npy`` / ``dist_level{l}.npy`` for l >= 2
(cluster of each centroid of level l-1), ``sizes_level{l}.npy`` and ``kmeans.json``.
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
from numpy.lib.format import open_memmap

from dinopipe.config import InputError
from curation.core.embstore import open_embeddings
from curation.core.rows import Gathered
from curation.knn.index import Rows
from curation.kmeans.hierarchical import (BLOCK, KMEANSPP_MAX_K, KMeansResult, Level, sample_positions,
                                          resample_positions, seed_centroids, work_positions)
from curation.config import INITS
from curation.kmeans.shards import (PIECE_BYTES, CentroidShards, Comm, PartsArray, Span, SubRows, assign_pieces,
                                    fixed_point_scale, lloyd_sharded, piece_counts, process_group, rank_range)
from curation.core.rows import row_keys

KMEANS_KEYS = ("niter", "tol", "init", "init_sample", "n_init", "max_points_per_centroid")


def work_rows(n: int, k: int, seed: int, max_points_per_centroid: int):
    """The rows Lloyd iterates over (:func:`curation.kmeans.hierarchical.work_positions`), as a :class:`Span` when it
    is all of them."""
    return Span(n) if k * max_points_per_centroid >= n else work_positions(n, k, seed, max_points_per_centroid)


def seed_shards(shards: CentroidShards, rows, work, init: str, init_sample: int, rng: np.random.Generator,
                comm: Comm, device: str) -> None:
    """The initial centroids of :func:`curation.kmeans.hierarchical.fit` (same draws, same rows), sharded: random rows
    are read by the owner of each piece; k-means++ (k <= KMEANSPP_MAX_K, or asked for) runs on rank 0 on
    its sample of k x init_sample rows and sends each piece to its owner."""
    if init not in INITS:
        raise ValueError(f"kmeans init={init!r}: choose one of {INITS}")
    k = len(shards)
    sample = sample_positions(len(work), k * init_sample, rng)
    if init == "random" or (init == "auto" and k > KMEANSPP_MAX_K):
        pos = sample_positions(len(sample), min(k, len(sample)), rng)  # as seed_centroids
        shards.fill(lambda a, b: rows.take(work[sample[pos[a:b]]]))
    else:
        shards.scatter(lambda: seed_centroids(rows.take(work[sample]), k, init, rng, device), comm)


def level_kmeans(rows, k: int, comm: Comm, device: str, seed: int = 0, niter: int = 50, tol: float = 1e-4,
                 init: str = "auto", init_sample: int = 4, n_init: int = 1, max_points_per_centroid: int = 256,
                 init_centroids=None, block: int = BLOCK, piece_bytes: int = PIECE_BYTES,
                 scale: float | None = None) -> tuple[KMeansResult, CentroidShards]:
    """One k-means of ``rows`` (Rows / SubRows every rank can read), rows and centroids sharded ->
    (KMeansResult without centroids, the shards). :func:`curation.kmeans.hierarchical.kmeans_fit` of the same rows:
    the same work rows, seeds and (one piece, fp16 rows) Lloyd."""
    n = len(rows)
    k = int(min(k, n))
    work = work_rows(n, k, seed, max_points_per_centroid)
    lo, hi = rank_range(len(work), comm.rank, comm.world, block)

    def blocks():
        return (rows.take(work[s:min(s + block, hi)]) for s in range(lo, hi, block))

    best = None
    for r in range(max(1, n_init) if init_centroids is None else 1):
        shards = CentroidShards(k, rows.dim, comm.rank, comm.world, piece_bytes)
        if init_centroids is not None:
            shards.fill(lambda a, b: init_centroids[a:b])
        else:
            seed_shards(shards, rows, work, init, init_sample, np.random.default_rng([seed, r]), comm, device)
        res = lloyd_sharded(blocks, shards, comm, niter, tol, device, scale)
        if best is None or res.objective < best[0].objective:
            best = (res, shards)
    return best


def assign_level(rows, shards: CentroidShards, comm: Comm, device: str, labels_out, dist_out,
                 block: int = BLOCK) -> None:
    """Assign this rank's rows (aligned blocks) into the shared output memmaps, the centroids a piece at
    a time (:func:`assign_pieces`)."""
    lo, hi = rank_range(len(rows), comm.rank, comm.world, block)
    spans = [(s, min(s + block, hi)) for s in range(lo, hi, block)]
    labels, dists = assign_pieces(lambda: (rows.take(np.arange(s, e)) for s, e in spans), shards, comm, device)
    for (s, e), lab, d in zip(spans, labels, dists):
        labels_out[s:e], dist_out[s:e] = lab, d


def resample_select(labels, dists, shards: CentroidShards, s: int, comm: Comm, block: int, sampling: str,
                    key_seed: int, folder: str, tag: str) -> PartsArray:
    """One resampling step's rows: the s rows of each cluster closest to its centroid ("closest"; ties: the
    lower row, as :func:`curation.kmeans.hierarchical.resample_positions` orders them) or with the smallest per-row hash
    key ("random"), over all ranks. Each rank offers its own s best per cluster to the cluster's owner only;
    the owner keeps the global s and answers each rank which of its offers were kept. Returns the kept
    rows, sorted (a part file per rank, read as one array)."""
    lo, hi = rank_range(len(labels), comm.rank, comm.world, block)
    lab = np.asarray(labels[lo:hi], np.int64)
    key = (np.asarray(dists[lo:hi], np.float64) if sampling == "closest"
           else (row_keys(np.arange(lo, hi), key_seed) >> np.uint64(11)).astype(np.float64))
    mine = resample_positions(lab, key, len(shards), s, "closest", None)  # this rank's s best per cluster
    dest = shards.owner_of(lab[mine])
    order = np.argsort(dest, kind="stable")
    offers = np.stack([lab[mine], mine + lo, key[mine]], 1).astype(np.float64)[order]  # exact: < 2^53
    got, per_src = comm.exchange(offers, np.bincount(dest, minlength=comm.world))
    keep = np.zeros(len(got), np.int64)
    if len(got):  # the owner: the s best of each of its clusters over every rank's offers
        glab = got[:, 0].astype(np.int64)
        o = np.lexsort((got[:, 1], got[:, 2], glab))
        sl = glab[o]
        keep[o[np.arange(len(o)) - np.searchsorted(sl, sl) < s]] = 1
    back, _ = comm.exchange(keep, per_src)
    path = os.path.join(folder, f"{tag}-{comm.rank:05d}.npy")
    np.save(path, np.sort(offers[back.astype(bool), 1].astype(np.int64)))
    comm.barrier()
    return PartsArray([os.path.join(folder, f"{tag}-{r:05d}.npy") for r in range(comm.world)])


def max_abs(rows, comm: Comm, block: int) -> float:
    """Largest |value| of all rows (each rank reads its own blocks)."""
    lo, hi = rank_range(len(rows), comm.rank, comm.world, block)
    m = max((float(np.abs(rows.take(np.arange(s, min(s + block, hi)))).max()) for s in range(lo, hi, block)),
            default=0.0)
    return float(comm.allreduce(np.array([m]), "max")[0])


def _shared(path: str, dtype, shape: tuple, comm: Comm):
    """A .npy every rank writes its part of: made by rank 0, opened r+ by all (shared filesystem)."""
    if comm.rank == 0:
        open_memmap(path, "w+", dtype, shape).flush()
    comm.barrier()
    return open_memmap(path, "r+")


DIGEST_CHUNK = 1 << 18  # ids hashed at a time (2 MB of int64 and its copy: a constant, whatever N)


def rows_digest(ids) -> str:
    """Fingerprint of the rows clustered, in order: sha256 of their int64 input ids (little-endian bytes,
    hashed DIGEST_CHUNK ids at a time: ~1 s per 10^8 rows here, no per-id Python); ids that are not integers
    (strings) are hashed one per line."""
    h = hashlib.sha256()
    arr = np.asarray(ids) if not isinstance(ids, (np.ndarray, Gathered)) else ids
    if arr.dtype.kind in "iu":
        h.update(b"int64le\n")
        from curation.core.runner import BLOCK  # chunks of the step block (the debug hook's in tests: they see per-row costs)

        chunk = min(DIGEST_CHUNK, BLOCK)
        for s in range(0, len(arr), chunk):
            h.update(np.ascontiguousarray(arr[s:s + chunk], dtype="<i8").tobytes())
        return h.hexdigest()
    for i in ids:
        h.update(str(i).encode() + b"\n")
    return h.hexdigest()


def settings(n: int, ids, levels, sample_sizes, steps, sampling, seed, niter=50, tol=1e-4,
             init="auto", init_sample=4, n_init=1, max_points_per_centroid=256,
             block=BLOCK, init_centroids=None) -> dict:
    """Everything the k-means tree depends on; recorded in kmeans.json and checked by
    :func:`load_tree` (one process makes the same tree from the same dict)."""
    return {"n": int(n), "rows_sha256": rows_digest(ids), "levels": [int(k) for k in levels],
            "sample_sizes": [int(s) for s in sample_sizes], "steps": int(steps),
            "sampling": sampling, "seed": int(seed), "niter": int(niter), "tol": float(tol),
            "init": init, "init_sample": int(init_sample), "n_init": int(n_init),
            "max_points_per_centroid": int(max_points_per_centroid), "block": int(block),
            "init_centroids": init_centroids}


def curate_settings(n: int, ids, levels, n_resampling_steps=10, sample_size=10, seed=0,
                    kmeans=None, block: int = BLOCK, **_) -> dict:
    """:func:`settings` of the tree ``curate rebalance`` (mode=hierarchical) builds in-process
    for these rows (curation.rebalance.modes.hierarchical_balanced with the config's rebalance.*)."""
    from curation.kmeans.hierarchical import capped_levels

    ks = capped_levels(levels, n)
    return settings(n, ids, ks, [int(sample_size)] * len(ks), n_resampling_steps, "closest", seed,
                    block=block, **(kmeans or {}))


def load_tree(out: str, expected: dict, key: str = "kmeans_dir") -> list[Level]:
    """The levels written by :func:`run` in ``out``, after checking kmeans.json records
    ``expected`` (rows and settings); a mismatch is an error naming ``key`` and the fields."""
    path = os.path.join(out, "kmeans.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{key}={out}: no kmeans.json there; run "
                                f"curate kmeans --curate <the curate arguments> first (torchrun / srun)")
    with open(path) as f:
        got = json.load(f).get("settings", {})
    diff = {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
    if diff:
        what = "; ".join(f"{k}: k-means has {a!r}, this run needs {b!r}" for k, (a, b) in diff.items())
        raise InputError(f"{key}={out} was clustered for other rows or settings ({what}): rerun "
                         f"curate kmeans --curate with this config, or unset {key} "
                         f"to cluster in this process")
    # the per-row arrays memory-mapped (read-only): the orchestrator reads them, it need not hold them
    lab = np.load(os.path.join(out, "level1_labels.npy"), mmap_mode="r")
    levels = [Level(np.load(os.path.join(out, "centroids_level1.npy")), lab,
                    np.load(os.path.join(out, "level1_dist.npy"), mmap_mode="r"),
                    np.load(os.path.join(out, "sizes_level1.npy")))]
    for li in range(2, len(expected["levels"]) + 1):
        lab = np.load(os.path.join(out, f"labels_level{li}.npy"))
        # balanced_sample reads the distances of level 1 only
        levels.append(Level(np.load(os.path.join(out, f"centroids_level{li}.npy")), lab,
                            np.zeros(len(lab), np.float32),
                            np.load(os.path.join(out, f"sizes_level{li}.npy"))))
    return levels


def run(emb_dir: str, out: str, levels: list[int], sample_sizes: list[int], steps: int = 10,
        sampling: str = "closest", seed: int = 0, init_centroids: str | None = None,
        block: int = BLOCK, rows_idx: np.ndarray | None = None, piece_bytes: int = PIECE_BYTES,
        group: tuple | None = None, record: dict | None = None, comm_device: str | None = None, **kw) -> dict:
    """The k-means tree of the embeddings in ``emb_dir`` (``rows_idx``: only these rows, in this order) into
    ``out``. ``piece_bytes``: fp32 centroids per piece (:class:`CentroidShards`). ``group``: (rank, world,
    device) instead of the process group's; ``comm_device``: where the collectives run, if not on that
    device (a gloo group of local processes that compute on a GPU). ``record``: the settings to write into
    kmeans.json (default: :func:`settings` of these arguments)."""
    rank, world, device = group or process_group()
    comm = Comm(comm_device or device, world)
    if sampling not in ("closest", "random"):
        raise ValueError(f"sampling={sampling!r}: choose 'closest' or 'random'")
    emb = open_embeddings(emb_dir)
    rows = Rows(emb, rows_idx)
    n = len(rows)
    t0 = time.perf_counter()
    km = {key: v for key, v in kw.items() if key in KMEANS_KEYS}
    tmp = os.path.join(out, ".resample")
    if rank == 0:
        os.makedirs(tmp, exist_ok=True)
    comm.barrier()
    weights, stats = None, []
    for li, k in enumerate(levels):
        name, n_l = li + 1, len(rows)
        k = int(min(k, n_l))
        # level 1: fp16 rows, exact float64 sums; above: fp32 centroids, int64 fixed point
        opts = dict(km, block=block, piece_bytes=piece_bytes,
                    scale=None if li == 0 else fixed_point_scale(n_l, max_abs(rows, comm, block)))
        init = None if li or init_centroids is None else np.load(init_centroids, mmap_mode="r")
        res, shards = level_kmeans(rows, k, comm, device, seed=seed + li, init_centroids=init, **opts)
        stem = ("level1_labels", "level1_dist") if li == 0 else (f"labels_level{name}", f"dist_level{name}")
        labels = _shared(os.path.join(out, stem[0] + ".npy"), np.int64, (n_l,), comm)
        dists = _shared(os.path.join(out, stem[1] + ".npy"), np.float32, (n_l,), comm)
        assign_level(rows, shards, comm, device, labels, dists, block)
        held = shards.held_bytes()
        s = sample_sizes[li]
        for step in range(steps if s > 1 else 0):
            rseed = seed + 1000 * (li + 1) + step  # hierarchical_kmeans's seed of this step
            sub = resample_select(labels, dists, shards, s, comm, block, sampling, rseed, tmp, f"l{name}s{step}")
            res, shards = level_kmeans(SubRows(rows, sub), k, comm, device, seed=rseed, **opts)
            assign_level(rows, shards, comm, device, labels, dists, block)
            held = max(held, shards.held_bytes())
        lo, hi = rank_range(n_l, rank, world, block)
        sizes = _shared(os.path.join(out, f"sizes_level{name}.npy"), np.int64, (len(shards),), comm)
        piece_counts(labels[lo:hi], None if weights is None else weights[lo:hi], shards, comm, sizes, block)
        cent_path = os.path.join(out, f"centroids_level{name}.npy")
        _shared(cent_path, np.float32, (len(shards), shards.d), comm)
        shards.write(cent_path)  # each owner its pieces: no rank gathers the level's centroids
        labels.flush(), dists.flush(), sizes.flush()
        del labels, dists, sizes
        comm.barrier()
        stats.append({"k": len(shards), "rows": n_l, "objective": res.objective, "iterations": res.n_iter,
                      "centroid_piece": shards.piece, "pieces": len(shards.owner),
                      "centroid_bytes_per_rank": int(comm.allreduce(np.array([held], np.int64), "max")[0])})
        rows = Rows(np.load(cent_path, mmap_mode="r"))  # the next level's rows, read a block at a time
        weights = np.load(os.path.join(out, f"sizes_level{name}.npy"), mmap_mode="r")
    peak = comm.allgather(_peak_rss()).tolist()
    summary = {"world_size": world, "device": device, "n": n, "levels": [int(k) for k in levels],
               "level1": dict(stats[0], peak_rss_bytes=peak), "per_level": stats,
               "centroid_bytes_per_rank": max(s["centroid_bytes_per_rank"] for s in stats)}
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        summary["wall_s"] = time.perf_counter() - t0
        summary["emb_dir"] = os.path.abspath(emb_dir)
        if record is None:
            ids = emb.ids if rows_idx is None else emb.ids[rows_idx]
            record = settings(n, ids, levels, sample_sizes, steps, sampling, seed, block=block,
                              init_centroids=init_centroids, **km)
        summary["settings"] = record
        with open(os.path.join(out, "kmeans.json"), "w") as f:
            json.dump(summary, f, indent=1)
    comm.barrier()
    return summary


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def curate_main(argv: list[str]) -> int:
    """``--curate [--config FILE] [key=value ...]``: the k-means ``curate rebalance`` needs, with
    the rows and settings it would use -- the pool rows kept after dedup + decontamination, the
    config's rebalance.* -- written to rebalance.kmeans_dir (default ``kmeans``, under output.dir)."""
    from dinopipe.config import ConfigError, exit_on_config_error, load_config

    from curation.config import CurationConfig, kmeans_dir, rebalance_kwargs, validate
    from curation.core.stepfiles import rebalance_rows
    from curation.kmeans.hierarchical import capped_levels

    p = argparse.ArgumentParser(prog="curate kmeans --curate")
    p.add_argument("--config", default=None)
    p.add_argument("overrides", nargs="*")
    a = p.parse_intermixed_args(argv)
    try:
        cfg = load_config(CurationConfig, a.config, a.overrides)
        validate(cfg, "rebalance")
        if cfg.rebalance.mode != "hierarchical":
            raise ConfigError(f"rebalance.mode: the distributed k-means serves mode=hierarchical, "
                              f"got '{cfg.rebalance.mode}'")
    except ConfigError as exc:
        exit_on_config_error(exc)
    space_dir, rows_idx, _, _ = rebalance_rows(cfg.output.dir)
    kw = rebalance_kwargs(cfg.rebalance)
    ks = capped_levels(kw["levels"], len(rows_idx))
    summary = run(space_dir, kmeans_dir(cfg, default="kmeans"), ks, [kw["sample_size"]] * len(ks),
                  steps=kw["n_resampling_steps"], sampling="closest", seed=kw["seed"],
                  rows_idx=rows_idx, **kw["kmeans"])
    if process_group()[0] == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "settings"}))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--curate"]:
        return curate_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--emb-dir", required=True, help="curation embeddings folder (fp16 shards)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--levels", type=int, nargs="+", default=[4000, 400, 40, 10])
    p.add_argument("--sample-sizes", type=int, nargs="+", default=None,
                   help="points per cluster in resampling steps, per level (default 1 10 5 3...)")
    p.add_argument("--steps", type=int, default=10, help="resampling steps per level")
    p.add_argument("--sampling", choices=("closest", "random"), default="closest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--niter", type=int, default=50)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--init", choices=INITS, default="auto")
    p.add_argument("--init-sample", type=int, default=4)
    p.add_argument("--n-init", type=int, default=1)
    p.add_argument("--max-points-per-centroid", type=int, default=256)
    p.add_argument("--init-centroids", default=None, help=".npy (k, D) level-1 initialisation")
    p.add_argument("--piece-mb", type=float, default=PIECE_BYTES / 2**20,
                   help="MB of fp32 centroids per piece (every level): the unit each rank owns, receives and reduces "
                        "(keep it fixed to compare runs at different world sizes)")
    p.add_argument("--block", type=int, default=BLOCK,
                   help="rows per assignment block; ranks own whole blocks (keep it fixed to "
                        "compare runs at different world sizes)")
    a = p.parse_args(argv)
    ss = a.sample_sizes or ([1] + [10, 5, 3] + [3] * len(a.levels))[: len(a.levels)]
    if len(ss) != len(a.levels):
        p.error(f"--sample-sizes has {len(ss)} values for {len(a.levels)} --levels")
    try:  # the user's folder, checked on every rank before any collective: exit 2, one message (rank 0)
        open_embeddings(a.emb_dir)
    except FileNotFoundError as exc:
        if process_group()[0] == 0:
            print(f"curate kmeans: error: --emb-dir: {exc}", file=sys.stderr)
        return 2
    summary = run(a.emb_dir, a.out, a.levels, ss, steps=a.steps, sampling=a.sampling, seed=a.seed,
                  init_centroids=a.init_centroids, niter=a.niter, tol=a.tol, init=a.init,
                  init_sample=a.init_sample, n_init=a.n_init, block=a.block,
                  piece_bytes=max(1, int(a.piece_mb * 2**20)),
                  max_points_per_centroid=a.max_points_per_centroid)
    if process_group()[0] == 0:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit("run the distributed k-means through the launcher: curate kmeans [--curate] ... "
             "(torchrun / srun start `curate kmeans`, which sets up the process group as training does)")
