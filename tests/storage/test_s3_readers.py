"""The s3:// ranged readers (dinopipe/utils/s3_readers.py): obstore by default, s3fs as the fallback, the same
bytes either way; obstore is never touched in a process forked after its runtime started (tokio's threads do not
survive fork: it would hang)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from dinopipe.utils import s3_readers, storage

obstore = pytest.importorskip("obstore", reason="obstore is in the [s3] extra")


@pytest.fixture
def obj(s3):
    data = bytes(range(256)) * 1000
    s3.client().pipe_file("pool/readers/obj.bin", data)
    info = s3.client().info("pool/readers/obj.bin")
    return "s3://pool/readers/obj.bin", data, info["ETag"]


def _reads(url, data, etag):
    n = len(data)
    return [storage.read_range(url, 1000, 60_000, etag=etag, object_size=n),
            storage.read_range(url, n - 10, 10, etag=etag, object_size=n),
            storage.read_range(url, 0, -1, etag=etag, object_size=n),
            storage.read_range(url, 0, -1)]


def test_obstore_is_the_default_and_reads_what_s3fs_reads(obj, monkeypatch):
    url, data, etag = obj
    monkeypatch.delenv("DINOPIPE_S3_READER", raising=False)
    assert s3_readers.reader_name() == "obstore"
    fast = _reads(url, data, etag)
    monkeypatch.setenv("DINOPIPE_S3_READER", "s3fs")
    assert s3_readers.reader_name() == "s3fs"
    assert fast == _reads(url, data, etag) == [data[1000:61_000], data[-10:], data, data]


def test_a_stale_etag_is_refused_as_changed_by_obstore(obj, monkeypatch):
    url, data, _ = obj
    monkeypatch.setenv("DINOPIPE_S3_READER", "obstore")
    with pytest.raises(storage.Unreadable) as e:
        storage.read_range(url, 0, 100, etag='"00000000000000000000000000000000"', object_size=len(data))
    assert e.value.reason == storage.CHANGED


def _child(url, n, etag, q):
    q.put((s3_readers.reader_name(), storage.read_range(url, 5, 100, etag=etag, object_size=n)))


def test_a_process_forked_after_obstore_started_reads_through_s3fs(obj, monkeypatch):
    """A DataLoader worker forked from a process that already read through obstore: s3fs serves it, same bytes."""
    url, data, etag = obj
    monkeypatch.delenv("DINOPIPE_S3_READER", raising=False)
    storage.read_range(url, 0, 10, etag=etag, object_size=len(data))  # this process has started obstore
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(url, len(data), etag, q))
    p.start()
    got = q.get(timeout=120)
    p.join(timeout=60)
    assert got == ("s3fs", data[5:105]) and p.exitcode == 0


def test_profile_credentials_fall_back_to_s3fs_and_a_bad_choice_is_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv("DINOPIPE_S3_READER", raising=False)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.setenv("AWS_PROFILE", "research")  # object_store does not read profiles; botocore does
    assert s3_readers.reader_name() == "s3fs"
    monkeypatch.setenv("DINOPIPE_S3_READER", "boto")
    with pytest.raises(ValueError, match="DINOPIPE_S3_READER must be obstore, s3fs or crt"):
        s3_readers.reader_name()


_WORKERS = """
import json, os, sys
from dinopipe.data.loader import DataPosition, build_train_loader
from dinopipe.data.pool_index import open_pool
from dinopipe.utils import s3_readers

class Reader:
    def __call__(self, img, seed):
        return {"reader": s3_readers.reader_name(), "pid": os.getpid()}

def collate(items, rng=None):
    return {"seen": [(x["reader"], x["pid"]) for x in items]}

pool = open_pool([sys.argv[1]], sys.argv[2])
it = iter(build_train_loader(pool, pool.read, Reader(), collate, 4, 0, 1, 3, DataPosition(), num_workers=2))
seen = {tuple(s) for _ in range(3) for s in next(it)["seen"]}
print(json.dumps({"workers": sorted(seen), "main_used_obstore": s3_readers._obstore["pid"] is not None}))
"""


def test_training_workers_read_through_obstore(shards, tmp_path):
    """A fresh training process (index build, then forked DataLoader workers): the main process never starts
    obstore, so every worker reads through it (the fast path is the one training takes)."""
    import json
    import os
    import subprocess
    import sys

    _, url = shards
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("DINOPIPE_S3_READER", None)
    out = subprocess.run([sys.executable, "-c", _WORKERS, url, str(tmp_path / "idx")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not got["main_used_obstore"]
    assert {r for r, _ in got["workers"]} == {"obstore"} and len({p for _, p in got["workers"]}) == 2
