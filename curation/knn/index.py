"""faiss kNN search over L2-normalised embeddings (cosine = inner product).

Index choice by pool size, as in DINOv2's curation: exact ``IndexFlatIP`` for small pools, an
inverted file (IVF, ``nprobe`` lists visited per query) for large ones. IVF sizing (:func:`ivf_nlist`):
``nlist = max(4 sqrt(N), N / LIST_SIZE)`` -- a list never holds more than ~LIST_SIZE vectors, so a query
scans at most ``nprobe x LIST_SIZE`` codes whatever N -- and from ``HNSW_MIN_NLIST`` lists on the coarse
quantizer is an ``IndexHNSWFlat`` over the centroids (faiss's ``IVF{nlist}_HNSW32,...``): assigning a
vector (add) or a query (search) costs ~efSearch x log(nlist) distance evaluations instead of nlist. Below
that the flat quantizer stays (exact, and nlist evaluations are cheap).
With faiss-gpu and visible GPUs the index is sharded over all of them; otherwise faiss-cpu runs.
A trained index can be saved and read back memory-mapped (save_index / load_index): the
sharded kNN of curation.knn.shards trains it once and lets every array task search its slice.
Embeddings arrive as fp16 (memory-mapped) and are converted to fp32 one batch at a time, both
when adding and when querying. IVF stores vectors as fp16 (they were fp16 anyway: no loss).
"""

from __future__ import annotations

import math
from typing import Iterator

from dinopipe.config import InputError
from curation.core.faisslib import faiss
from curation.config import GPU_MAX_K, KINDS
from curation.knn.exact_coarse import ExactCoarse
import numpy as np

from dinopipe.utils.io import atomic_path


FLAT_MAX_DEFAULT = 50_000  # exact search up to here (~1 min for 50k x 50k x 384 on 2 cores)


def _is_embedding_set(data) -> bool:
    """An :class:`curation.core.embstore.EmbeddingSet` (by its interface: importing that module pulls in torch
    and the image decoders, which the array-only steps and their measured memory do without)."""
    return not isinstance(data, np.ndarray) and hasattr(data, "rows") and hasattr(data, "dim")


class Rows:
    """Uniform batched access to an in-memory array, a memmap or an :class:`EmbeddingSet`,
    optionally restricted to a subset of row positions."""

    def __init__(self, data, indices: np.ndarray | None = None):
        if isinstance(data, Rows):
            base = data.indices if data.indices is not None else None
            if indices is not None and base is not None:
                indices = base[indices]
            elif indices is None:
                indices = base
            data = data.data
        self.data = data
        self.indices = None if indices is None else np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self.indices) if self.indices is not None else len(self.data)

    @property
    def dim(self) -> int:
        return self.data.dim if _is_embedding_set(self.data) else self.data.shape[1]

    def take(self, positions: np.ndarray) -> np.ndarray:
        """fp32 rows at ``positions`` (positions within this view)."""
        rows = positions if self.indices is None else self.indices[positions]
        if _is_embedding_set(self.data):
            return self.data.rows(rows)
        return np.asarray(self.data[rows], dtype=np.float32)

    def batches(self, batch_size: int) -> Iterator[tuple[int, np.ndarray]]:
        for start in range(0, len(self), batch_size):
            pos = np.arange(start, min(start + batch_size, len(self)))
            yield start, np.ascontiguousarray(self.take(pos))


def num_gpus() -> int:
    try:
        return faiss.get_num_gpus()
    except AttributeError:  # faiss-cpu builds may lack the symbol
        return 0


"""flat: exact. ivf: inverted file, fp16 codes (2 B/dim: no loss, the embeddings are fp16).
ivf_sq8: 1 B/dim (half the memory). ivf_pq: ``pq_m`` bytes per vector (e.g. 64 B for 1024-d: 32x
smaller) when even SQ8 does not fit; candidate pairs are then rescored exactly from the stored
embeddings (curation.knn.shards), so only recall, not the similarities, pays for the compression."""


def check_gpu_limit(name: str, value: int, on_gpu: bool) -> None:
    """faiss-gpu rejects k / nprobe > 2048 deep inside a search; say it up front, with the fix."""
    if on_gpu and value > GPU_MAX_K:
        raise InputError(f"{name}={value} exceeds faiss-gpu's limit of {GPU_MAX_K} per query; lower "
                         f"{name} (DINOv2 uses k=64), or search on CPU (use_gpu=False)")


