"""Hierarchical k-means over many processes (torch.distributed: gloo on CPU, NCCL on GPUs).

    torchrun --nproc-per-node 8 -m curation.cli kmeans --emb-dir OUT/embeddings --out OUT/kmeans \\
        --levels 4000 400 40 10 --sample-sizes 1 10 5 3
    srun --ntasks 24 curate kmeans --emb-dir ... --out ...   # Slurm: one step
    torchrun ... -m curation.cli kmeans --curate --config C.yaml output.dir=OUT [k=v ...]

The process group comes from the one launcher training uses (``curate kmeans`` calls
:func:`dinopipe.train.dist.init_distributed`: torchrun or an srun step, with its guard against a batch
script that believes SLURM_NTASKS); this module only uses the group it is given.

``--curate``: the k-means of ``curate rebalance`` (mode=hierarchical) -- the rows kept after dedup +
decontamination, the config's rebalance.* settings -- written to rebalance.kmeans_dir, where
``curate rebalance rebalance.kmeans_dir=...`` checks (:func:`load_tree`) and selects from it.

Level 1 (the points) is distributed: every rank memory-maps the fp16 embedding shards and owns a
contiguous range of the rows Lloyd iterates over, assigns them (torch matmul on its GPU when there
is one, faiss on CPU) and all-reduces per-cluster counts and the objective, and the float64 per-cluster
sums a chunk of centroids at a time (:data:`curation.kmeans.REDUCE_BYTES`, 256 MB: at 10M clusters x
1024-d the whole k x D float64 array would be 82 GB per rank); rank 0 seeds
(k-means++ on a sample it reads from the shared shards) and broadcasts the centroids. The levels
above cluster level 1's centroids (a few MB) on rank 0 with :func:`hierarchical_kmeans`. Level 1's
"closest" resampling steps gather each rank's s closest points per cluster to rank 0 only (the one
rank that uses them), so rank 0 k-means the same points one process would. ``--out`` must be on a filesystem every rank sees.

Same answer for any number of ranks, bit for bit (tested with 1 and 3 gloo processes): the row
ranges are cut at multiples of ``BLOCK`` rows, so every block (hence every BLAS call) is the one a
single process would make; the per-cluster sums are exact in float64 for fp16 embeddings (see
:func:`curation.kmeans.lloyd`), so the all-reduce order cannot change a centroid; the objective
(used only for the early stop) is summed in float64, where a different order moves it by ~1e-16
relative -- it could flip the stop only if the relative change landed that close to ``tol``.

Outputs in ``--out``: ``level1_labels.npy`` / ``level1_dist.npy`` (int64 / fp32, one per row of the
embeddings), ``centroids_level{l}.npy``, ``labels_level{l}.npy`` for l >= 2 (cluster of each
centroid of level l-1), ``sizes_level{l}.npy`` and ``kmeans.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from numpy.lib.format import open_memmap

from .embeddings import open_embeddings
from .index import Rows
from .kmeans import (BLOCK, INITS, KMeansResult, Level, Nearest, _sample_positions, hierarchical_kmeans,
                     kmeans, resample_positions, seed_centroids, work_positions)


def process_group() -> tuple[int, int, str]:
    """(rank, world size, device) of the process group the launcher made (``curate kmeans``: training's
    :func:`dinopipe.train.dist.init_distributed`, with its srun-step guard); one process without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, "cuda:0" if torch.cuda.is_available() else "cpu"
    cuda = dist.get_backend() == "nccl"
    return dist.get_rank(), dist.get_world_size(), f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"


