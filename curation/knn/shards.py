"""Sharded kNN over the pool: one index trained and saved once, N tasks each searching a slice.

Copy dedup, decontamination and retrieval need every pool image's nearest neighbours; at LVD scale
(142M-1.2B embeddings) neither the vectors nor the search fit one process. The work splits the
way faiss's billion-scale recipes split it, on Slurm job arrays (no RPC layer):

1. ``build_index`` (one job): train an IVF (fp16 / SQ8 / PQ codes) on a fixed sample, add all
   rows, write ``knn/pool.index`` and ``knn/meta.json`` (the parameters every task must share).
2. ``search_chunks`` (array task t of N): read the index memory-mapped, search its contiguous range
   of query *chunks* and write one ``chunk-CCCCCC.npz`` per chunk (tmp + rename). A killed task is
   simply rerun: chunks already on disk are skipped. Memory: the chunk's queries plus the index.
3. ``pair_keys`` (finishing job): the chunks read one at a time, one sorted int64 key per unordered pair
   (``merge_pairs``: the same pairs from concatenated arrays, for callers holding them).

Same pairs for any number of tasks, by construction rather than by luck:
* chunk c always holds query rows [c*C, (c+1)*C) and is searched in the same batches, so every
  faiss/BLAS call sees exactly the inputs it sees in a 1-task run (a float computed at another batch
  shape may differ by an ulp; here no shape ever differs);
* a candidate (faiss similarity > threshold - margin, among the k nearest) becomes a pair only if its
  exact cosine, recomputed in float64 from the stored fp16 rows, is > threshold. That value is
  symmetric and independent of batching, so neither the threshold nor the direction a pair was
  found in (a's list or b's) can flip a decision; PQ/SQ8 distortions only cost recall (the margin).
* ties at the k-th neighbour are broken by faiss identically in every run (same inputs, same order).

The query-slice split suits dedup, where the queries are the indexed rows themselves; faiss's
``contrib/big_batch_search.py`` splits by inverted-list range instead, which needs every query in
every task and pays off when the index, not the queries, is what does not fit.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import numpy as np

from dinopipe.config import InputError
from dinopipe.utils.exits import UnfinishedError
from dinopipe.utils.io import atomic_path, atomic_write_json

from curation.knn.index import KnnIndex, Rows, build_index, default_nlist, gpus_for, load_index, resolve_kind, save_index
from curation.knn.ondisk import add_part, merge_parts, train_ondisk
from curation.knn.candidates import (BATCH_DEFAULT, MARGIN_EXACT, MARGIN_LOSSY, concat_parts, fraction_pairs, nearest_exact,
                                     retrieval_candidates)
from curation.core.runner import inline as runs_inline, launch, launch_alone, run_step, task_rows
from curation.core.layout import RunLayout

CHUNK_SIZE_DEFAULT = 65536  # queries per chunk file: the unit of resumption


# ---------------------------------------------------------------------------------- chunk files


def n_chunks(n: int, chunk_size: int) -> int:
    return -(-n // chunk_size)


def task_chunks(total: int, task_index: int, num_tasks: int) -> range:
    """The contiguous chunk range of array task ``task_index`` of ``num_tasks``."""
    if not 0 <= task_index < num_tasks:
        raise ValueError(f"task_index {task_index} is not in [0, num_tasks={num_tasks})")
    return range(task_index * total // num_tasks, (task_index + 1) * total // num_tasks)


def chunk_path(folder: str, c: int) -> str:
    return os.path.join(folder, f"chunk-{c:06d}.npz")


def run_chunks(folder: str, n: int, chunk_size: int, task_index: int, num_tasks: int,
               compute: Callable[[int, int], dict], progress: bool = False) -> dict:
    """Compute this task's missing chunks of [0, n) and write each atomically; skip finished ones."""
    os.makedirs(folder, exist_ok=True)
    mine = task_chunks(n_chunks(n, chunk_size), task_index, num_tasks)
    todo = [c for c in mine if not os.path.exists(chunk_path(folder, c))]
    from dinopipe.utils.progress import progress as reporter

    for c in reporter(todo, desc=f"kNN chunks ({os.path.basename(folder)})", disable=not progress):
        arrays = compute(c * chunk_size, min((c + 1) * chunk_size, n))
        path = chunk_path(folder, c)
        with atomic_path(path, suffix=".npz") as tmp:  # present <=> complete: a killed task leaves only a tmp file
            np.savez(tmp, **arrays)
        del arrays  # not alive while the next chunk is computed (a task of 5 chunks held 2 at its peak)
    return {"chunks": len(mine), "computed": len(todo), "skipped": len(mine) - len(todo)}


