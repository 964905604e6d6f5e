"""Sharded k-means centroids and the collectives they need (torch.distributed: gloo on CPU, NCCL on GPUs).

One level of the distributed hierarchical k-means (curation/kmeans/dist.py) keeps its k centroids in fixed
pieces of ``piece_bytes`` of fp32 (:class:`CentroidShards`; a function of k and D only, not of the world
size): rank r owns pieces [r P / W, (r+1) P / W). The assignment walks the pieces in order, each broadcast
by its owner, keeping a running minimum (:func:`assign_pieces`); the sums and counts of a piece are reduced
to its owner only, which updates its centroids (:func:`lloyd_sharded`). No rank ever holds all k x D.

Same answer for any world size, bit for bit: every rank reads its rows in the blocks one process would
read (:func:`rank_range`), and the per-cluster sums are exact, so the reduction order cannot change them:
fp16 rows (level 1) in float64 (every partial sum of up to 2^29 of them is exact), fp32 rows (the levels
above: level l clusters level l-1's centroids) in int64 fixed point (``scale``, :func:`fixed_point_scale`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
from numpy.lib.format import open_memmap

from curation.kmeans.hierarchical import BLOCK, EXACT_ROWS, KMeansResult, Nearest


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
        self.rank = dist.get_rank() if world > 1 else 0

    def _t(self, arr) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(arr)).to(self.dev)

    def allreduce(self, arr: np.ndarray, op: str = "sum") -> np.ndarray:
        """Sum (or max) of ``arr`` over ranks."""
        if self.world == 1:
            return arr
        t = self._t(arr)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.cpu().numpy()

    def total(self, x: float) -> float:
        """Sum of one float64 per rank, the same bits on every rank (``math.fsum`` of the gathered values, in
        rank order): a summing all-reduce may round differently on different ranks, and the early stop would
        then end Lloyd on some ranks only."""
        if self.world == 1:
            return float(x)
        out = [torch.zeros(1, dtype=torch.float64, device=self.dev) for _ in range(self.world)]
        dist.all_gather(out, torch.tensor([x], dtype=torch.float64, device=self.dev))
        return math.fsum(float(t.item()) for t in out)

    def allgather(self, x: int) -> np.ndarray:
        """One int64 of every rank, in rank order."""
        if self.world == 1:
            return np.array([x], np.int64)
        out = [torch.zeros(1, dtype=torch.int64, device=self.dev) for _ in range(self.world)]
        dist.all_gather(out, torch.tensor([x], dtype=torch.int64, device=self.dev))
        return np.array([int(t.item()) for t in out], np.int64)

    def bcast_from(self, arr: np.ndarray | None, shape: tuple, src: int) -> np.ndarray:
        """``arr`` of rank ``src`` (fp32, ``shape``) on every rank: one piece of centroids at a time."""
        if self.world == 1:
            return arr
        t = (torch.from_numpy(np.ascontiguousarray(arr, np.float32)) if self.rank == src
             else torch.empty(shape, dtype=torch.float32)).to(self.dev)
        dist.broadcast(t, src=src)
        return t.cpu().numpy()

    def reduce_to(self, arr: np.ndarray, dst: int) -> np.ndarray | None:
        """Sum of ``arr`` over ranks on rank ``dst`` only (None elsewhere): the sums of the centroids it owns."""
        if self.world == 1:
            return arr
        t = self._t(arr)
        dist.reduce(t, dst=dst)
        return t.cpu().numpy() if self.rank == dst else None

    def exchange(self, arr: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """All-to-all: ``arr`` is ordered by destination rank, ``counts[r]`` of its entries for rank r;
        returns what every rank sent here (in source rank order) and how many came from each. Each entry
        goes to the one rank that uses it."""
        counts = np.asarray(counts, np.int64)
        if self.world == 1:
            return arr, counts
        got = torch.empty(self.world, dtype=torch.int64, device=self.dev)
        dist.all_to_all_single(got, self._t(counts))
        got = got.cpu().numpy()
        out = torch.empty((int(got.sum()), *arr.shape[1:]), dtype=torch.from_numpy(arr[:0]).dtype,
                          device=self.dev)
        dist.all_to_all_single(out, self._t(arr), got.tolist(), counts.tolist())
        return out.cpu().numpy(), got

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def rank_range(n: int, rank: int, world: int, block: int = BLOCK) -> tuple[int, int]:
    """Rows [lo, hi) of ``n`` owned by ``rank``: whole blocks of ``block`` rows, split evenly."""
    nblocks = -(-n // block)
    lo, hi = nblocks * rank // world, nblocks * (rank + 1) // world
    return min(lo * block, n), min(hi * block, n)


PIECE_BYTES = 256 * 2**20
"""fp32 centroids per piece: the unit a rank owns, sends and reduces (--piece-mb)."""


class CentroidShards:
    """k centroids sharded over the ranks: fixed pieces of ``piece`` centroids (a function of k, D
    and ``piece_bytes`` only, not of the world size); rank r owns pieces [r*P/W, (r+1)*P/W) and their
    sums. A rank holds its k/W centroids, one piece it receives, and one piece of sums (8 B per value):
    at 10M x 1024 on 128 ranks ~0.3 GB + 3 x 256 MB instead of 41 GB of centroids on every rank."""

    def __init__(self, k: int, d: int, rank: int, world: int, piece_bytes: int = PIECE_BYTES):
        self.k, self.d, self.rank, self.world = k, d, rank, world
        self.piece_bytes = piece_bytes
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

    @property
    def owned(self) -> list[int]:
        return [p for p in self.pieces if self.owner[p] == self.rank]

    def span(self, p: int) -> tuple[int, int]:
        return self.bounds[p], self.bounds[p + 1]

    def owner_of(self, labels: np.ndarray) -> np.ndarray:
        """Rank owning the centroid of each label."""
        return self.owner[np.asarray(labels, np.int64) // self.piece]

    def held_bytes(self) -> int:
        """Centroid bytes this rank holds at most: its pieces + one received piece + one piece of sums."""
        own = sum(v.nbytes for v in self.mine.values())
        return own + self.piece * self.d * (4 + 8)

    def scatter(self, full_of_root, comm: Comm) -> None:
        """Pieces of rank 0's (k, D) array (a callable evaluated there: k-means++ seeds of a bounded
        sample) to their owners."""
        full = full_of_root() if self.rank == 0 else None
        for p in self.pieces:
            a, b = self.span(p)
            got = comm.bcast_from(None if full is None else full[a:b], (b - a, self.d), 0)
            if self.owner[p] == self.rank:
                self.mine[p] = np.array(got, np.float32)

    def fill(self, rows_of) -> None:
        """Each owner reads its own pieces: ``rows_of(a, b)`` -> centroids a..b (fp32); nothing is sent."""
        for p in self.owned:
            self.mine[p] = np.ascontiguousarray(rows_of(*self.span(p)), np.float32).copy()

    def gather(self, comm: Comm) -> np.ndarray | None:
        """The (k, D) centroids on rank 0 (None elsewhere). Small k only (tests)."""
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
            del x  # not alive while the generator reads the next block
            if p == 0:
                labels.append(lab.astype(np.int64) + a)
                dists.append(d)
            else:
                upd = d < dists[i]
                labels[i][upd], dists[i][upd] = lab[upd] + a, d[upd]
    return labels, dists


def fixed_point_scale(n: int, max_abs: float) -> float:
    """2^s such that n values of magnitude <= ``max_abs``, each rounded to a multiple of 2^-s, sum
    exactly in int64 (< 2^62): the order-free sums of fp32 rows (the levels above level 1). At 10M
    unit-norm centroids s = 38: rows rounded by at most 2^-39, ~1e-4 of an fp32 ulp of a typical
    component (1/sqrt(D))."""
    e = int(np.ceil(np.log2(max_abs))) if max_abs > 0 else 0
    return float(2.0 ** (62 - int(n).bit_length() - e))


def lloyd_sharded(blocks, shards: CentroidShards, comm: Comm, niter: int, tol: float = 1e-4,
                  device: str = "cpu", scale: float | None = None) -> KMeansResult:
    """:func:`curation.kmeans.hierarchical.lloyd` with the centroids sharded: assignment by pieces, then per piece the
    sums and counts of this rank's rows reduced to the piece's owner only, which updates its centroids.
    ``scale`` None: float64 sums (exact for fp16 rows; with one piece this is :func:`lloyd`); else int64
    sums of the rows in fixed point (:func:`fixed_point_scale`). Exact either way, so the answer does not
    depend on the world size."""
    history: list[float] = []
    it = 0
    for it in range(1, niter + 1):
        labels, dists = assign_pieces(blocks, shards, comm, device)
        obj = comm.total(float(sum(d.sum(dtype=np.float64) for d in dists)))
        for p in shards.pieces:
            a, b = shards.span(p)
            sums = torch.zeros((b - a, shards.d), dtype=torch.float64 if scale is None else torch.int64)
            cnt = np.zeros(b - a, np.int64)
            for lab, x in zip(labels, blocks()):
                sel = np.flatnonzero((lab >= a) & (lab < b))
                for j in range(0, len(sel), EXACT_ROWS):  # widened EXACT_ROWS rows at a time, not the block
                    part = sel[j:j + EXACT_ROWS]
                    v = (torch.from_numpy(x[part]).double() if scale is None
                         else torch.from_numpy(np.rint(x[part].astype(np.float64) * scale).astype(np.int64)))
                    sums.index_add_(0, torch.from_numpy(lab[part] - a), v)
                cnt += np.bincount(lab[sel] - a, minlength=b - a)
                x = v = None  # not alive while the generator reads the next block
            owner = int(shards.owner[p])
            s, c = comm.reduce_to(sums.numpy(), owner), comm.reduce_to(cnt, owner)
            if owner == shards.rank:
                full = c > 0
                s = s[full] if scale is None else s[full].astype(np.float64) / scale
                shards.mine[p][full] = (s / c[full, None]).astype(np.float32)
        history.append(obj)
        if len(history) > 1 and history[-2] - obj <= tol * abs(history[-2]):
            break
    return KMeansResult(None, history[-1] if history else float("nan"), it, history)


def piece_counts(labels, weights, shards: CentroidShards, comm: Comm, out=None, block: int = BLOCK) -> None:
    """Per-cluster (weighted) counts of all ranks' rows, a piece at a time reduced to its owner, which
    writes them into ``out`` (a shared (k,) int64 memmap). No rank holds a k-sized array, nor a copy of its
    labels: ``labels`` / ``weights`` (this rank's, arrays or memory-mapped) are read ``block`` rows at a time."""
    for p in shards.pieces:
        a, b = shards.span(p)
        c = np.zeros(b - a, np.int64 if weights is None else np.float64)
        for s in range(0, len(labels), block):
            lab = np.asarray(labels[s:s + block], np.int64)
            sel = (lab >= a) & (lab < b)
            w = None if weights is None else np.asarray(weights[s:s + block], np.float64)[sel]
            c += np.bincount(lab[sel] - a, weights=w, minlength=b - a).astype(c.dtype, copy=False)
        got = comm.reduce_to(np.rint(c).astype(np.int64), int(shards.owner[p]))
        if got is not None:
            out[a:b] = got


class PartsArray:
    """Read-only int64 array that is the concatenation of per-rank ``.npy`` parts (memory-mapped): any rank
    reads any slice or positions without one process holding the whole array."""

    def __init__(self, paths: list[str]):
        self.parts = [np.load(p, mmap_mode="r") for p in paths]
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in self.parts])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, idx) -> np.ndarray:
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(len(self)))
        idx = np.asarray(idx, np.int64)
        out = np.empty(len(idx), np.int64)
        part = np.searchsorted(self.offsets, idx, side="right") - 1
        for p in np.unique(part):
            sel = part == p
            out[sel] = self.parts[p][idx[sel] - self.offsets[p]]
        return out


class SubRows:
    """The rows of ``rows`` at ``positions`` (an array or a :class:`PartsArray`), in that order."""

    def __init__(self, rows, positions):
        self.rows, self.positions = rows, positions

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def dim(self) -> int:
        return self.rows.dim

    def take(self, pos: np.ndarray) -> np.ndarray:
        return self.rows.take(self.positions[np.asarray(pos, np.int64)])


class Span:
    """``np.arange(n)`` without the array: the work positions when Lloyd iterates over every row (at 1.2B
    rows an arange is 9.6 GB on every rank)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return np.arange(*idx.indices(self.n), dtype=np.int64)
        return np.asarray(idx, np.int64)