class KnnIndex:
    """A built faiss index plus the knobs needed to query it. A CPU IVF adds and searches through
    :class:`ExactCoarse` (the same lists and results on any thread count or batch shape)."""

    def __init__(self, index, kind: str, ntotal: int, nprobe: int, on_gpu: bool):
        self.index, self.kind, self.ntotal, self.nprobe, self.on_gpu = index, kind, ntotal, nprobe, on_gpu
        self._next_id = index.ntotal
        self.coarse = ExactCoarse(index) if ExactCoarse.applies(index, on_gpu) else None

    def add(self, x: np.ndarray) -> None:
        """Append rows; their ids continue from the rows already there (any number of calls)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        ids = np.arange(self._next_id, self._next_id + len(x), dtype=np.int64)
        if isinstance(self.index, faiss.IndexShards):  # sharded flat: explicit ids, see sharded_flat
            self.index.add_with_ids(x, ids)
        elif self.coarse is not None:
            self.coarse.add(x, ids)
        else:
            self.index.add(x)
        self._next_id += len(x)
        self.ntotal = self._next_id

    def search(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(B, D) fp32 queries -> (sims (B, k) fp32, positions (B, k) int64; -1 where missing)."""
        k = min(k, self.ntotal)
        if k <= 0:
            return np.zeros((len(x), 0), np.float32), np.zeros((len(x), 0), np.int64)
        check_gpu_limit("k", k, self.on_gpu)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.coarse is not None:
            if self.index.nprobe > self.coarse.nlist:
                # faiss probes at most nlist lists and lays the preassigned lists out nlist to a row then, while
                # its Python wrapper wants nprobe columns: a larger nprobe gave wrong rows (recall 0.03)
                self.index.nprobe = self.coarse.nlist
            dq, iq = self.coarse(x, int(self.index.nprobe))
            return self.index.search_preassigned(x, k, iq, dq)
        return self.index.search(x, k)

    def __repr__(self) -> str:
        return f"KnnIndex(kind={self.kind}, n={self.ntotal}, nprobe={self.nprobe}, gpu={self.on_gpu})"


def resolve_kind(kind: str, n: int, flat_max: int = FLAT_MAX_DEFAULT) -> str:
    if kind not in KINDS:
        raise ValueError(f"index kind {kind!r}: choose one of {', '.join(KINDS)}")
    if kind == "auto":
        kind = "flat" if n <= flat_max else "ivf"
    if kind != "flat" and n < 2 * 39:
        kind = "flat"  # too few points to train even a handful of lists
    return kind


LIST_SIZE = 4000
"""Target vectors per inverted list at scale (faiss's guideline for 10^8-10^9 vectors: IVF262144-IVF1M, i.e. a
few thousand per list); `curate simulate` uses 1000 (SIM_LIST_SIZE) so that its 1M-10M rows already have
N / list_size lists. Training costs sample x nlist (x nlist: the sample is 64 per list) on a GPU, so a
smaller list size at 1.2B (1.2M lists) would cost 16x more to train than this one (300k lists)."""
HNSW_MIN_NLIST = 40_000
"""From this many lists on the coarse quantizer is HNSW (``quantizer='auto'``); below, flat (exact). Measured
here on a quiet machine (384-d, one core, the simulation's clustered data, 5-10k vectors assigned in one call;
docs/curation-scale.md): one assignment costs 17 / 18 / 63 / 119 / 224 / 436 / 908 us with the flat quantizer
(BLAS) at 1k / 3k / 10k / 20k / 40k / 80k / 160k lists and 46 / 134 / 172 / 199 / 230 / 267 / 294 us with HNSW32
at efSearch 64 -- HNSW pays off from ~40k lists, where its ~log(nlist) cost wins more with every list. On a
GPU the flat quantizer's GEMM is cheaper still (faiss-gpu keeps it)."""
HNSW_M = 32
HNSW_EF_SEARCH = 64
"""efSearch of the HNSW coarse quantizer (stored in the trained index, so every add task and every search
uses the same); raised to nprobe when nprobe is larger."""
QUANTIZERS = ("auto", "flat", "hnsw")