class Comm:
    """The collectives k-means needs, on the process group's device (no-ops in one process)."""

    def __init__(self, device: str, world: int = 1):
        self.dev = device if device.startswith("cuda") else "cpu"
        self.world = world

    def allreduce(self, arr: np.ndarray) -> np.ndarray:
        """Sum of ``arr`` over ranks (lloyd hands it one chunk of centroid sums at a time)."""
        if self.world == 1:
            return arr
        t = torch.from_numpy(np.ascontiguousarray(arr)).to(self.dev)
        dist.all_reduce(t)
        return t.cpu().numpy()

    def broadcast(self, fn):
        """fn() evaluated on rank 0, its (k, D) fp32 array returned on every rank."""
        if self.world == 1:
            return fn()
        obj = [fn() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(obj, src=0, device=torch.device(self.dev))
        return obj[0]

    def bcast_from(self, arr: np.ndarray | None, shape: tuple, src: int) -> np.ndarray:
        """``arr`` of rank ``src`` (fp32, ``shape``) on every rank: one piece of centroids at a time."""
        if self.world == 1:
            return arr
        t = (torch.from_numpy(np.ascontiguousarray(arr, np.float32)) if dist.get_rank() == src
             else torch.empty(shape, dtype=torch.float32)).to(self.dev)
        dist.broadcast(t, src=src)
        return t.cpu().numpy()

    def reduce_to(self, arr: np.ndarray, dst: int) -> np.ndarray | None:
        """Sum of ``arr`` over ranks on rank ``dst`` only (None elsewhere): the sums of the centroids it owns."""
        if self.world == 1:
            return arr
        t = torch.from_numpy(np.ascontiguousarray(arr)).to(self.dev)
        dist.reduce(t, dst=dst)
        return t.cpu().numpy() if dist.get_rank() == dst else None

    def gather_to_root(self, obj):
        """Every rank's ``obj`` on rank 0 only (a list there, None elsewhere)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if dist.get_rank() == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out


def rank_range(n: int, rank: int, world: int, block: int = BLOCK) -> tuple[int, int]:
    """Rows [lo, hi) of ``n`` owned by ``rank``: whole blocks of ``block`` rows, split evenly."""
    nblocks = -(-n // block)
    lo, hi = nblocks * rank // world, nblocks * (rank + 1) // world
    return min(lo * block, n), min(hi * block, n)


PIECE_BYTES = 256 * 2**20
"""fp32 centroids per piece: the unit a rank owns, sends and reduces (--piece-mb)."""


class CentroidShards:
    """Level-1 centroids sharded over the ranks: fixed pieces of ``piece`` centroids (a function of k, D
    and ``piece_bytes`` only, not of the world size); rank r owns pieces [r*P/W, (r+1)*P/W) and their
    float64 sums. A rank holds its k/W centroids, one piece it receives, and one piece of float64 sums:
    at 10M x 1024 on 128 ranks ~0.3 GB + 2 x 256 MB instead of 41 GB of centroids on every rank."""

    def __init__(self, k: int, d: int, rank: int, world: int, piece_bytes: int = PIECE_BYTES):
        self.k, self.d, self.rank, self.world = k, d, rank, world
        self.piece = max(1, min(k, piece_bytes // (4 * d)))
        self.bounds = list(range(0, k, self.piece)) + [k]
        n_pieces = len(self.bounds) - 1
        self.owner = np.empty(n_pieces, np.int64)
        for r in range(world):
            self.owner[r * n_pieces // world:(r + 1) * n_pieces // world] = r
        self.mine: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.k

    @property
    def pieces(self) -> range:
        return range(len(self.owner))

    def span(self, p: int) -> tuple[int, int]:
        return self.bounds[p], self.bounds[p + 1]

    def held_bytes(self) -> int:
        """Centroid bytes this rank holds at most: its pieces + one received piece + one float64 sums piece."""
        own = sum(v.nbytes for v in self.mine.values())
        return own + self.piece * self.d * (4 + 8)

    def scatter(self, full_of_root, comm: "Comm") -> None:
        """Pieces of rank 0's (k, D) array (a callable evaluated there, or an array / memmap every rank
        can read) to their owners."""
        if not callable(full_of_root):  # e.g. --init-centroids: each owner reads its own slices
            for p in self.pieces:
                if self.owner[p] == self.rank:
                    a, b = self.span(p)
                    self.mine[p] = np.ascontiguousarray(full_of_root[a:b], np.float32).copy()
            return
        full = full_of_root() if self.rank == 0 else None
        for p in self.pieces:
            a, b = self.span(p)
            got = comm.bcast_from(None if full is None else full[a:b], (b - a, self.d), 0)
            if self.owner[p] == self.rank:
                self.mine[p] = np.array(got, np.float32)

    def gather(self, comm: "Comm") -> np.ndarray | None:
        """The (k, D) centroids on rank 0 (None elsewhere). Small levels only (tests, the levels above)."""
        out = np.empty((self.k, self.d), np.float32) if self.rank == 0 else None
        for p in self.pieces:
            a, b = self.span(p)
            got = comm.bcast_from(self.mine.get(p), (b - a, self.d), int(self.owner[p]))
            if out is not None:
                out[a:b] = got
        return out

    def write(self, path: str) -> None:
        """Each owner writes its pieces into the (k, D) .npy at ``path`` (made by rank 0; shared filesystem)."""
        m = open_memmap(path, "r+")
        for p, c in self.mine.items():
            a, b = self.span(p)
            m[a:b] = c
        m.flush()
        del m


def assign_pieces(blocks, shards: CentroidShards, comm: Comm, device: str):
    """Nearest centroid of every row ``blocks()`` yields: the pieces in order, each sent by its owner,
    a running minimum (ties: the lower piece, i.e. the lower centroid, as one index would). The same
    pieces and block shapes on any world size."""
    labels, dists = [], []
    for p in shards.pieces:
        a, b = shards.span(p)
        near = Nearest(comm.bcast_from(shards.mine.get(p), (b - a, shards.d), int(shards.owner[p])), device)
        for i, x in enumerate(blocks()):
            lab, d = near(x)
            if p == 0:
                labels.append(lab.astype(np.int64) + a)
                dists.append(d)
            else:
                upd = d < dists[i]
                labels[i][upd], dists[i][upd] = lab[upd] + a, d[upd]
    return labels, dists


def lloyd_sharded(blocks, shards: CentroidShards, comm: Comm, niter: int, tol: float = 1e-4,
                  device: str = "cpu") -> KMeansResult:
    """:func:`curation.kmeans.lloyd` with the centroids sharded (:class:`CentroidShards`): assignment by
    pieces, then per piece the float64 sums and counts of this rank's rows reduced to the piece's owner
    only, which updates its centroids. Exact float64 sums (fp16 rows), so the answer does not depend on
    the world size; with one piece it is :func:`lloyd`'s."""
    history: list[float] = []
    it = 0
    for it in range(1, niter + 1):
        labels, dists = assign_pieces(blocks, shards, comm, device)
        obj = float(comm.allreduce(np.array([sum(d.sum(dtype=np.float64) for d in dists)]))[0])
        for p in shards.pieces:
            a, b = shards.span(p)
            sums = torch.zeros((b - a, shards.d), dtype=torch.float64)
            cnt = np.zeros(b - a, np.int64)
            for lab, x in zip(labels, blocks()):
                sel = np.flatnonzero((lab >= a) & (lab < b))
                if len(sel):
                    sums.index_add_(0, torch.from_numpy(lab[sel] - a), torch.from_numpy(x[sel]).double())
                    cnt += np.bincount(lab[sel] - a, minlength=b - a)
            owner = int(shards.owner[p])
            s, c = comm.reduce_to(sums.numpy(), owner), comm.reduce_to(cnt, owner)
            if owner == shards.rank:
                full = c > 0
                shards.mine[p][full] = (s[full] / c[full, None]).astype(np.float32)
        history.append(obj)
        if len(history) > 1 and history[-2] - obj <= tol * abs(history[-2]):
            break
    return KMeansResult(None, history[-1] if history else float("nan"), it, history)


