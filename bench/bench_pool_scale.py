"""The training data path at 10^7 images (issue 20, item 6): time to first batch and per-rank memory, before and
after, for one rank of a W-rank run.

A synthetic pool of ``--images`` entries (default 10M) over ``--shards`` webdataset shards (default 10,000,
1,000 images each, as LVD-142M's layout): the shard files are hard links to four real tar shards of real photos,
and ``pool-index.bin`` (the index curation writes next to its shards) points every entry at one of their members,
so validation stats 10,000 real files and every batch decodes real JPEGs. Each measurement is a fresh process
playing rank ``--rank`` of ``--world`` (no process group: the new code's all-reduce is this rank's own answer),
that opens the pool as the trainer does, builds the loader (64 images per rank, 0 workers) and takes the first
batch of epoch 0, then the first batch of epoch 1 (the old code draws a new full permutation there). Reported:
seconds to open the pool, to the first batch, to the first batch of the next epoch, shard ``stat`` calls,
file opens per batch, and the rank's peak RSS (VmHWM, torch import included) and its growth over the import.

"Before" is the code at a given commit (``--before-src``: a checkout of it, e.g. ``git archive 253919c | tar -x
-C /tmp/base``); "after" is this checkout.

    python bench/bench_pool_scale.py --before-src /tmp/base          # 10M images, rank 3 of 8 (~3 min)
    python bench/bench_pool_scale.py --before-src /tmp/base --images 1000000 --shards 1000   # quick
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def make_pool(out: Path, n_images: int, n_shards: int) -> Path:
    """shards/part-NNNNNN.tar (hard links to 4 real shards) + shards/pool-index.bin for n_images entries."""
    import numpy as np
    from PIL import Image

    from dinopipe.data.pool_index import INDEX_NAME, write_index
    from dinopipe.data.samples import real_photos

    shards = out / "shards"
    done = out / f"done-{n_images}-{n_shards}"
    if done.exists():
        return shards
    shards.mkdir(parents=True, exist_ok=True)
    photos = list(real_photos().values())
    real, members = [], []
    for r in range(4):
        path = out / f"real-{r}.tar"
        offsets = []
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for k in range(8):
                buf = io.BytesIO()
                Image.fromarray(photos[(8 * r + k) % len(photos)]).resize((96, 96)).save(buf, format="JPEG")
                info = tarfile.TarInfo(f"{k:09d}.jpg")
                info.size = len(buf.getvalue())
                tar.addfile(info, io.BytesIO(buf.getvalue()))
        with tarfile.open(path) as tar:  # member data offsets, as curation's index records them
            offsets = [(m.offset_data, m.size) for m in tar.getmembers()]
        real.append(path)
        members.append(np.asarray(offsets, dtype=np.int64))
    for f in shards.glob("part-*.tar"):
        f.unlink()
    names = [f"part-{i:06d}.tar" for i in range(n_shards)]
    for i, name in enumerate(names):
        os.link(real[i % 4], shards / name)
    per = n_images // n_shards
    path_idx = np.repeat(np.arange(n_shards, dtype=np.uint32), per)
    which = np.tile(np.arange(per) % 8, n_shards)
    real_of = path_idx % 4
    loc = np.stack([members[r] for r in range(4)])[real_of, which]  # (n, 2)
    blob = "".join(names).encode()
    start = np.zeros(n_shards + 1, dtype=np.int64)
    np.cumsum([len(n) for n in names], out=start[1:])
    stats = [os.stat(shards / n) for n in names]
    arrays = {"path_blob": np.frombuffer(blob, dtype=np.uint8), "path_start": start, "image_path": path_idx,
              "image_offset": loc[:, 0].copy(), "image_size": loc[:, 1].copy(),
              "shard_size": np.asarray([s.st_size for s in stats], dtype=np.int64),
              "shard_mtime_ns": np.asarray([s.st_mtime_ns for s in stats], dtype=np.int64)}
    write_index(str(shards / INDEX_NAME), {"kind": "tar", "root": None, "n_images": len(path_idx),
                                            "n_paths": n_shards}, arrays)
    done.write_text("ok")
    return shards


def measure(shards: str, cache: str, rank: int, world: int, batch: int) -> dict:
    """One rank's start: open the pool, first batch of epoch 0, first batch of epoch 1 (in this fresh process)."""
    import torch

    from dinopipe.data import pool_index
    from dinopipe.data.loader import DataPosition, build_train_loader

    base_rss = _status("VmRSS")
    counts = {"stat": 0, "open": 0}
    real_stat, real_open, real_osopen = os.stat, open, os.open

    def stat(*a, **k):  # the pool index's own stats (validation), not the source listing's (same either side)
        if sys._getframe(1).f_code.co_filename.endswith("pool_index.py"):
            counts["stat"] += 1
        return real_stat(*a, **k)

    def count_open(*a, **k):
        counts["open"] += 1
        return real_open(*a, **k)

    def count_osopen(*a, **k):
        counts["open"] += 1
        return real_osopen(*a, **k)

    os.stat = stat
    pool_index.os.stat = stat
    t0 = time.perf_counter()
    if hasattr(pool_index, "Ranks"):  # after: this rank's share of the validation, its own answer as the "all-reduce"
        pool = pool_index.open_pool([shards], cache_dir=cache,
                                    ranks=pool_index.Ranks(rank, world, lambda flag: flag, lambda: None))
    else:
        pool = pool_index.open_pool([shards], cache_dir=cache)
    t_open = time.perf_counter() - t0
    n_stat = counts["stat"]
    os.stat = pool_index.os.stat = real_stat

    def transform(img, seed=None):
        return {"x": torch.from_numpy(__import__("numpy").asarray(img.resize((32, 32)))).permute(2, 0, 1)}

    def collate(items, rng=None):
        return {"x": torch.stack([d["x"] for d in items])}

    def first(pos):
        loader = build_train_loader(pool, pool.read, transform, collate, batch, rank, world, 0, pos, num_workers=0)
        return next(iter(loader))

    import builtins

    builtins.open, os.open = count_open, count_osopen
    counts["open"] = 0
    b0 = first(DataPosition())
    opens = counts["open"]
    t_first = time.perf_counter() - t0
    t1 = time.perf_counter()
    first(DataPosition(1, 0))
    t_next = time.perf_counter() - t1
    builtins.open, os.open = real_open, real_osopen
    return {"open_s": round(t_open, 3), "first_batch_s": round(t_first, 3), "next_epoch_batch_s": round(t_next, 3),
            "stat_calls": n_stat, "file_opens_first_batch": opens, "images": len(pool), "batch": int(b0["n_images"]),
            "peak_rss_mb": round(_status("VmHWM") / 2**20, 1),
            "rss_growth_mb": round((_status("VmHWM") - base_rss) / 2**20, 1)}


