"""`curate simulate` on the chain `curate run` ships: generated inputs, then the steps of ``curate run`` after
embedding (curation.pipeline.run_steps: hash dedup, kNN, verification, grouping, decontamination, k-means,
sampling, decisions), nothing implemented twice.

What differs is only the input:

* ``embeddings/descriptor/``: the generated pool (curation.simulate.generate.gen_block, a function of the block
  alone, so the same pool for any W), written as one embedding shard per block with its perceptual hashes,
  by W runner tasks;
* ``embeddings/eval/``: eval rows, ``overlap`` of them near-copies of pool rows (the planted contamination), the
  rest around the eval set's own centres, away from the pool's (curation.simulate.generate.eval_fresh);
* ``truth/``: the planted (source, copy) pairs, hash near-duplicates and eval overlap;
* ``pool/``: the pool's pixels, one webdataset tar shard per block of small synthetic JPEGs (what
  ``input.paths`` names: the write step copies the kept ones into the output shards, the report shows them);
* the verifier: :func:`planted_verifier` (a pair is a copy iff it was planted) stands in for the pixel
  verification (the synthetic JPEGs are not copies of each other as the planted rows are).
"""

from __future__ import annotations

import functools
import io
import os
import tarfile

import numpy as np

from curation.core.embstore import mark_task_done, open_embeddings, save_shard
from curation.core.runner import BLOCK, part_done, part_path, parts, read_part, task_blocks, write_part
from curation.simulate import generate as gen
from curation.core.layout import RunLayout

SOURCE = "pool"  # the folder of the generated tar shards: a TarShardSource's name is its folder's
N_JPEGS = 16  # distinct synthetic images, reused round-robin: bytes to copy, not content to look at


def _desc(work: str) -> str:
    return RunLayout(work).embeddings("descriptor")


def pool_dir(work: str) -> str:
    """The generated pool's pixels (``input.paths`` of the simulation): one tar shard per block."""
    return os.path.join(work, SOURCE)


def _shard(b: int) -> str:
    return f"sim-{b:06d}.tar"


def _member(i: int) -> str:
    return f"{i:010d}.jpg"  # zero-padded: the canonical (sorted id) order is the generation order


@functools.lru_cache(maxsize=1)
def jpegs() -> tuple[bytes, ...]:
    """``N_JPEGS`` small (16 x 16) JPEG files of flat colours: real, decodable image bytes."""
    from PIL import Image

    out = []
    for k in range(N_JPEGS):
        buf = io.BytesIO()
        Image.new("RGB", (16, 16), (16 * k, 255 - 16 * k, (97 * k) % 256)).save(buf, format="JPEG", quality=80)
        out.append(buf.getvalue())
    return tuple(out)