def level1_kmeans(rows: Rows, k: int, comm: Comm, rank: int, world: int, device: str,
                  niter: int = 50, seed: int = 0, max_points_per_centroid: int = 256,
                  init_centroids=None, block: int = BLOCK, init: str = "auto", init_sample: int = 4,
                  n_init: int = 1, tol: float = 1e-4, piece_bytes: int = PIECE_BYTES):
    """Distributed level-1 k-means, centroids sharded -> (KMeansResult without centroids, the shards,
    the positions Lloyd iterated over). Seeding: rank 0 seeds from a sample (as :func:`curation.kmeans.fit`)
    and sends each piece to its owner."""
    n = len(rows)
    k = int(min(k, n))
    work = work_positions(n, k, seed, max_points_per_centroid)
    lo, hi = rank_range(len(work), rank, world, block)
    mine = work[lo:hi]

    def blocks():
        return (rows.take(mine[s:s + block]) for s in range(0, len(mine), block))

    best, best_shards = None, None
    for r in range(max(1, n_init) if init_centroids is None else 1):
        shards = CentroidShards(k, rows.dim, rank, world, piece_bytes)
        if init_centroids is not None:
            shards.scatter(init_centroids[:k], comm)
        else:
            def seeds(r=r):
                rr = np.random.default_rng([seed, r])
                return seed_centroids(rows.take(work[_sample_positions(len(work), k * init_sample, rr)]), k,
                                      init, rr, device)
            shards.scatter(seeds, comm)
        res = lloyd_sharded(blocks, shards, comm, niter, tol, device)
        if best is None or res.objective < best.objective:
            best, best_shards = res, shards
    return best, best_shards, work


