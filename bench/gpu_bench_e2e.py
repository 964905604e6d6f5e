"""The end-to-end case of ``bench/gpu_bench.py``: dinopipe's training loader (``train.highres.phase_loader``,
the loader the trainer builds: pool index over uncompressed webdataset tar shards, decode, MultiCropAugmentation,
collate, pinned) feeding the same step as the bare case, with the machine's cores as data workers.

The shards hold real photos (scikit-image's sample images, each a random crop / flip re-encoded as a 500x375
JPEG at quality 90, as the issue's input measurements), or, when scikit-image is missing, smooth synthetic
images (the JSON says which)."""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

import numpy as np
import torch

PHOTOS = ["astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "retina", "cat"]


def _sources(rng: np.random.Generator) -> tuple[list[np.ndarray], str]:
    try:
        from skimage import data as skd

        out = []
        for name in PHOTOS:
            try:
                img = np.asarray(getattr(skd, name)())
            except Exception:  # a sample missing from this scikit-image
                continue
            if img.ndim == 2:
                img = np.repeat(img[..., None], 3, axis=2)
            out.append(np.ascontiguousarray(img[..., :3]).astype(np.uint8))
        if out:
            return out, "scikit-image sample photos"
    except ImportError:
        pass
    yy, xx = np.mgrid[0:600, 0:800] / 100.0
    return [np.stack([(np.sin(xx * (i + 1) + yy) * 127 + 128), (np.cos(yy * (i + 2)) * 127 + 128),
                      ((xx + yy) * 20 % 255)], axis=2).astype(np.uint8) for i in range(4)], "synthetic (no scikit-image)"


def write_jpeg_shards(folder: Path, n_images: int, n_shards: int, size=(500, 375), seed: int = 0) -> dict:
    """``n_images`` distinct JPEGs (random crops / flips of the source photos, resized to ``size``) in
    ``n_shards`` uncompressed tar shards ``{key}.jpg``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    srcs, kind = _sources(rng)
    folder.mkdir(parents=True, exist_ok=True)
    nbytes = 0
    per = -(-n_images // n_shards)
    for s in range(n_shards):
        with tarfile.open(folder / f"shard-{s:04d}.tar", "w") as tar:
            for i in range(s * per, min(n_images, (s + 1) * per)):
                src = srcs[i % len(srcs)]
                h, w = src.shape[:2]
                ch, cw = int(h * rng.uniform(0.6, 1.0)), int(w * rng.uniform(0.6, 1.0))
                y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
                crop = src[y:y + ch, x:x + cw]
                if rng.random() < 0.5:
                    crop = crop[:, ::-1]
                im = Image.fromarray(np.ascontiguousarray(crop)).resize(size, Image.BICUBIC)
                buf = io.BytesIO()
                im.save(buf, format="JPEG", quality=90)
                data = buf.getvalue()
                info = tarfile.TarInfo(f"{i:08d}.jpg")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                nbytes += len(data)
    return {"images": n_images, "shards": n_shards, "size": list(size), "source": kind,
            "mean_jpeg_kib": nbytes / n_images / 1024}


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run_e2e(dcfg, info, dev: torch.device, build, step_fn, folder: Path, workers: int, steps: int,
            deadline: float, sync) -> dict:
    """``build(dcfg) -> (task, opt, values)``; ``step_fn(task, opt, batch, values)``. Loader alone, then loader +
    step: images/s over ``steps`` batches after 2 warm-up ones (one sync at the end, as a training loop)."""
    from dinopipe.data.loader import DataPosition
    from dinopipe.data.pool_index import Ranks
    from dinopipe.data.pool_index import open_pool as open_indexed_pool
    from dinopipe.train.highres import phase_loader

    ph = dcfg.phases[0]
    b = ph.batch_size_per_gpu
    dcfg.data.num_workers = workers
    res: dict = {"workers": workers, "machine_cores": cores(), "batch": b}
    t0 = time.perf_counter()
    res["shards"] = write_jpeg_shards(folder / "shards", n_images=b * (steps + 3), n_shards=max(1, min(8, workers)))
    res["write_shards_s"] = time.perf_counter() - t0
    pool = open_indexed_pool([str(folder / "shards")], cache_dir=str(folder / "pool_index"), ranks=Ranks())
    task, opt, values = build(dcfg)
    make_loader = phase_loader(dcfg, ph, info, pool, pool.read, task.data_patch_size)

    def timed(with_step: bool, make=make_loader) -> tuple[float, int]:
        it = iter(make(DataPosition()))
        for _ in range(2):  # workers up, compile done
            batch = next(it)
            if with_step:
                step_fn(task, opt, batch, values)
        sync()
        t, n = time.perf_counter(), 0
        for batch in it:
            if with_step:
                step_fn(task, opt, batch, values)
            n += 1
            if n >= steps or time.monotonic() > deadline:
                break
        sync()
        dt = time.perf_counter() - t
        del it
        return dt, n

    dt, n = timed(False)
    res["loader_only_images_per_s"] = n * b / dt
    res["loader_only_images_per_s_per_core"] = res["loader_only_images_per_s"] / max(workers, 1)
    if workers > 4:  # the goal: <= 4 CPU cores per GPU
        dcfg.data.num_workers = 4
        dt, n = timed(False, phase_loader(dcfg, ph, info, pool, pool.read, task.data_patch_size))
        res["loader_only_4_workers_images_per_s"] = n * b / dt
        dcfg.data.num_workers = workers
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    dt, n = timed(True)
    res.update(steps=n, images_per_s=n * b / dt, step_s=dt / n)
    if dev.type == "cuda":
        res["peak_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return res
