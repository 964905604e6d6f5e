"""Training pool memory and loader start-up (issue 10, item 3): listed references vs the compact pool index.

Two pools of tiny real PNGs (8x8, as curation writes them: 1,000 per webdataset tar shard, 9-digit keys) are
opened the way the trainer does, each in a fresh subprocess: open the pool, build the dataset + sampler +
DataLoader (2 forked workers, 64 images per batch) and iterate 10 batches. Per variant and pool size:
the rank's resident high-water mark (VmHWM of the fresh process, torch import included), and the time from
opening the pool to the first batch. Then one epoch's worth of lookups (every image's location, no I/O) in the
rank, and in each of two forked DataLoader workers: their growth in private dirty memory shows the copy-on-read
duplication (refcount writes to forked pages). Bytes per image = the growth of a figure from the small to the
large pool, divided by the growth in images (the constant part — interpreter, torch, workers — cancels). The
rank's figure includes the pages of the memory-mapped index it touched (file-backed: shared by every rank and
worker of a node through the page cache).

- ``list``:  the old path, ``list_pool`` -> a list of ImageRef objects in every rank (every rank walks every
  tar header at start).
- ``index``: ``open_pool`` maps ``pool-index.bin`` written next to the shards (curation writes it), i.e.
  what every rank does when the index exists (also every rank but the first, and every rerun, of a pool
  whose index is built once per run directory).
- ``index-build``: ``open_pool`` with no index anywhere: the first rank builds it into the run directory
  (one header walk), then maps it; start-up and peak of that first rank.

    python bench/bench_pool.py            # 20k and 320k images (~3 min on 2 cores)
    python bench/bench_pool.py --quick    # 5k and 40k
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

VARIANTS = ("list", "index", "index-build")


def write_pool(root: Path, n: int, per_shard: int = 1000) -> None:
    """``n`` tiny PNGs in tar shards; skipped when already there."""
    import numpy as np
    from PIL import Image

    if (root / ".complete").exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    pngs = []
    for v in range(16):  # a few distinct images, so decoding does real work
        buf = io.BytesIO()
        Image.fromarray(np.full((8, 8, 3), v * 16, dtype=np.uint8)).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    for s in range(0, n, per_shard):
        with tarfile.open(root / f"shard-{s // per_shard:06d}.tar", "w") as tf:
            for k in range(s, min(s + per_shard, n)):
                data = pngs[k % len(pngs)]
                info = tarfile.TarInfo(f"{k:09d}.png")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    (root / ".complete").write_text("ok")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _private_dirty_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("Private_Dirty:"))


def _touch_every_entry(refs) -> None:
    """What one epoch does to the pool structure: look up every image's location (no I/O)."""
    for i in range(len(refs)):
        loc = refs[i]
        getattr(loc, "loc", loc)


def _worker_touch(out_dir: str):
    def init(worker_id: int) -> None:
        import torch

        before = _private_dirty_kib()
        _touch_every_entry(torch.utils.data.get_worker_info().dataset.refs)
        with open(os.path.join(out_dir, f"worker-{worker_id}.json"), "w") as f:
            json.dump({"private_dirty_growth_kib": _private_dirty_kib() - before}, f)

    return init


def probe(variant: str, pool_dir: str, cache_dir: str, batches: int) -> dict:
    """One rank's start-up: open the pool, build the loader, iterate ``batches`` batches; then one epoch's
    worth of lookups in the rank and in each of 2 forked workers (copy-on-read shows up there)."""
    import numpy as np
    import torch

    from dinopipe.data.loader import DataPosition, build_train_loader, list_pool
    from dinopipe.data.pool_index import open_pool

    torch.set_num_threads(1)

    def transform(img, seed):
        return {"x": torch.from_numpy(np.asarray(img)).float().mean()}

    def collate(items, rng=None):
        return {"x": torch.stack([i["x"] for i in items])}

    t0 = time.perf_counter()
    if variant == "list":
        refs, read = list_pool([pool_dir])
    else:
        refs = open_pool([pool_dir], cache_dir=cache_dir)
        read = refs.read
    t_open = time.perf_counter() - t0

    def loader(**kw):
        return build_train_loader(refs, read, transform, collate, batch_per_rank=64, rank=0, world_size=1, seed=0,
                                  start=DataPosition(), num_workers=2, **kw)

    it = iter(loader())
    first = next(it)
    t_first = time.perf_counter() - t0
    n_seen = first["n_images"]
    for _ in range(batches - 1):
        n_seen += next(it)["n_images"]
    del it
    hwm_batches = _status_kib("VmHWM")
    _touch_every_entry(refs)
    hwm_epoch = _status_kib("VmHWM")
    with tempfile.TemporaryDirectory() as d:
        next(iter(loader(worker_init_fn=_worker_touch(d))))
        workers = [json.loads(Path(d, f"worker-{w}.json").read_text())["private_dirty_growth_kib"] for w in (0, 1)]
    return {"variant": variant, "n": len(refs), "seen": n_seen, "open_s": t_open, "first_batch_s": t_first,
            "hwm_kib": hwm_batches, "hwm_epoch_kib": hwm_epoch, "worker_private_kib": max(workers)}