def run_side(src: Path, shards: Path, cache: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import torch; "
            "from bench_pool_scale import measure; "
            "print(json.dumps(measure(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))))")
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "bench"), str(shards), str(cache), str(args.rank),
                        str(args.world), str(args.batch)], env=env, capture_output=True, text=True, cwd=str(src))
    if r.returncode:
        raise SystemExit(f"measurement failed ({src}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before-src", required=True, help="a checkout of the code to compare with (e.g. 253919c)")
    p.add_argument("--dir", default="/tmp/bench_pool_scale")
    p.add_argument("--images", type=int, default=10_000_000)
    p.add_argument("--shards", type=int, default=10_000)
    p.add_argument("--rank", type=int, default=3)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    sys.path[:0] = [str(ROOT)]
    out = Path(args.dir)
    t = time.perf_counter()
    shards = make_pool(out, args.images, args.shards)
    print(f"pool: {args.images:,} entries over {args.shards:,} shards ({time.perf_counter() - t:.1f} s to make); "
          f"rank {args.rank} of {args.world}, {args.batch} images per rank", flush=True)
    res = {}
    for side, src in (("before", Path(args.before_src)), ("after", ROOT)):
        res[side] = run_side(src, shards, out / f"cache-{side}", args)
        print(f"{side}: {json.dumps(res[side])}", flush=True)
    b, a = res["before"], res["after"]
    for key in ("open_s", "first_batch_s", "next_epoch_batch_s", "stat_calls", "file_opens_first_batch",
                "rss_growth_mb", "peak_rss_mb"):
        print(f"{key}: before/after = {b[key]} / {a[key]} = {b[key] / max(a[key], 1e-9):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