def ivf_nlist(n: int, list_size: int = LIST_SIZE, sqrt_factor: float = 4.0) -> int:
    """The IVF sizing policy: ``max(sqrt_factor sqrt(N), N / list_size)`` lists (at most N / 39: faiss
    wants >= 39 training points per list). Up to ``(sqrt_factor x list_size)^2`` rows (256M at the defaults)
    the sqrt rule gives the lists (each holds fewer than list_size), above it the list size is fixed, so the
    per-query scan (nprobe x list size) stops growing with N."""
    return max(1, min(max(int(sqrt_factor * math.sqrt(n)), n // max(1, list_size)), n // 39))


def default_nlist(n: int) -> int:
    return ivf_nlist(n)


def resolve_quantizer(quantizer: str, nlist: int) -> str:
    if quantizer not in QUANTIZERS:
        raise ValueError(f"IVF quantizer {quantizer!r}: choose one of {', '.join(QUANTIZERS)}")
    if quantizer == "auto":
        return "hnsw" if nlist >= HNSW_MIN_NLIST else "flat"
    return quantizer


def factory_string(kind: str, d: int, nlist: int, pq_m: int = 0, quantizer: str = "flat") -> str:
    """The faiss index_factory description of ``kind`` (the CPU layout that is trained and saved);
    ``quantizer``: 'flat' or 'hnsw' (``IVF{nlist}_HNSW32``: the coarse quantizer an HNSW graph)."""
    if kind == "flat":
        return "Flat"
    codes = {"ivf": "SQfp16", "ivf_sq8": "SQ8"}.get(kind)
    if codes is None:  # ivf_pq
        m = pq_m or max(1, d // 16)
        if d % m:
            raise InputError(f"knn.pq_m={m} must divide the embedding dimension {d} (index kind ivf_pq; 0 picks "
                             f"{max(1, d // 16)})")
        codes = f"PQ{m}"
    q = f"_HNSW{HNSW_M}" if resolve_quantizer(quantizer, nlist) == "hnsw" else ""
    return f"IVF{nlist}{q},{codes}"


def build_index(data, kind: str = "auto", nlist: int | None = None, nprobe: int = 16,
                flat_max: int = FLAT_MAX_DEFAULT, use_gpu: bool | str = "auto",
                batch_size: int = 65536, train_size: int | None = None, seed: int = 0,
                pq_m: int = 0, quantizer: str = "auto") -> KnnIndex:
    """Build an inner-product index over ``data`` (array, memmap, EmbeddingSet or :class:`Rows`).

    ``kind``: see :data:`KINDS` ('auto': flat up to ``flat_max`` vectors, else ivf).
    """
    rows = data if isinstance(data, Rows) else Rows(data)
    n, d = len(rows), rows.dim
    kind = resolve_kind(kind, n, flat_max)
    ngpu = gpus_for(use_gpu)
    if kind == "flat":
        index = sharded_flat(d, ngpu) if ngpu else faiss.IndexFlatIP(d)
        knn = KnnIndex(index, kind, 0, nprobe, ngpu > 0)
    else:
        cpu = train_cpu_index(rows, kind, nlist or default_nlist(n), train_size, seed, pq_m, ngpu, quantizer)
        index = _to_gpus(cpu, ngpu) if ngpu else cpu
        set_nprobe(index, nprobe, ngpu > 0)
        knn = KnnIndex(index, kind, 0, nprobe, ngpu > 0)
    for _, x in rows.batches(batch_size):
        knn.add(x)
    return knn


def gpus_for(use_gpu: bool | str) -> int:
    ngpu = num_gpus() if use_gpu in (True, "auto") else 0
    if use_gpu is True and ngpu == 0:
        raise InputError("use_gpu=True but faiss sees no GPU (is faiss-gpu installed and CUDA "
                           "visible?); use use_gpu='auto' to fall back to faiss-cpu")
    return ngpu


def train_cpu_index(rows: Rows, kind: str, nlist: int, train_size: int | None, seed: int,
                    pq_m: int = 0, ngpu: int = 0, quantizer: str = "auto"):
    """An empty, trained CPU IVF index (k-means on a fixed random sample, on a GPU when there is one).

    With an HNSW coarse quantizer the k-means runs on an exact (flat, or GPU) index, as for the flat
    quantizer, and its centroids are then inserted into the HNSW graph by ONE thread: faiss inserts with
    OpenMP threads racing for the graph's links, which would make the graph, hence every assignment,
    depend on the scheduling. One thread, a fixed insertion order and HNSW's fixed level seed give the same
    graph in every run; the add tasks and the searches all read this one trained index."""
    d = rows.dim
    quantizer = resolve_quantizer(quantizer, nlist)
    index = faiss.index_factory(d, factory_string(kind, d, nlist, pq_m, quantizer), faiss.METRIC_INNER_PRODUCT)
    ivf = faiss.downcast_index(faiss.extract_index_ivf(index))  # the IndexIVFPQ, not its base
    ivf.cp.seed = seed
    if hasattr(ivf, "do_polysemous_training"):
        ivf.do_polysemous_training = False  # only for Hamming filtering, which we do not use (minutes)
    # Train on a fixed random sample: only that sample is ever fp32 in memory at once.
    rng = np.random.default_rng(seed)
    n = len(rows)
    sample = np.sort(rng.choice(n, size=min(n, train_size or nlist * 64), replace=False))
    x = np.ascontiguousarray(rows.take(sample))
    if ngpu:  # only the coarse k-means runs on the GPU; the trained index comes back to CPU
        ivf.clustering_index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0,
                                                      faiss.IndexFlatIP(d))
    if quantizer == "hnsw":
        _train_hnsw_quantizer(ivf, x, d, nlist)
    index.train(x)  # the quantizer is ready (ntotal == nlist): faiss trains only the codes here
    ivf.clustering_index = None  # the GPU k-means index is not part of the saved layout
    return index


def _train_hnsw_quantizer(ivf, x: np.ndarray, d: int, nlist: int) -> None:
    """The coarse centroids, added to the HNSW quantizer single-threaded.

    With a GPU: faiss's own coarse k-means (IndexIVF::train_q1's clustering parameters) on the GPU index.
    On CPU: faiss's two-level k-means (``faiss.contrib.clustering.two_level_clustering``: sqrt(nlist) coarse
    clusters, then each split into its share of the nlist), ~sample x 2 sqrt(nlist) x D per iteration
    instead of sample x nlist x D -- the flat k-means is what made training grow as nlist^2 once nlist
    follows N. Both spherical for inner product, seeded: the same centroids in every run."""
    if ivf.clustering_index is not None:
        clus = faiss.Clustering(d, nlist, ivf.cp)
        clus.train(x, ivf.clustering_index)
        cent = faiss.vector_float_to_array(clus.centroids).reshape(nlist, d)
    else:
        from faiss.contrib.clustering import two_level_clustering

        nc1 = max(1, min(int(round(math.sqrt(nlist))), len(x) // 39))
        try:
            cent = two_level_clustering(x, nc1, nlist, clustering_niter=ivf.cp.niter, seed=ivf.cp.seed,
                                        spherical=ivf.cp.spherical)[0]
        except (RuntimeError, AssertionError):  # a coarse cluster with fewer points than its share of lists
            clus = faiss.Clustering(d, nlist, ivf.cp)
            clus.train(x, faiss.IndexFlatL2(d))
            cent = faiss.vector_float_to_array(clus.centroids).reshape(nlist, d)
    q = faiss.downcast_index(ivf.quantizer)
    q.hnsw.efSearch = HNSW_EF_SEARCH
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        q.add(np.ascontiguousarray(cent, np.float32))
    finally:
        faiss.omp_set_num_threads(threads)


def sharded_flat(d: int, n_shards: int, make_shard=None):
    """Exact search over ``n_shards`` sub-indexes (one per GPU), accepting any number of add() calls.

    ``index_cpu_to_all_gpus(IndexFlat, shard=True)`` builds an IndexShards with *successive ids*,
    which refuses a second add() (faiss: "when adding to IndexShards with successive_ids, only
    add() in a single pass is supported"), so a pool added batch by batch failed after its first
    batch. Here each shard is an IndexIDMap holding the global ids of its rows; KnnIndex.add
    passes explicit ids, and IndexShards splits every batch over the shards.
    """
    if make_shard is None:
        res = [faiss.StandardGpuResources() for _ in range(n_shards)]

        def make_shard(i):
            cfg = faiss.GpuIndexFlatConfig()
            cfg.device, cfg.useFloat16 = i, True
            return faiss.GpuIndexFlatIP(res[i], d, cfg)

    shards = faiss.IndexShards(d, True, False)  # threaded, ids given by us
    for i in range(n_shards):
        shards.add_shard(faiss.IndexIDMap(make_shard(i)))
    return shards


def _to_gpus(cpu_index, ngpu: int):
    co = faiss.GpuMultipleClonerOptions()
    co.shard = True  # each GPU holds 1/ngpu of the vectors (a replica would hold all)
    co.useFloat16 = True
    co.common_ivf_quantizer = True  # one coarse quantizer, not one copy per shard
    return faiss.index_cpu_to_all_gpus(cpu_index, co=co, ngpu=ngpu)


def set_nprobe(index, nprobe: int, on_gpu: bool) -> None:
    check_gpu_limit("nprobe", nprobe, on_gpu)
    if on_gpu:
        faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", nprobe)
    else:
        ivf = faiss.extract_index_ivf(index)
        ivf.nprobe = min(nprobe, ivf.nlist)  # faiss probes at most nlist lists (ExactCoarse lays out this many)
        q = faiss.downcast_index(ivf.quantizer)
        if isinstance(q, faiss.IndexHNSW):  # the graph must return nprobe good lists
            q.hnsw.efSearch = max(q.hnsw.efSearch, nprobe)


def save_index(knn: KnnIndex, path: str) -> None:
    """Write a CPU copy of the index atomically (tmp + rename): a killed writer leaves no torn file."""
    index = faiss.index_gpu_to_cpu(knn.index) if knn.on_gpu else knn.index
    with atomic_path(path) as tmp:
        faiss.write_index(index, tmp)


def load_index(path: str, kind: str, nprobe: int = 16, use_gpu: bool | str = False,
               mmap: bool = True, ondisk: bool = False) -> KnnIndex:
    """Read a saved index. ``mmap``: the codes stay in the page cache (shared by the tasks of a
    node, evictable) instead of being copied into each task's heap. ``ondisk``: an index merged by
    :func:`merge_parts`, its lists memory-mapped from ``path.ivfdata`` beside it."""
    flags = faiss.IO_FLAG_ONDISK_SAME_DIR if ondisk else (faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY) if mmap else 0
    index = faiss.read_index(path, flags)
    ngpu = gpus_for(use_gpu)
    if ngpu:
        index = _to_gpus(index, ngpu)
    if kind != "flat":
        set_nprobe(index, nprobe, ngpu > 0)
    return KnnIndex(index, kind, index.ntotal, nprobe, ngpu > 0)


def iter_knn(index: KnnIndex, queries, k: int, batch_size: int = 8192,
             exclude_self: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yield ``(query positions, sims (B, k), neighbour positions (B, k))`` batch by batch.

    With ``exclude_self`` the queries are the indexed rows themselves: each row's own entry is
    removed (one extra neighbour is fetched for it) and missing neighbours are -1 / -inf.
    """
    rows = queries if isinstance(queries, Rows) else Rows(queries)
    kk = min(k + 1 if exclude_self else k, index.ntotal)
    check_gpu_limit("k" if not exclude_self else "k+1 (k neighbours and the row itself)", kk,
                    index.on_gpu)
    for start, x in rows.batches(batch_size):
        sims, idx = index.search(x, kk)
        pos = np.arange(start, start + len(x))
        if exclude_self:
            sims, idx = drop_self(sims, idx, pos, k)
        yield pos, sims, idx


def drop_self(sims, idx, pos, k):
    """Remove each query's own position; keep the first k others (rows with no self: drop last)."""
    is_self = idx == pos[:, None]
    # Rows without a self hit (possible with IVF, or ties among exact duplicates) drop their
    # last entry instead, so every row keeps exactly k' = kk - 1 neighbours.
    no_self = ~is_self.any(axis=1)
    is_self[no_self, -1] = True
    keep = ~is_self
    out_k = idx.shape[1] - 1
    sims = sims[keep].reshape(len(idx), out_k)[:, :k]
    idx = idx[keep].reshape(len(idx), out_k)[:, :k]
    idx = np.where(idx < 0, -1, idx)
    sims = np.where(idx < 0, -np.inf, sims).astype(np.float32)
    return sims, idx


# ------------------------------------------------------------------ the merged on-disk IVF
# (built by W tasks: curation/knn/ondisk.py)


def load_ondisk(path: str, kind: str, nprobe: int = 16) -> KnnIndex:
    """The merged index, its lists memory-mapped from ``path.ivfdata`` (shared page cache)."""
    index = faiss.read_index(path, faiss.IO_FLAG_ONDISK_SAME_DIR)
    set_nprobe(index, nprobe, False)
    return KnnIndex(index, kind, index.ntotal, nprobe, False)