def run_probe(variant: str, pool_dir: Path, cache_dir: Path, batches: int) -> dict:
    import subprocess

    if cache_dir.exists():
        shutil.rmtree(cache_dir)
    index = pool_dir / "pool-index.bin"
    if variant == "index" and not index.exists():
        from dinopipe.data.pool_index import write_source_index
        from dinopipe.data.sources import TarShardSource

        write_source_index(TarShardSource(str(pool_dir)), str(index))  # as curation/write/shards.py does
    if variant != "index" and index.exists():
        index.unlink()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, "--probe", variant, str(pool_dir), str(cache_dir), str(batches)],
                         env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"probe {variant} {pool_dir} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes", type=int, nargs=2, default=None, help="small and large pool sizes")
    p.add_argument("--rounds", type=int, default=2, help="probes per variant and size (median time, max memory)")
    p.add_argument("--workdir", default=None, help="keep the pools here (default: a temporary folder)")
    p.add_argument("--probe", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        variant, pool_dir, cache_dir, batches = args.probe
        print(json.dumps(probe(variant, pool_dir, cache_dir, int(batches))))
        return 0
    small, large = args.sizes or ((5_000, 40_000) if args.quick else (20_000, 320_000))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_pool_"))
    try:
        pools = {}
        for n in (small, large):
            t = time.perf_counter()
            write_pool(work / f"pool-{n}", n)
            pools[n] = work / f"pool-{n}"
            print(f"# pool of {n} images in {n // 1000} shards ready ({time.perf_counter() - t:.0f} s)", flush=True)
        res: dict = {}
        for r in range(args.rounds):  # alternate variants and sizes so that load from other jobs hits all alike
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for v in order:
                for n in (small, large):
                    got = run_probe(v, pools[n], work / "run" / "pool_index", batches=10)
                    assert got["n"] == n and got["seen"] == 640, got
                    res.setdefault((v, n), []).append(got)
        def med(xs):
            return sorted(xs)[len(xs) // 2]

        rows = {}
        for v in VARIANTS:
            per_image = {}
            for key in ("hwm_kib", "hwm_epoch_kib", "worker_private_kib"):
                at = {n: max(g[key] for g in res[(v, n)]) * 1024 for n in (small, large)}
                per_image[key] = (at[large] - at[small]) / (large - small)
            first = med([g["first_batch_s"] for g in res[(v, large)]])
            rows[v] = (per_image, first)
            print(f"pool_{v}_rank_bytes_per_image_10_batches: {per_image['hwm_kib']:.1f}")
            print(f"pool_{v}_rank_bytes_per_image_epoch: {per_image['hwm_epoch_kib']:.1f}")
            print(f"pool_{v}_worker_private_bytes_per_image_epoch: {per_image['worker_private_kib']:.1f}")
            for n in (small, large):
                print(f"pool_{v}_rank_peak_rss_mib_at_{n}: {max(g['hwm_epoch_kib'] for g in res[(v, n)]) / 1024:.0f}")
            print(f"pool_{v}_first_batch_s_at_{large}: {first:.2f}")
        print(f"pool_startup_ratio_list_over_index_at_{large}: {rows['list'][1] / rows['index'][1]:.1f}")
        print(f"\n| variant | rank B/image, 10 batches | rank B/image, after an epoch's lookups | worker private "
              f"B/image, after an epoch's lookups | first batch at {large:,} |")
        print("|---|---|---|---|---|")
        for v in VARIANTS:
            pi, first = rows[v]
            print(f"| {v} | {pi['hwm_kib']:.1f} | {pi['hwm_epoch_kib']:.1f} | {pi['worker_private_kib']:.1f} "
                  f"| {first:.2f} s |")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
