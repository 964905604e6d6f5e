"""Fixtures of the object-storage tests: one loopback S3 server (moto behind a fault proxy) per session, fake
credentials holding a planted secret, and a pool of real photos as webdataset shards both on disk and in a bucket."""

from __future__ import annotations

import contextlib
import io
import os
import tarfile

import pytest

# Fake credentials. The secret is planted: no log, config, run folder or error message may ever contain it.
PLANTED_SECRET = "planted-S3CR3T-2f9c41d7e5b8a6"
BUCKET = "pool"


@contextlib.contextmanager
def s3_server(bucket: str, **extra_env: str):
    """A loopback S3 server (moto behind the fault proxy) with a bucket, the planted credentials and ``extra_env`` in
    os.environ for the duration; the environment is restored after."""
    pytest.importorskip("moto.server", reason="moto[server] is a dev dependency: pip install -e '.[cpu,dev]'")
    pytest.importorskip("s3fs", reason="s3fs is in the [s3] extra")
    from tests.storage._s3 import S3Server

    env = {"AWS_ACCESS_KEY_ID": "AKIDPLANTEDTEST", "AWS_SECRET_ACCESS_KEY": PLANTED_SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "DINOPIPE_STORAGE_BACKOFF_CAP_S": "0.05", **extra_env}
    saved = {k: os.environ.get(k) for k in [*env, "AWS_ENDPOINT_URL_S3", "DINOPIPE_S3_READER"]}
    os.environ.update(env)
    server = S3Server()
    os.environ["AWS_ENDPOINT_URL_S3"] = server.endpoint
    server.client().mkdir(bucket)
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3():
    with s3_server(BUCKET) as server:
        yield server


def make_shards(root: str, per_shard: int = 4) -> list[str]:
    """Real photos (JPEG) as webdataset shards ``root/shard-NNNNNN.tar`` (``<key>.jpg`` + ``<key>.json``)."""
    from tests._photos import real_photos
    from dinopipe.data.samples import encode

    os.makedirs(root, exist_ok=True)
    items = sorted(real_photos().items())
    paths = []
    for s in range(0, len(items), per_shard):
        path = os.path.join(root, f"shard-{s // per_shard:06d}.tar")
        with tarfile.open(path, "w") as tar:
            for name, arr in items[s:s + per_shard]:
                for member, data in ((f"{name}.jpg", encode(arr, quality=90)), (f"{name}.json", b"{}")):
                    info = tarfile.TarInfo(member)
                    info.size, info.mtime = len(data), 0
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


@pytest.fixture(scope="session")
def shards(s3, tmp_path_factory):
    """(local shard folder, the same shards' URL prefix in the bucket)."""
    root = tmp_path_factory.mktemp("local") / "shards"
    paths = make_shards(str(root))
    client = s3.client()
    for p in paths:
        client.put_file(p, f"{BUCKET}/shards/{os.path.basename(p)}")
    return root, f"s3://{BUCKET}/shards"


def upload(s3, local_dir: str, prefix: str) -> str:
    """Copy every shard of ``local_dir`` to ``s3://pool/<prefix>`` (straight to moto) and return its URL."""
    client = s3.client()
    for fn in sorted(os.listdir(local_dir)):
        client.put_file(os.path.join(local_dir, fn), f"{BUCKET}/{prefix}/{fn}")
    return f"s3://{BUCKET}/{prefix}"