def assign_all(rows: Rows, shards: CentroidShards, comm: Comm, rank: int, world: int, device: str,
               labels_out, dist_out, block: int = BLOCK) -> np.ndarray:
    """Assign this rank's rows (aligned blocks) into the shared output memmaps, the centroids a piece at
    a time (:func:`assign_pieces`); local counts (int64 per cluster)."""
    lo, hi = rank_range(len(rows), rank, world, block)
    spans = [(s, min(s + block, hi)) for s in range(lo, hi, block)]
    labels, dists = assign_pieces(lambda: (rows.take(np.arange(s, e)) for s, e in spans), shards, comm, device)
    counts = np.zeros(len(shards), np.int64)
    for (s, e), lab, d in zip(spans, labels, dists):
        labels_out[s:e], dist_out[s:e] = lab, d
        counts += np.bincount(lab, minlength=len(shards))
    return counts


def resample_level1(rows: Rows, labels, dists, shards: CentroidShards, s: int, comm: Comm,
                    rank: int, world: int, seed: int, block: int = BLOCK, **kw) -> CentroidShards:
    """One "closest" resampling step of level 1 (as :func:`hierarchical_kmeans` does it):
    the s points closest to each centroid over all ranks -- each rank offers its own s closest
    per cluster, rank 0 keeps the global s (ties: lower row first, as one process orders them),
    k-means them from a fresh seeding and broadcasts the new centroids."""
    lo, hi = rank_range(len(rows), rank, world, block)
    k = len(shards)
    lab, d = np.asarray(labels[lo:hi]), np.asarray(dists[lo:hi])
    mine = resample_positions(lab, d, k, s, "closest", None)
    offers = comm.gather_to_root((mine + lo, lab[mine], d[mine]))  # only rank 0 uses them

    def reseed():
        pos, lb, dd = (np.concatenate(a) for a in zip(*offers))
        order = np.lexsort((pos, dd, lb))
        starts = np.searchsorted(lb[order], np.arange(k))
        keep = order[np.arange(len(order)) - starts[lb[order]] < s]
        return kmeans(rows.take(np.sort(pos[keep])), k, seed=seed, **kw)

    new = CentroidShards(k, shards.d, rank, world, shards.piece * 4 * shards.d)
    new.scatter(reseed, comm)  # rank 0 k-means the k x s points; each rank keeps its pieces
    return new