def _check_chunks(folder: str, n: int, chunk_size: int) -> int:
    """The number of chunks of [0, n); a clear error naming the missing ones."""
    total = n_chunks(n, chunk_size)
    missing = [c for c in range(total) if not os.path.exists(chunk_path(folder, c))]
    if missing:
        raise UnfinishedError(  # search tasks killed or not yet run: exit 75, not the user's mistake
            f"{folder}: {len(missing)} of {total} kNN chunks missing (first: {chunk_path(folder, missing[0])}); "
            "rerun the `curate search` array tasks (finished chunks are skipped)")
    return total


def iter_chunks(folder: str, n: int, chunk_size: int):
    """(first query row, {array name: that chunk's rows}) of every chunk of [0, n) in order, one chunk in
    memory at a time; a clear error naming the missing ones (checked before the first is read)."""
    total = _check_chunks(folder, n, chunk_size)
    for c in range(total):
        yield c * chunk_size, ChunkArrays(chunk_path(folder, c))


class ChunkArrays(Mapping):
    """One chunk file's arrays by name, each read from the file when first asked for: the pairs' readers use
    ``a`` / ``b`` / ``sim`` and never hold the chunk's ``nn_sim`` / ``nn_idx`` (12 B per query row)."""

    def __init__(self, path: str) -> None:
        self.path, self._arrays = path, {}
        with np.load(path) as z:
            self._keys = tuple(z.files)

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._arrays:
            if key not in self._keys:
                raise KeyError(f"{self.path} has no array {key!r} (it has {', '.join(self._keys)})")
            with np.load(self.path) as z:
                self._arrays[key] = z[key]
        return self._arrays[key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class ChunkColumn:
    """One array of the chunk files as a read-only column of ``n`` rows, read a chunk at a time (the last chunk
    read is kept): what a block loop over the rows needs, without the whole column in memory (copy dedup's
    ``nn_sim``, 4 B per survivor otherwise). ``np.asarray`` reads it whole where one is needed."""

    def __init__(self, folder: str, n: int, chunk_size: int, key: str) -> None:
        self.folder, self.n, self.chunk_size, self.key = folder, n, chunk_size, key
        self._cached: tuple[int, np.ndarray] | None = None
        _check_chunks(folder, n, chunk_size)

    def __len__(self) -> int:
        return self.n

    def _chunk(self, c: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != c:
            with np.load(chunk_path(self.folder, c)) as z:
                self._cached = (c, z[self.key])
        return self._cached[1]

    def __getitem__(self, sl: slice) -> np.ndarray:
        start, stop, step = sl.indices(self.n)
        if step != 1:
            raise IndexError("ChunkColumn reads contiguous slices")
        parts = []
        while start < stop:
            c = start // self.chunk_size
            lo = c * self.chunk_size
            end = min(stop, lo + self.chunk_size)
            parts.append(self._chunk(c)[start - lo:end - lo])
            start = end
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[0:self.n]
        return out if dtype is None else out.astype(dtype)


def read_chunks(folder: str, n: int, chunk_size: int, keys=None) -> dict[str, np.ndarray]:
    """All chunks of [0, n), concatenated per array name (``keys``: only these); a clear error naming the
    missing ones."""
    parts: dict[str, list] = {}
    for _, chunk in iter_chunks(folder, n, chunk_size):
        for key in chunk:
            if keys is None or key in keys:  # the others are never read from the file
                parts.setdefault(key, []).append(chunk[key])
    return {k: np.concatenate(v) for k, v in parts.items()}


def merge_pairs(a: np.ndarray, b: np.ndarray, sim: np.ndarray):
    """Directed pairs -> unordered pairs (lo < hi), each once, sorted: independent of chunking."""
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    order = np.lexsort((hi, lo))
    lo, hi, sim = lo[order], hi[order], sim[order]
    first = np.ones(len(lo), bool)
    first[1:] = (lo[1:] != lo[:-1]) | (hi[1:] != hi[:-1])
    return lo[first], hi[first], sim[first]


PAIR_SLICE = 1 << 20
"""Directed pairs of a chunk turned into keys at a time by :func:`pair_keys`."""


def pair_keys(chunks, n: int, threshold: float, own=None) -> np.ndarray:
    """The unordered pairs (lo < hi) above ``threshold`` of the directed pairs in ``chunks`` (``iter_chunks``), as
    sorted unique keys ``lo * n + hi`` (int64): 8 B per pair held, where concatenating the chunks' ``a``/``b``/``sim``
    and merging them (:func:`merge_pairs`) held ~100 B per pair at its peak. Read a chunk at a time. The chunks'
    sims are exact and symmetric (module docstring), so which direction of a pair is seen first does not matter:
    the same pair set as ``merge_pairs`` then ``dedup.canonical_pairs``. ``own(lo) -> bool``: keep only the pairs
    whose smaller end it accepts (a verification task's share, curation.verify.tasks)."""
    parts = []
    for _, c in chunks:
        for i in range(0, len(c["a"]), PAIR_SLICE):  # the temporaries below: a slice's, not a whole chunk's
            a = np.asarray(c["a"][i:i + PAIR_SLICE], np.int64)
            b = np.asarray(c["b"][i:i + PAIR_SLICE], np.int64)
            # compared as float32, as dedup.canonical_pairs does (a float64 cosine just above the threshold that
            # rounds to it is not a candidate there either)
            hit = (np.asarray(c["sim"][i:i + PAIR_SLICE], np.float32) > threshold) & (a != b) & (a >= 0) & (b >= 0)
            lo, hi = np.minimum(a[hit], b[hit]), np.maximum(a[hit], b[hit])
            del a, b, hit
            if own is not None:
                mine = own(lo)
                lo, hi = lo[mine], hi[mine]
            parts.append(np.unique(lo * n + hi))
            del lo, hi
        del c
    keys = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    del parts
    keys.sort()  # in place: no second array of keys
    first = np.ones(len(keys), bool)
    first[1:] = keys[1:] != keys[:-1]
    return keys[first]


# ---------------------------------------------------------------------------------- the kNN job


class KnnJob:
    """The ``knn/`` folder of a curation output: saved index, parameters and chunk files.

    ``name`` is 'pool' (copy-dedup pairs: queries = indexed rows), 'eval' (decontamination:
    index over eval images, queries = pool rows) or 'retrieval' (rebalance mode 'sample': index
    over the rebalanced rows in the model space, queries = seed images).
    """

    def __init__(self, out_dir: str, name: str = "pool"):
        self.dir = RunLayout(out_dir).knn(name)
        self.index_path = os.path.join(self.dir, "index.faiss")
        self.meta_path = os.path.join(self.dir, "meta.json")
        self.chunks_dir = os.path.join(self.dir, "chunks")

    def meta(self) -> dict | None:
        if not (os.path.exists(self.meta_path) and os.path.exists(self.index_path)):
            return None
        with open(self.meta_path) as f:
            return json.load(f)

    def matches(self, params: dict) -> bool:
        meta = self.meta()
        return meta is not None and meta["params"] == _jsonable(params)

    def build(self, rows: Rows, params: dict, use_gpu: bool | str = "auto", progress: bool = False,
              source: "RowSource | None" = None, tasks: dict | None = None) -> dict:
        """Train + fill the index over ``rows`` and save it with ``params``; old chunks are removed
        (they belong to another index). ``params``: kind, nprobe, nlist, pq_m, train_size, seed,
        plus whatever the searches need (k, threshold, chunk_size, ...): every task reads them here.

        IVF kinds on CPU are built as faiss's on-disk pattern: trained once on a sample, filled by
        ``tasks["tasks"]`` add tasks (each its rows' codes in its own file, blocks of ``chunk_size``
        rows), merged on disk into ``index.faiss.ivfdata`` (:func:`build_ondisk`). ``source``: where a
        task process reopens ``rows`` (needed unless the tasks run inline). With GPUs too (issue 40): the
        sample's k-means on the GPU, the adds as W tasks (each gets its share of the visible GPUs from the
        runner; the exact coarse assignment of an add runs on its CPU), the searches on the GPUs as before --
        faiss-cpu runs the same code path. Flat (small pools) adds in this process."""
        kind = resolve_kind(params.get("kind", "auto"), len(rows), params.get("flat_max", 50_000))
        if kind != "flat":
            return self.build_ondisk(rows, params, kind, source, tasks, ngpu=gpus_for(use_gpu))
        if os.path.isdir(self.dir):
            shutil.rmtree(self.dir)
        os.makedirs(self.dir)
        knn = build_index(rows, kind=kind, nlist=params.get("nlist"), nprobe=params.get("nprobe", 16),
                          use_gpu=use_gpu, train_size=params.get("train_size"),
                          seed=params.get("seed", 0), pq_m=params.get("pq_m", 0),
                          quantizer=params.get("quantizer", "auto"))
        save_index(knn, self.index_path)
        meta = {"params": _jsonable(params), "kind": knn.kind, "n": len(rows), "dim": rows.dim,
                "index_bytes": os.path.getsize(self.index_path)}
        atomic_write_json(self.meta_path, meta)  # written last: its presence marks a complete index
        return meta

    def build_ondisk(self, rows: Rows, params: dict, kind: str, source: "RowSource | None" = None,
                     tasks: dict | None = None, ngpu: int = 0) -> dict:
        """The IVF trained once on a fixed sample (its k-means on a GPU when ``ngpu``), rows added by W tasks
        into separate inverted-list files, merged on disk (faiss.contrib.ondisk): no process holds all codes.
        Resumable: a rerun with the same ``params`` keeps the trained index and the finished add parts."""
        plan = tasks or {"tasks": 1, "launcher": "inline"}
        w = int(plan["tasks"])
        build_json = os.path.join(self.dir, "build.json")
        if not (os.path.exists(build_json) and _read_json(build_json) == _jsonable(params)):
            if os.path.isdir(self.dir):
                shutil.rmtree(self.dir)
            os.makedirs(self.dir)
            atomic_write_json(build_json, _jsonable(params))
        for stale in (self.meta_path, self.index_path, self.index_path + ".ivfdata"):
            if os.path.exists(stale):
                os.remove(stale)
        if os.path.isdir(self.chunks_dir):
            shutil.rmtree(self.chunks_dir)
        trained = os.path.join(self.dir, "trained.index")
        inline = runs_inline(plan["launcher"], w)
        if not os.path.exists(trained):  # resumable: a trained index on disk is kept
            # ONE task, in its own process whenever the adds are (issue 40): the sample and its k-means are the
            # task's memory, not the orchestrator's; inline stays inline
            run_step(index_train, 1, **launch_alone(plan["launcher"], w),
                     path=trained, rows=rows if inline else _need_source(source), kind=kind,
                     nlist=params.get("nlist") or default_nlist(len(rows)), train_size=params.get("train_size"),
                     seed=params.get("seed", 0), pq_m=params.get("pq_m", 0),
                     quantizer=params.get("quantizer", "auto"), ngpu=ngpu)
        names = [os.path.join(self.dir, "add", f"part-{t:05d}-of-{w:05d}.index") for t in range(w)]
        os.makedirs(os.path.join(self.dir, "add"), exist_ok=True)
        run_step(add_task, w, **launch(plan["launcher"], w), trained=trained,
                 rows=rows if inline else _need_source(source), names=names,
                 block=params.get("chunk_size", CHUNK_SIZE_DEFAULT))
        # ONE task in a process of its own too: the quantizers it reads and the parts' lists faiss's merge leaves
        # mapped (their deleted files' disk space with them) end with it, not with the orchestrator
        run_step(index_merge, 1, **launch_alone(plan["launcher"], w),
                 trained=trained, names=names, path=self.index_path)
        shutil.rmtree(os.path.join(self.dir, "add"))  # the merged lists hold them now
        meta = {"params": _jsonable(params), "kind": kind, "n": len(rows), "dim": rows.dim, "ondisk": True,
                "add_tasks": w, "index_bytes": os.path.getsize(self.index_path)
                + os.path.getsize(self.index_path + ".ivfdata")}
        atomic_write_json(self.meta_path, meta)  # written last: its presence marks a complete index
        return meta

    def load(self, use_gpu: bool | str = False) -> tuple[KnnIndex, dict]:
        meta = self.meta()
        if meta is None:
            raise FileNotFoundError(f"{self.dir}: no saved index; run `curate index` first")
        return load_index(self.index_path, meta["kind"], meta["params"].get("nprobe", 16), use_gpu,
                          ondisk=meta.get("ondisk", False)), meta

    def search_pairs(self, rows: Rows, task_index: int = 0, num_tasks: int = 1,
                     use_gpu: bool | str = False, progress: bool = False) -> dict:
        """Array task ``task_index``: copy-candidate pairs of its query chunks (rows = indexed rows)."""
        index, meta = self.load(use_gpu)
        p = meta["params"]
        _check_rows(meta, rows)
        margin = p.get("margin") or (MARGIN_EXACT if meta["kind"] in ("flat", "ivf") else MARGIN_LOSSY)

        def compute(start, stop):
            return fraction_pairs(index, rows, start, stop, p["k"], p["threshold"],
                                  p.get("batch_size", BATCH_DEFAULT), margin, p.get("query_fraction", 1.0))

        return run_chunks(self.chunks_dir, len(rows), p.get("chunk_size", CHUNK_SIZE_DEFAULT),
                          task_index, num_tasks, compute, progress)

    def search_nearest(self, queries: Rows, targets: Rows, task_index: int = 0, num_tasks: int = 1,
                       use_gpu: bool | str = False, progress: bool = False) -> dict:
        """Array task ``task_index``: each query row's best indexed row (decontamination: pool rows
        against the eval index); ``targets``: the indexed rows, for exact rescoring."""
        index, meta = self.load(use_gpu)
        p = meta["params"]
        _check_rows(meta, targets)

        def compute(start, stop):
            return concat_parts(list(nearest_exact(index, queries, targets, start, stop, p.get("k", 4),
                                                   p.get("batch_size", BATCH_DEFAULT))))

        return run_chunks(self.chunks_dir, len(queries), p.get("chunk_size", CHUNK_SIZE_DEFAULT),
                          task_index, num_tasks, compute, progress)

    def search_retrieval(self, queries: Rows, targets: Rows, task_index: int = 0, num_tasks: int = 1,
                         use_gpu: bool | str = False, progress: bool = False) -> dict:
        """Array task ``task_index``: (seed, pool position, exact sim) of its chunks of seed rows
        against the pool index ('retrieval'); ``targets``: the indexed pool rows, for rescoring."""
        index, meta = self.load(use_gpu)
        p = meta["params"]
        _check_rows(meta, targets)

        def compute(start, stop):
            return concat_parts(list(retrieval_candidates(index, queries, targets, start, stop, p["k"],
                                                          p.get("batch_size", BATCH_DEFAULT))))

        return run_chunks(self.chunks_dir, len(queries), p.get("chunk_size", CHUNK_SIZE_DEFAULT),
                          task_index, num_tasks, compute, progress)

    def _chunk_size(self) -> int:
        meta = self.meta()
        if meta is None:
            raise FileNotFoundError(f"{self.dir}: no saved index; run `curate index` first")
        return meta["params"].get("chunk_size", CHUNK_SIZE_DEFAULT)

    def read(self, n_queries: int, keys=None) -> dict[str, np.ndarray]:
        return read_chunks(self.chunks_dir, n_queries, self._chunk_size(), keys)

    def column(self, n_queries: int, key: str) -> ChunkColumn:
        """One array of the chunks as a column read a chunk at a time (:class:`ChunkColumn`)."""
        return ChunkColumn(self.chunks_dir, n_queries, self._chunk_size(), key)

    def iter(self, n_queries: int):
        """:meth:`read` a chunk at a time: (first query row, {array name: the chunk's rows})."""
        return iter_chunks(self.chunks_dir, n_queries, self._chunk_size())


# ------------------------------------------------------------------ the steps as W tasks (runner)


@dataclass(frozen=True)
class RowSource:
    """Where a task process reopens a :class:`Rows` view: an embeddings folder (or a ``.npy`` of rows) and
    (optionally) a ``.npy`` of the row positions (picklable, unlike a memory-mapped set)."""

    emb_dir: str
    positions: str | None = None

    @classmethod
    def save(cls, emb_dir: str, positions: np.ndarray | None, path: str) -> "RowSource":
        if positions is None:
            return cls(emb_dir)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_path(path, suffix=".npy") as tmp:
            np.save(tmp, np.asarray(positions, np.int64))
        return cls(emb_dir, path)

    def open(self) -> Rows:
        from curation.core.embstore import open_embeddings

        if self.emb_dir.endswith(".npy"):  # an array of rows (the eval views: curation.decontaminate.views)
            return Rows(np.load(self.emb_dir, mmap_mode="r"),
                        None if self.positions is None else np.load(self.positions, mmap_mode="r"))
        emb = open_embeddings(self.emb_dir)
        # memory-mapped: a task reads the positions of its own rows (N int64 loaded whole: 80 MB a task at 10M)
        return Rows(emb, None if self.positions is None else np.load(self.positions, mmap_mode="r"))


def _open(rows) -> Rows:
    return rows.open() if isinstance(rows, RowSource) else rows


def _need_source(source):
    if source is None:
        raise ValueError("tasks in other processes reopen the rows: pass source=RowSource(...)")
    return source


def index_train(task_index: int, num_tasks: int, path: str, rows, **kw) -> dict:
    """Index training, the one task: the IVF trained on its sample of ``rows``, written to ``path``
    (:func:`train_ondisk`, kept when it exists; ``kw``: its parameters, ``ngpu`` included: the k-means on the
    GPUs this task sees)."""
    train_ondisk(_open(rows), path, **kw)
    return {"trained": path}


def index_merge(task_index: int, num_tasks: int, trained: str, names: list[str], path: str) -> dict:
    """Index merge, the one task: the add tasks' inverted-list files merged into ``path`` (:func:`merge_parts`)."""
    return {"ntotal": merge_parts(trained, names, path)}


def add_task(task_index: int, num_tasks: int, trained: str, rows, names: list[str], block: int) -> dict:
    """Index add, task ``task_index``: its whole blocks of rows into its own inverted-list file."""
    rows = _open(rows)
    lo, hi = task_rows(len(rows), task_index, num_tasks, block)
    return {"added": add_part(trained, rows, lo, hi, names[task_index], block)}


def search_task(task_index: int, num_tasks: int, out_dir: str, name: str, mode: str, queries, targets=None,
                use_gpu: bool | str = False) -> dict:
    """kNN search, task ``task_index``: its chunks of the queries (``mode``: pairs | nearest | retrieval)."""
    job, q = KnnJob(out_dir, name), _open(queries)
    if mode == "pairs":
        return job.search_pairs(q, task_index, num_tasks, use_gpu)
    t = _open(targets)
    if mode == "nearest":
        return job.search_nearest(q, t, task_index, num_tasks, use_gpu)
    return job.search_retrieval(q, t, task_index, num_tasks, use_gpu)


def run_search(out_dir: str, name: str, mode: str, queries, targets=None, use_gpu: bool | str = False,
               tasks: dict | None = None, sources: tuple = (None, None)) -> list[dict]:
    """All chunks of a search as W tasks (the runner: inline, or W local processes that reopen the rows
    from ``sources`` = (queries', targets' :class:`RowSource`)); finished chunks are skipped. The chunks,
    hence the pairs, are the same for any W (see the module docstring)."""
    plan = tasks or {"tasks": 1, "launcher": "inline"}
    w = int(plan["tasks"])
    inline = runs_inline(plan["launcher"], w)
    if not inline:
        queries = _need_source(sources[0])
        targets = targets if targets is None else _need_source(sources[1])
    return run_step(search_task, w, **launch(plan["launcher"], w), out_dir=out_dir, name=name,
                    mode=mode, queries=queries, targets=targets, use_gpu=use_gpu)


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _check_rows(meta: dict, rows: Rows) -> None:
    if meta["n"] != len(rows) or meta["dim"] != rows.dim:
        raise InputError(f"the saved index holds {meta['n']} x {meta['dim']} rows but the search got "
                         f"{len(rows)} x {rows.dim}: the pool changed since `curate index`; rerun it")


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))
