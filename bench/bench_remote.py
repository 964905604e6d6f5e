"""Images per second per core reading the same webdataset shards from a loopback S3 server and from local disk,
and the cost of listing 10^5 shards.

    python bench/bench_remote.py [--images 256] [--list-shards 100000] [--out bench/results/remote.json]

The S3 server is moto's (``moto[server]``) in a separate process on 127.0.0.1, so its CPU is not the reader's.
Both sides go through the training pool (:func:`dinopipe.data.pool_index.open_pool`): local shards by
``os.pread``, the bucket by one ranged GET per image (``If-Match`` on the listed ETag). Measured in one process,
one thread, the pool's images in a random order:

* read only: bytes of every image;
* S3 through each reader, passes interleaved: obstore (``s3``, the default when installed), s3fs (``s3_s3fs``)
  and AWS's CRT client (``s3_crt``, ``DINOPIPE_S3_READER=crt``, when s3torchconnectorclient is installed);
* ``local_wait``: local reads each followed by an idle wait (``--control-wait-ms``, ~ one loopback GET): what
  blocking alone costs a core on this box, without any client;
* read + decode + crops: the training sample (``ImagePoolDataset``: safe decode with draft, DINOv2 multi-crop
  2 x 224 + 8 x 98).

"per core" = images / CPU seconds of the reading process (wall-clock rates are printed too). Listing: the paged
ListObjectsV2 of ``--list-shards`` tiny objects into the compact listing arrays; wall time, requests, and the
bytes the listing keeps per shard (tracemalloc, the client's warm-up excluded). Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import sys
import tarfile
import tempfile
import time
import tracemalloc

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _serve(conn, n_tiny: int) -> None:
    """The server process: moto on a free loopback port, ``n_tiny`` 1 KB shards planted in its store."""
    import logging

    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    backend.create_bucket("bench", "us-east-1")
    for i in range(n_tiny):
        backend.put_object("bench", f"many/shard-{i:06d}.tar", b"\0" * 1024)
    conn.send(server.get_host_and_port())
    conn.recv()  # until the bench is done
    server.stop()


def write_shards(root: str, n_images: int, per_shard: int = 32) -> list[str]:
    """Real photos (skimage / sklearn, offline) re-encoded as 500 x 375 JPEG, cycled to ``n_images``."""
    from PIL import Image

    from dinopipe.data.samples import real_photos

    photos = [Image.fromarray(a).convert("RGB").resize((500, 375)) for _, a in sorted(real_photos().items())]
    blobs = []
    for p in photos:
        b = io.BytesIO()
        p.save(b, format="JPEG", quality=90)
        blobs.append(b.getvalue())
    os.makedirs(root, exist_ok=True)
    paths = []
    for s in range(0, n_images, per_shard):
        path = os.path.join(root, f"shard-{s // per_shard:06d}.tar")
        with tarfile.open(path, "w") as tar:
            for k in range(s, min(s + per_shard, n_images)):
                data = blobs[k % len(blobs)]
                info = tarfile.TarInfo(f"{k:08d}.jpg")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def _rate(fn, n: int) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"images": n, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "images_per_s_wall": round(n / wall, 1),
            "images_per_cpu_s": round(n / cpu, 1)}


class _Waiting:
    """The local pool, each read followed by an idle wait: the control for what blocking alone costs a core here
    (on a loaded 2-core box the CPU that resumes after a wait finds its caches cold: decode gets slower)."""

    def __init__(self, pool, wait_s: float) -> None:
        self.pool, self.wait_s = pool, wait_s

    def __len__(self) -> int:
        return len(self.pool)

    def __getitem__(self, i):
        return self.pool[i]

    def read(self, loc) -> bytes:
        data = self.pool.read(loc)
        time.sleep(self.wait_s)
        return data


def measure_reads(pool, order) -> dict:
    def run():
        for i in order:
            assert pool.read(pool[int(i)])

    return _rate(run, len(order))


def measure_train(pool, order) -> dict:
    from dinopipe.data.loader import ImagePoolDataset
    from dinopipe.data.transforms import MultiCropAugmentation

    ds = ImagePoolDataset(pool, pool.read, MultiCropAugmentation(), seed=0)

    def run():
        for i in order:
            assert isinstance(ds[(int(i), 0)], dict)

    return _rate(run, len(order))


def measure_listing(url: str, n: int) -> dict:
    from dinopipe.utils import storage

    storage.list_prefix(url + "-warm-up")  # the client's session and service model are not the listing's
    tracemalloc.start()
    t = time.perf_counter()
    listing = storage.list_prefix(url, recursive=False, suffixes=(".tar",))
    wall = time.perf_counter() - t
    arrays = listing.arrays()
    del listing
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(arrays["size"]) == n, len(arrays["size"])
    return {"shards": n, "wall_s": round(wall, 2), "pages": -(-n // 1000),
            "array_bytes_per_shard": round(sum(a.nbytes for a in arrays.values()) / n, 1),
            "kept_bytes_per_shard": round(kept / n, 1), "peak_bytes_while_listing": peak}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--list-shards", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=5,
                   help="passes over the pool per side, interleaved; the best pass and the median are reported")
    p.add_argument("--control-wait-ms", type=float, default=4.0,
                   help="the local_wait control: local reads + this idle wait per image (0: off)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    parent, child = mp.Pipe()
    server = mp.get_context("spawn").Process(target=_serve, args=(child, args.list_shards), daemon=True)
    server.start()
    host, port = parent.recv()
    os.environ["AWS_ENDPOINT_URL_S3"] = f"http://{host}:{port}"
    from dinopipe.data.pool_index import open_pool
    from dinopipe.utils import storage

    try:
        with tempfile.TemporaryDirectory() as tmp:
            local_dir = os.path.join(tmp, "shards")
            paths = write_shards(local_dir, args.images)
            fs, _ = storage.filesystem("s3://bench")
            for path in paths:
                fs.put_file(path, f"bench/shards/{os.path.basename(path)}")
            local = open_pool([local_dir], os.path.join(tmp, "idx-local"))
            t = time.perf_counter()
            remote = open_pool(["s3://bench/shards"], os.path.join(tmp, "idx-s3"))
            index_s = time.perf_counter() - t
            order = np.random.default_rng(0).permutation(len(local))
            out = {"images": len(local), "shards": len(paths), "index_build_s3_s": round(index_s, 2)}
            sides = [("local", local, "s3fs")]
            if args.control_wait_ms > 0:  # local reads + an idle wait per image, as long as a loopback GET's
                sides.append(("local_wait", _Waiting(local, args.control_wait_ms / 1e3), "s3fs"))
            if _has("obstore"):
                sides.append(("s3", remote, "obstore"))  # the default reader when obstore is installed
            sides.append(("s3_s3fs", remote, "s3fs"))
            if _has("s3torchconnectorclient"):
                sides.append(("s3_crt", remote, "crt"))  # DINOPIPE_S3_READER=crt: AWS's CRT client
            for name, fn in (("read", measure_reads), ("read_decode_crops", measure_train)):
                runs: dict = {side: [] for side, _, _ in sides}
                for _ in range(args.repeat):  # interleaved passes: a load spike on this shared box hits every side
                    for side, pool, reader in sides:
                        os.environ["DINOPIPE_S3_READER"] = reader
                        runs[side].append(fn(pool, order))
                for side, _, _ in sides:
                    out[f"{name}_{side}"] = max(runs[side], key=lambda r: r["images_per_cpu_s"])
                    out[f"{name}_{side}"]["images_per_cpu_s_median"] = float(
                        np.median([r["images_per_cpu_s"] for r in runs[side]]))
                for side, _, reader in sides[1:]:
                    out[f"{name}_{side}"]["reader"] = reader
                    out[f"{name}_{side}_over_local_per_cpu"] = round(
                        out[f"{name}_{side}"]["images_per_cpu_s"] / out[f"{name}_local"]["images_per_cpu_s"], 3)
                    out[f"{name}_{side}_over_local_per_cpu_median"] = round(
                        out[f"{name}_{side}"]["images_per_cpu_s_median"]
                        / out[f"{name}_local"]["images_per_cpu_s_median"], 3)
                    out[f"{name}_{side}_over_local_wall"] = round(
                        out[f"{name}_{side}"]["images_per_s_wall"] / out[f"{name}_local"]["images_per_s_wall"], 3)
            os.environ.pop("DINOPIPE_S3_READER", None)
            out["retries"] = storage.take_counts()
        if args.list_shards:
            out["listing"] = measure_listing("s3://bench/many", args.list_shards)
    finally:
        parent.send("stop")
        server.join(timeout=30)
    out["cpu"] = _cpu_name()
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