def write_pool_shard(work: str, b: int, lo: int, hi: int) -> list:
    """Rows ``lo:hi`` as the tar shard of block ``b`` (written whole, then renamed: a killed task leaves none);
    returns each member's ``[shard, data offset, size]``, the location a TarShardSource gives it."""
    os.makedirs(pool_dir(work), exist_ok=True)
    path = os.path.abspath(os.path.join(pool_dir(work), _shard(b)))
    data, locs = jpegs(), []
    with tarfile.open(path + ".tmp", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(lo, hi):
            blob = data[i % len(data)]
            info = tarfile.TarInfo(_member(i))
            info.size, info.mtime = len(blob), 0
            tar.addfile(info, io.BytesIO(blob))
            locs.append([path, info.offset + tarfile.BLOCKSIZE, len(blob)])  # USTAR: one header block
    os.replace(path + ".tmp", path)
    return locs


def _meta(lo: int, hi: int, hashes: np.ndarray | None, locs: list | None = None, b: int = 0) -> dict:
    ids = [f"{SOURCE}/{_shard(b)}/{_member(i)}" for i in range(lo, hi)]
    return {"ids": ids, "sources": [SOURCE] * (hi - lo),
            "hashes": [f"{int(h):016x}" for h in hashes] if hashes is not None else ["0" * 16] * (hi - lo),
            "locs": locs if locs is not None else [f"/simulated/{i}" for i in ids], "unreadable": [],
            "n_listed": hi - lo}


def pool_task(t: int, w: int, work: str, n: int, dim: int, n_clusters: int, seed: int, copy_rate: float,
              hash_rate: float, max_distance: int, block: int) -> dict:
    """Runner task ``t`` of ``w``: its blocks of the pool, one embedding shard (and its 'embedding task'
    mark: one per block, whatever W) and one truth part per block."""
    cent, weights = gen.centres(n_clusters, dim, seed)
    nblocks = -(-n // block)
    done = 0
    for lo, hi in task_blocks(n, t, w, block):
        b = lo // block
        truth = part_path(os.path.join(work, "truth"), "block", b, nblocks)
        if part_done(truth):
            continue
        x, h, (s, d), (a, c), _ = gen.gen_block(lo, hi, cent, weights, dim, seed, copy_rate, hash_rate, max_distance)
        save_shard(_desc(work), f"part-{b:05d}-00000", x, _meta(lo, hi, h, write_pool_shard(work, b, lo, hi), b))
        mark_task_done(_desc(work), b, nblocks, {"images": hi - lo})
        write_part(truth, copy_src=gen.cat([s]), copy_dst=gen.cat([d]), hash_src=gen.cat([a]), hash_dst=gen.cat([c]))
        done += 1
    return {"blocks_written": done}


def write_eval(work: str, n: int, dim: int, n_clusters: int, n_eval: int, overlap: int, seed: int) -> None:
    """``embeddings/eval/``: ``overlap`` near-copies of random pool rows (their rows: truth/overlap.npy), the
    rest fresh eval rows around the eval set's own centres (:func:`generate.eval_fresh`)."""
    ev_dir = RunLayout(work).embeddings("eval")
    if os.path.exists(os.path.join(ev_dir, "task-00000-of-00001.json")):
        return
    rng = np.random.default_rng([seed, 2])
    rows = np.sort(rng.choice(n, size=min(overlap, n), replace=False))
    pool = open_embeddings(_desc(work))
    x = pool.rows(rows) + rng.standard_normal((len(rows), dim)).astype(np.float32) * np.float32(
        np.sqrt(gen.COPY_NOISE / dim))
    cent, w = gen.centres(n_clusters, dim, seed)
    m = n_eval - len(rows)
    fresh = gen.eval_fresh(m, cent, w, dim, rng)
    ev = gen._normalise(np.concatenate([x, fresh])).astype(np.float16)
    np.save(os.path.join(work, "truth", "overlap.npy"), rows.astype(np.int64))
    meta = _meta(0, len(ev), None)
    meta["ids"] = [f"eval/{i:08d}.jpg" for i in range(len(ev))]
    meta["sources"], meta["locs"] = ["eval"] * len(ev), [f"/simulated/eval/{i}" for i in range(len(ev))]
    save_shard(ev_dir, "part-00000-00000", ev, meta)
    mark_task_done(ev_dir, 0, 1, {"images": len(ev)})


def seeds_dir(work: str) -> str:
    """The generated seed set's images (``input.seed_paths`` in the retrieval modes)."""
    return os.path.join(work, "seeds")


def write_seeds(work: str, m: int, dim: int, n_clusters: int, seed: int) -> None:
    """A curated seed set of ``m`` images: points of a random half of the clusters (so retrieving around them
    rebalances), pre-embedded in ``embeddings/seeds/`` as `curate run` would have embedded them, and their
    JPEGs in :func:`seeds_dir` (ids ``seeds/<k>.jpg``, what a folder source of it lists)."""
    sd = RunLayout(work).embeddings("seeds")
    if os.path.exists(os.path.join(sd, "task-00000-of-00001.json")):
        return
    rng = np.random.default_rng([seed, 3])
    cent, _ = gen.centres(n_clusters, dim, seed)
    lab = rng.choice(rng.permutation(n_clusters)[: max(1, n_clusters // 2)], size=m)
    x = gen._normalise(cent[lab] + rng.standard_normal((m, dim)).astype(np.float32) * np.float32(
        np.sqrt(gen.SPREAD / dim))).astype(np.float16)
    os.makedirs(seeds_dir(work), exist_ok=True)
    names = [f"{k:08d}.jpg" for k in range(m)]
    for k, name in enumerate(names):
        with open(os.path.join(seeds_dir(work), name), "wb") as f:
            f.write(jpegs()[k % N_JPEGS])
    meta = _meta(0, m, None)
    meta["ids"], meta["sources"] = [f"seeds/{name}" for name in names], ["seeds"] * m
    meta["locs"] = [os.path.abspath(os.path.join(seeds_dir(work), name)) for name in names]
    save_shard(sd, "part-00000-00000", x, meta)
    mark_task_done(sd, 0, 1, {"images": m})


def truth(work: str, n: int, block: int = 0) -> dict:
    """The planted pairs (pool positions = generation rows), gathered from the truth parts."""
    block = block or BLOCK
    got = [read_part(p) for p in parts(os.path.join(work, "truth"), "block", -(-n // block))]
    out = {k: np.concatenate([g[k] for g in got]) for k in got[0]}
    out["overlap"] = np.load(os.path.join(work, "truth", "overlap.npy"))
    return out


def planted_verifier_of(work: str, rows_path: str, n: int, block: int):
    """The verifier factory's body (picklable through functools.partial): ``verify(a, b)`` over positions into
    ``rows_path`` (the hash survivors): True iff the two rows are a planted (source, copy) pair."""
    rows = np.load(rows_path, mmap_mode="r")
    tr = truth(work, n, block)
    key = np.sort(np.minimum(tr["copy_src"], tr["copy_dst"]) * n + np.maximum(tr["copy_src"], tr["copy_dst"]))

    def verify(a, b):
        pa, pb = np.asarray(rows[np.asarray(a, np.int64)]), np.asarray(rows[np.asarray(b, np.int64)])
        k = np.minimum(pa, pb) * n + np.maximum(pa, pb)
        i = np.minimum(np.searchsorted(key, k), max(len(key) - 1, 0))
        return (key[i] == k) if len(key) else np.zeros(len(k), bool)

    return verify


def planted_factory(work: str, n: int, block: int):
    """``factory(out_dir, sources, surv, size, threshold)`` of curation.pipeline's verifier slot: the planted
    truth instead of pixels (the survivors saved as the pixel verifier's are)."""
    def make(out_dir, sources, surv, size, threshold):
        from curation.dedup.knn import save_verify_rows

        return functools.partial(planted_verifier_of, work, save_verify_rows(out_dir, surv), n, block)

    return make