def rows_digest(ids) -> str:
    """Fingerprint of the rows clustered, in order: sha256 of their image ids."""
    h = hashlib.sha256()
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
                    kmeans=None, **_) -> dict:
    """:func:`settings` of the tree ``curate rebalance`` (mode=hierarchical) builds in-process
    for these rows (curation.rebalance.hierarchical_balanced with the config's rebalance.*)."""
    from .rebalance import capped_levels

    ks = capped_levels(levels, n)
    return settings(n, ids, ks, [int(sample_size)] * len(ks), n_resampling_steps, "closest", seed,
                    **(kmeans or {}))


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
        raise ValueError(f"{key}={out} was clustered for other rows or settings ({what}): rerun "
                         f"curate kmeans --curate with this config, or unset {key} "
                         f"to cluster in this process")
    lab = np.load(os.path.join(out, "level1_labels.npy"))
    levels = [Level(np.load(os.path.join(out, "centroids_level1.npy")), lab,
                    np.load(os.path.join(out, "level1_dist.npy")),
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
        block: int = BLOCK, rows_idx: np.ndarray | None = None, piece_bytes: int = PIECE_BYTES, **kw) -> dict:
    """``rows_idx``: cluster only these rows of the embeddings (positions, in this order).
    ``piece_bytes``: fp32 centroids per piece of the sharded level 1 (:class:`CentroidShards`)."""
    rank, world, device = process_group()
    comm = Comm(device, world)
    if sample_sizes[0] > 1 and sampling != "closest":
        raise SystemExit("dist_kmeans: random resampling at level 1 is not distributed; use "
                         "--sampling closest, or a first --sample-sizes value of 1")
    emb = open_embeddings(emb_dir)
    rows = Rows(emb, rows_idx)
    n = len(rows)
    t0 = time.perf_counter()
    init = None if init_centroids is None else np.load(init_centroids, mmap_mode="r")
    km = {key: v for key, v in kw.items() if key in ("niter", "tol", "init", "init_sample", "n_init",
                                                     "max_points_per_centroid")}
    res, shards, _ = level1_kmeans(rows, levels[0], comm, rank, world, device, seed=seed,
                                   init_centroids=init, block=block, piece_bytes=piece_bytes, **km)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        open_memmap(os.path.join(out, "level1_labels.npy"), "w+", np.int64, (n,)).flush()
        open_memmap(os.path.join(out, "level1_dist.npy"), "w+", np.float32, (n,)).flush()
    _barrier()
    labels = open_memmap(os.path.join(out, "level1_labels.npy"), "r+")
    dists = open_memmap(os.path.join(out, "level1_dist.npy"), "r+")
    counts = assign_all(rows, shards, comm, rank, world, device, labels, dists, block)
    held = shards.held_bytes()
    for step in range(steps if sample_sizes[0] > 1 else 0):
        shards = resample_level1(rows, labels, dists, shards, sample_sizes[0], comm, rank, world,
                                 seed=seed + 1000 + step, block=block, **kw)
        counts = assign_all(rows, shards, comm, rank, world, device, labels, dists, block)
        held = max(held, shards.held_bytes())
    labels.flush(), dists.flush()
    counts = comm.allreduce(counts)
    cent_path = os.path.join(out, "centroids_level1.npy")
    if rank == 0:  # level 1's centroids: each owner writes its pieces (no rank gathers them in memory)
        open_memmap(cent_path, "w+", np.float32, (len(shards), shards.d)).flush()
    _barrier()
    shards.write(cent_path)
    _barrier()
    held = _max_over_ranks(held, comm)
    summary = {"world_size": world, "device": device, "n": n, "levels": levels,
               "level1": {"objective": res.objective, "iterations": res.n_iter,
                          "centroid_piece": shards.piece, "pieces": len(shards.owner),
                          "centroid_bytes_per_rank": held,
                          "peak_rss_bytes": _all_ranks(_peak_rss(), comm)}}
    if rank == 0:
        cent = np.load(cent_path, mmap_mode="r")  # read a piece at a time by the levels above
        first = Level(cent, np.asarray(labels), np.asarray(dists), counts)
        tree = hierarchical_kmeans(None, levels, n_resampling_steps=steps, sample_size=sample_sizes,
                                   sampling=sampling, seed=seed, first_level=first, **kw)
        for li, lvl in enumerate(tree, start=1):
            if li > 1:  # level 1's were written by their owners above
                np.save(os.path.join(out, f"centroids_level{li}.npy"), lvl.centroids)
            np.save(os.path.join(out, f"sizes_level{li}.npy"), lvl.sizes)
            if li > 1:
                np.save(os.path.join(out, f"labels_level{li}.npy"), lvl.labels)
        summary["wall_s"] = time.perf_counter() - t0
        ids = emb.ids if rows_idx is None else emb.ids[rows_idx]
        summary["emb_dir"] = os.path.abspath(emb_dir)
        summary["settings"] = settings(n, ids, levels, sample_sizes, steps, sampling, seed,
                                       block=block, init_centroids=init_centroids, **{k: v for k, v in kw.items() if k in (
                                           "niter", "tol", "init", "init_sample", "n_init",
                                           "max_points_per_centroid")})
        with open(os.path.join(out, "kmeans.json"), "w") as f:
            json.dump(summary, f, indent=1)
    _barrier()
    return summary


def _max_over_ranks(x: int, comm: Comm) -> int:
    if comm.world == 1:
        return int(x)
    t = torch.tensor([x], dtype=torch.int64).to(comm.dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _all_ranks(x: int, comm: Comm) -> list[int]:
    if comm.world == 1:
        return [int(x)]
    out = [torch.zeros(1, dtype=torch.int64).to(comm.dev) for _ in range(comm.world)]
    dist.all_gather(out, torch.tensor([x], dtype=torch.int64).to(comm.dev))
    return [int(t.item()) for t in out]


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def curate_main(argv: list[str]) -> int:
    """``--curate [--config FILE] [key=value ...]``: the k-means ``curate rebalance`` needs, with
    the rows and settings it would use -- the pool rows kept after dedup + decontamination, the
    config's rebalance.* -- written to rebalance.kmeans_dir (default ``kmeans``, under output.dir)."""
    from dinopipe.config import ConfigError, exit_on_config_error, load_config

    from .config import CurationConfig, kmeans_dir, rebalance_kwargs, validate
    from .stepfiles import rebalance_rows
    from .rebalance import capped_levels

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
                   help="MB of fp32 level-1 centroids per piece: the unit each rank owns, receives and reduces "
                        "(keep it fixed to compare runs at different world sizes)")
    p.add_argument("--block", type=int, default=BLOCK,
                   help="rows per assignment block; ranks own whole blocks (keep it fixed to "
                        "compare runs at different world sizes)")
    a = p.parse_args(argv)
    ss = a.sample_sizes or ([1] + [10, 5, 3] + [3] * len(a.levels))[: len(a.levels)]
    if len(ss) != len(a.levels):
        p.error(f"--sample-sizes has {len(ss)} values for {len(a.levels)} --levels")
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
