"""Training pools in a bucket: the same bytes and batches as on disk, and every injected fault loses nothing.

All against moto's S3 server on 127.0.0.1 behind a fault proxy (tests/storage/_s3.py); shards of real photos."""

from __future__ import annotations

import collections
import os
import shutil

import pytest
import torch

from dinopipe.utils import s3_readers
from tests.storage.conftest import upload

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(params=["obstore", "s3fs"])
def reader(request, monkeypatch):
    """Each fault test runs through both s3:// readers: obstore (the default when installed) and s3fs."""
    if request.param == "obstore":
        pytest.importorskip("obstore", reason="obstore is in the [s3] extra")
    monkeypatch.setenv("DINOPIPE_S3_READER", request.param)
    return request.param


def _pool(paths, cache_dir):
    from dinopipe.data.pool_index import open_pool

    return open_pool([str(p) for p in paths], str(cache_dir))


class _Keys:
    """A transform that keeps what identifies a sample: its (epoch, index) and the hash of its decoded pixels."""

    def __call__(self, img, seed):
        return {"px": hash(img.tobytes())}


def _collate(items, rng=None):
    return {"keys": [x["key"] for x in items], "px": [x["px"] for x in items]}


def _epoch(pool, batch=4, workers=0):
    """One epoch of the training loader over ``pool``: (keys delivered, pixel hashes, corrupt counts, io counts)."""
    from dinopipe.data.loader import DataPosition, build_train_loader

    loader = build_train_loader(pool, pool.read, _Keys(), _collate, batch, 0, 1, 3, DataPosition(),
                                num_workers=workers)
    keys, px, corrupt, io = [], [], collections.Counter(), collections.Counter()
    for _, b in zip(range(len(pool) // batch), loader):  # epoch 0 exactly (the remainder is dropped)
        keys += b.get("keys", [])
        px += b.get("px", [])
        corrupt.update(b["corrupt"])
        io.update(b.get("io", {}))
    return keys, px, corrupt, io


def test_pool_from_a_bucket_gives_the_local_pools_bytes_and_batches(shards, tmp_path):
    """data.paths=s3://... : same images, same order, and the training crops of the first batches are identical."""
    from dinopipe.data.loader import DataPosition, build_train_loader
    from dinopipe.data.transforms import MultiCropAugmentation, MultiCropCollator

    local_dir, url = shards
    local, remote = _pool([local_dir], tmp_path / "a"), _pool([url], tmp_path / "b")
    assert len(local) == len(remote) > 8
    for i in range(len(local)):
        assert remote.read(remote[i]) == local.read(local[i]), i
    assert remote.parts[0].header["remote"] and remote.parts[0].nbytes_per_image() < 64

    def batches(pool, workers):
        aug = MultiCropAugmentation(global_size=56, local_size=28, n_local=2)
        loader = build_train_loader(pool, pool.read, aug, MultiCropCollator(14), 4, 0, 1, 7, DataPosition(),
                                    num_workers=workers)
        it = iter(loader)
        return [next(it) for _ in range(3)]

    torch.set_num_threads(1)
    # the reads above may have been retried (a loaded machine times out a request): their counts ride along with the
    # next batch this process makes ("io"), which is not image data; start the comparison from zero
    from dinopipe.utils import storage
    storage.take_counts()
    for a, b in zip(batches(local, 0), batches(remote, 2)):  # the bucket through forked DataLoader workers
        assert a.keys() - {"io"} == b.keys() - {"io"}
        for k in a:
            if torch.is_tensor(a[k]):
                assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("fault,kind", [("slowdown", "throttled"), ("internal", "server_error"),
                                        ("drop", "connection")])
def test_a_transient_fault_is_retried_counted_and_loses_nothing(s3, shards, tmp_path, fault, kind, reader):
    """Throttling (503 SlowDown), a 500, a connection dropped mid-object: each sample exactly once, as local."""
    local_dir, url = shards
    local, remote = _pool([local_dir], tmp_path / "a"), _pool([url], tmp_path / "b")
    want = _epoch(local)
    s3.arm(fault, "shard-000001.tar", times=3)
    s3.arm(fault, "shard-000004.tar", times=2)
    got = _epoch(remote)
    fired = s3.disarm()
    assert fired == {fault: 5}
    assert got[0] == want[0] and got[1] == want[1]  # the same samples, in the same order, each once
    assert len(set(got[0])) == len(got[0]) and not got[2]  # no duplicate, nothing unreadable
    assert got[3] == {f"retry/{kind}": 5}  # every retry counted, by kind
    assert s3_readers.reader_name() == reader  # ... by the reader under test (obstore's own retries are off)


def test_an_object_deleted_after_listing_is_counted_missing(s3, shards, tmp_path, reader):
    local_dir, _ = shards
    url = upload(s3, str(local_dir), "deleted")
    remote = _pool([url], tmp_path / "b")
    n_gone = sum(1 for i in range(len(remote)) if remote[i].path.endswith("shard-000002.tar"))
    s3.client().rm("pool/deleted/shard-000002.tar")
    keys, _, corrupt, _ = _epoch(remote)
    assert corrupt == {"missing": n_gone}
    assert len(keys) == len(set(keys)) == len(remote) // 4 * 4 - n_gone  # the rest delivered, each once


def test_an_object_replaced_after_listing_is_caught_by_its_etag(s3, shards, tmp_path, reader):
    """A shard rewritten mid-run (same name, other bytes) is refused by If-Match, never mixed into batches."""
    local_dir, _ = shards
    url = upload(s3, str(local_dir), "replaced")
    remote = _pool([url], tmp_path / "b")
    victim = os.path.join(str(local_dir), "shard-000003.tar")
    n_changed = sum(1 for i in range(len(remote)) if remote[i].path.endswith("shard-000003.tar"))
    s3.client().pipe_file("pool/replaced/shard-000003.tar", open(victim, "rb").read()[::-1])  # same size
    keys, _, corrupt, _ = _epoch(remote)
    assert corrupt == {"changed": n_changed}
    assert len(keys) == len(set(keys)) == len(remote) // 4 * 4 - n_changed


def test_a_truncated_object_keeps_the_images_before_the_cut(s3, shards, tmp_path, reader):
    """A shard cut short in the bucket: the members before the cut train, the damage is one counted sample."""
    local_dir, _ = shards
    cut = tmp_path / "cut"
    shutil.copytree(local_dir, cut)
    whole = (cut / "shard-000005.tar").read_bytes()
    (cut / "shard-000005.tar").write_bytes(whole[: len(whole) // 2])
    url = upload(s3, str(cut), "truncated")
    local, remote = _pool([cut], tmp_path / "a"), _pool([url], tmp_path / "b")
    in_shard = [remote[i] for i in range(len(remote)) if remote[i].path.endswith("shard-000005.tar")]
    assert [loc.offset < 0 for loc in in_shard].count(True) == 1  # one placeholder for what the cut hid
    assert 0 < len(in_shard) - 1 < 4
    want, got = _epoch(local, batch=2), _epoch(remote, batch=2)
    assert got[:3] == want[:3]  # the same images, the same losses counted by the same reasons as on disk
    assert sum(got[2].values()) >= 1 and len(got[0]) == len(set(got[0]))


def test_a_stale_index_is_rebuilt_when_the_bucket_changes(s3, shards, tmp_path):
    """The run directory's index is re-validated against a fresh listing (sizes, ETags) on every open."""
    local_dir, _ = shards
    url = upload(s3, str(local_dir), "stale")
    first = _pool([url], tmp_path / "idx")
    assert _pool([url], tmp_path / "idx").parts[0].path == first.parts[0].path  # a rerun maps the same file
    s3.client().rm("pool/stale/shard-000000.tar")
    again = _pool([url], tmp_path / "idx")
    assert len(again) == len(first) - 4 and not any(again[i].path.endswith("shard-000000.tar")
                                                    for i in range(len(again)))


def test_any_fsspec_protocol_goes_through_the_generic_layer(tmp_path):
    """memory:// (fsspec's generic listing and reads, no ETag: checked by size): the local pool's bytes, in order.
    GCS (gs://) and the other protocols take this same path; only S3 is tested against a real server."""
    import fsspec

    from tests.storage.conftest import make_shards

    paths = make_shards(str(tmp_path / "shards"))
    mem = fsspec.filesystem("memory")
    for p in paths:
        mem.pipe_file(f"/generic/shards/{os.path.basename(p)}", open(p, "rb").read())
    local, remote = _pool([tmp_path / "shards"], tmp_path / "a"), _pool(["memory://generic/shards"], tmp_path / "b")
    assert len(local) == len(remote)
    assert [remote.read(remote[i]) for i in range(len(remote))] == [local.read(local[i]) for i in range(len(local))]
    assert _epoch(remote)[:3] == _epoch(local)[:3]
    mem.rm("/generic/shards/shard-000001.tar")  # deleted after listing: counted, not fatal
    assert _epoch(remote)[2] == {"missing": sum(1 for i in range(len(remote))
                                                if remote[i].path.endswith("shard-000001.tar"))}


def test_the_crt_reader_reads_the_same_bytes(s3, shards, tmp_path, monkeypatch):
    """DINOPIPE_S3_READER=crt (s3torchconnectorclient, the [s3-crt] extra): the same images; a deleted object is
    still counted as missing (its own retries are not counted, and it has no If-Match: docs/storage.md)."""
    pytest.importorskip("s3torchconnectorclient")
    monkeypatch.setenv("DINOPIPE_S3_READER", "crt")
    local_dir, _ = shards
    url = upload(s3, str(local_dir), "crt")
    local, remote = _pool([local_dir], tmp_path / "a"), _pool([url], tmp_path / "b")
    assert [remote.read(remote[i]) for i in range(len(remote))] == [local.read(local[i]) for i in range(len(local))]
    s3.client().rm("pool/crt/shard-000002.tar")
    n_gone = sum(1 for i in range(len(remote)) if remote[i].path.endswith("shard-000002.tar"))
    keys, _, corrupt, _ = _epoch(remote)
    assert corrupt == {"missing": n_gone} and len(keys) == len(set(keys)) == len(remote) // 4 * 4 - n_gone


def test_webdataset_streams_bucket_shards_through_fsspec(s3, shards):
    """webdataset's own reader on s3:// URLs, through the registered fsspec opener (no `aws s3 cp` pipe)."""
    import webdataset as wds

    from dinopipe.utils import storage

    storage.register_webdataset_openers()
    local_dir, url = shards
    names = sorted(os.listdir(local_dir))[:2]

    def samples(urls):
        return [(s["__key__"], s["jpg"]) for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False)]

    got = samples([f"{url}/{n}" for n in names])
    assert got and got == samples([str(local_dir / n) for n in names])


def test_a_file_list_of_urls_reads_each_object(s3, tmp_path):
    """input.paths=[list.txt] whose lines are s3:// URLs: one whole-object GET each; a missing one is unreadable."""
    from dinopipe.data.sources import FileListSource

    client = s3.client()
    client.pipe_file("pool/listed/a.jpg", b"\xff\xd8first")
    client.pipe_file("pool/listed/b.jpg", b"\xff\xd8second")
    lst = tmp_path / "urls.txt"
    lst.write_text("s3://pool/listed/a.jpg\ns3://pool/listed/b.jpg\ns3://pool/listed/gone.jpg\n")
    src = FileListSource(lst)
    got = {r.id.rsplit("/", 1)[-1]: src.read(r) for r in src.refs()}
    assert got == {"a.jpg": b"\xff\xd8first", "b.jpg": b"\xff\xd8second", "gone.jpg": None}
    pool = _pool([lst], tmp_path / "idx")  # the training pool of the same list: the same objects, by URL
    assert sorted(pool.read(pool[i]) for i in range(2)) == [b"\xff\xd8first", b"\xff\xd8second"]


def test_a_bucket_folders_tasks_list_only_their_own_images(s3, tmp_path):
    """A bucket prefix of images read by W curation tasks: each task streams the listing and keeps only the images
    whose ids hash to it, as arrays (the same ids, in the same order, as the same folder on disk gives that task);
    no task builds the whole listing, and every kept ref reads its object."""
    from dinopipe.data.reflist import PathRefs
    from dinopipe.data.sources import FolderSource, RemoteSource

    local = tmp_path / "tasks"
    client = s3.client()
    for i in range(45):
        rel = f"{'sub/' if i % 3 else ''}{'deep/' if i % 5 == 0 else ''}img{i:03d}.{'JPG' if i % 7 == 0 else 'jpg'}"
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(b"\xff\xd8" + bytes([i]))
        client.pipe_file(f"pool/tasks/{rel}", b"\xff\xd8" + bytes([i]))
    client.pipe_file("pool/tasks/notes.txt", b"not an image")
    src, disk = RemoteSource("s3://pool/tasks"), FolderSource(local)
    assert src.kind == "folder" and "listing" not in vars(src)  # opened by its first image, not listed whole
    seen = []
    for w in (1, 3):
        for t in range(w):
            got = src.ref_seq(t, w)
            assert isinstance(got, PathRefs)
            assert [r.id for r in got] == [r.id for r in disk.ref_seq(t, w)], (t, w)
            seen += [r.id for r in got] if w == 3 else []
            assert all(src.read(r) == (local / r.id.split("/", 1)[1]).read_bytes() for r in got)
    assert sorted(seen) == sorted(r.id for r in disk.refs()) and len(seen) == 45  # a partition
    assert "listing" not in vars(src)  # no task held the whole listing
    assert len(src) == 45 and [r.id for r in src.refs()] == [r.id for r in disk.refs()]  # listed when asked
