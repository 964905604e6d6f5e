"""Resumable, task-split embedding into fp16 shards; unreadable files are recorded with reasons."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from tests._photos import bad_file_kinds

from curation.embed.descriptor import PCADescriptor
from curation.config import DescriptorConfig
from curation.embed.embeddings import embed_pool
from curation.core.embstore import open_embeddings


class Counting:
    """Wraps an embed_fn; counts images embedded and can fail after a number of batches."""

    def __init__(self, fn, fail_after_batches=None):
        self.fn, self.fail_after, self.images, self.batches = fn, fail_after_batches, 0, 0

    def __call__(self, batch):
        if self.fail_after is not None and self.batches >= self.fail_after:
            raise KeyboardInterrupt("simulated preemption")
        self.batches += 1
        self.images += len(batch)
        return self.fn(batch)


@pytest.fixture(scope="module")
def pool_with_bad(pool_dir, photos, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad") / "pool"
    shutil.copytree(pool_dir[0], root)
    for name, (data, _) in bad_file_kinds(photos["chelsea"]).items():
        (root / "bad" / name).parent.mkdir(exist_ok=True)
        (root / "bad" / name).write_bytes(data)
    return root


def _embed(src, out, fn, **kw):
    desc = PCADescriptor()
    kw = {"shard_size": 16, "batch_size": 8, "num_workers": 0, "progress": False, **kw}
    return embed_pool(src, fn, str(out), transform=desc.transform(), **kw)


def test_interrupted_embed_resumes_without_recomputing(pool_with_bad, tmp_path):
    desc = PCADescriptor()
    full = _embed(pool_with_bad, tmp_path / "full", Counting(desc))
    first = Counting(desc, fail_after_batches=5)  # dies inside the third shard
    with pytest.raises(KeyboardInterrupt):
        _embed(pool_with_bad, tmp_path / "resumed", first)
    done = sorted(f for f in os.listdir(tmp_path / "resumed") if f.endswith(".ids.json"))
    assert len(done) == 2  # shards 0 and 1 (16 + 16 images) were complete
    second = Counting(desc)
    counts = _embed(pool_with_bad, tmp_path / "resumed", second)
    assert counts["shards_skipped"] == 2
    a, b = open_embeddings(str(tmp_path / "full")), open_embeddings(str(tmp_path / "resumed"))
    assert full["images"] == len(a) + len(a.unreadable)
    assert second.images == len(a) - a.offsets[2]  # only images of shards 2, 3, ... were embedded
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.rows(np.arange(len(a))), b.rows(np.arange(len(b))))
    assert a.hashes.tolist() == b.hashes.tolist() and a.unreadable == b.unreadable
    third = Counting(desc)
    _embed(pool_with_bad, tmp_path / "resumed", third)
    assert third.images == 0  # a complete run recomputes nothing


def test_unreadable_files_are_recorded_with_reasons(pool_with_bad, tmp_path, photos):
    _embed(pool_with_bad, tmp_path / "e", PCADescriptor())
    emb = open_embeddings(str(tmp_path / "e"))
    got = {u[0].split("/")[-1]: u[2] for u in emb.unreadable}
    expected = {name: reason for name, (_, reason) in bad_file_kinds(photos["chelsea"]).items()}
    assert got == expected
    assert emb.dim == PCADescriptor().dim and emb.parts[0].dtype == np.float16
    np.testing.assert_allclose(np.linalg.norm(emb.rows(np.arange(len(emb))), axis=1), 1, atol=2e-3)


def test_array_tasks_split_the_pool_and_the_reader_waits_for_all(pool_dir, tmp_path):
    out = tmp_path / "split"
    desc = PCADescriptor()
    _embed(pool_dir[0], out, desc, task_index=0, num_tasks=3)
    with pytest.raises(RuntimeError, match=r"tasks \[1, 2\] of 3"):
        open_embeddings(str(out))
    for t in (1, 2):
        _embed(pool_dir[0], out, desc, task_index=t, num_tasks=3, num_workers=2)
    split = open_embeddings(str(out))
    _embed(pool_dir[0], tmp_path / "single", desc)
    single = open_embeddings(str(tmp_path / "single"))
    # canonical order: the same int64 ids, the same row order, whatever the number of tasks
    assert split.ids.dtype == np.int64 and isinstance(split.ids, np.memmap)
    np.testing.assert_array_equal(split.ids, single.ids)
    assert split.digest == single.digest
    strings = split.id_strings(np.arange(len(split)))
    assert strings == sorted(strings) == single.id_strings(np.arange(len(single)))
    assert split.positions_of(strings[:3] + ["nope"]).tolist() == [0, 1, 2, -1]
    order = np.arange(len(single))
    # The tasks embed in other batch shapes than the single run: fp32 results may differ in the
    # last bit (OpenBLAS kernels per CPU), which can move an fp16-stored value by one fp16 ulp
    # (<= 2^-11 for |x| < 1).
    np.testing.assert_allclose(split.rows(np.arange(len(split))), single.rows(order), rtol=0,
                               atol=2.0 ** -10)


def test_changed_pool_is_refused_on_resume(tmp_path, pool_dir):
    src = tmp_path / "p"
    shutil.copytree(pool_dir[0], src)
    _embed(src, tmp_path / "e", PCADescriptor())
    os.remove(next(p for p in src.rglob("*.jpg")))
    with pytest.raises(RuntimeError, match="different input listing"):
        _embed(src, tmp_path / "e", PCADescriptor())


def test_two_targets_share_one_decode_and_resume_separately(pool_with_bad, tmp_path, monkeypatch):
    """The copy descriptor and a second embedding (here a descriptor at another size, standing in for a
    backbone) are computed from one read + decode per image; each output resumes on its own."""
    import curation.embed.embeddings as E

    decodes = []
    real_decode = E.safe_decode
    monkeypatch.setattr(E, "safe_decode", lambda data, **kw: (decodes.append(1), real_decode(data, **kw))[1])
    d1, d2 = PCADescriptor(), PCADescriptor(DescriptorConfig(size=32, luma_freqs=6))
    f1, f2 = Counting(d1), Counting(d2)
    kw = {"shard_size": 16, "batch_size": 8, "num_workers": 0, "progress": False}
    targets = [E.EmbedTarget(f1, str(tmp_path / "a"), d1.transform(), "phash"),
               E.EmbedTarget(f2, str(tmp_path / "b"), d2.transform())]
    counts = E.embed_pool_multi(pool_with_bad, targets, **kw)
    a, b = open_embeddings(str(tmp_path / "a")), open_embeddings(str(tmp_path / "b"))
    n_files = counts[0]["images"]
    assert len(decodes) == n_files  # once per file, not once per target
    np.testing.assert_array_equal(a.ids, b.ids)
    assert sorted(a.unreadable) == sorted(b.unreadable) and len(a.unreadable) > 0
    assert (a.hashes != 0).all() and (b.hashes == 0).all()  # only the first target asked for hashes
    assert a.dim != b.dim
    _embed(pool_with_bad, tmp_path / "single", d1)  # the one-target path gives the same rows
    single = open_embeddings(str(tmp_path / "single"))
    np.testing.assert_array_equal(a.rows(np.arange(len(a))), single.rows(np.arange(len(single))))

    # Lose the second target's shard 1: a rerun decodes only that shard's files and embeds only for b.
    os.remove(tmp_path / "b" / "part-00000-00001.ids.json")
    decodes.clear()
    g1, g2 = Counting(d1), Counting(d2)
    counts = E.embed_pool_multi(pool_with_bad, [E.EmbedTarget(g1, str(tmp_path / "a"), d1.transform(), "phash"),
                                                E.EmbedTarget(g2, str(tmp_path / "b"), d2.transform())], **kw)
    assert len(decodes) == 16 and g1.images == 0 and 0 < g2.images <= 16
    assert counts[0]["shards_written"] == 0 and counts[1]["shards_written"] == 1
    b2 = open_embeddings(str(tmp_path / "b"))
    np.testing.assert_array_equal(b.ids, b2.ids)
    np.testing.assert_array_equal(b.rows(np.arange(len(b))), b2.rows(np.arange(len(b2))))


def test_a_file_list_embeds_from_its_compact_rows_split_and_resumed(pool_with_bad, tmp_path, photos):
    """A file list's task rows are arrays (dinopipe.data.reflist), an ImageRef made per image read: two tasks,
    one of them killed and rerun, give the rows, hashes and unreadable reasons of one task over the same list."""
    files = sorted(str(p.relative_to(pool_with_bad.parent)) for p in pool_with_bad.rglob("*") if p.is_file())
    lst = pool_with_bad.parent / "pool.txt"
    lst.write_text("\n".join(files + ["gone/missing.jpg", files[0]]) + "\n")
    desc = PCADescriptor()
    whole = _embed(str(lst), tmp_path / "one", one := Counting(desc))
    with pytest.raises(KeyboardInterrupt):
        _embed(str(lst), tmp_path / "two", Counting(desc, fail_after_batches=2), task_index=0, num_tasks=2)
    _embed(str(lst), tmp_path / "two", Counting(desc), task_index=1, num_tasks=2)
    rerun = _embed(str(lst), tmp_path / "two", Counting(desc), task_index=0, num_tasks=2)
    assert one.images > 0 and rerun["shards_skipped"] == 1 and rerun["shards"] >= 2 and whole["images"] == len(files) + 1
    a, b = open_embeddings(str(tmp_path / "one")), open_embeddings(str(tmp_path / "two"))
    np.testing.assert_array_equal(a.ids, b.ids)
    # other batch compositions: equal to fp16 rounding, not bit for bit
    np.testing.assert_allclose(a.rows(np.arange(len(a))), b.rows(np.arange(len(b))), atol=2e-3)
    assert a.hashes.tolist() == b.hashes.tolist() and sorted(a.unreadable) == sorted(b.unreadable)
    reasons = {u[0].split("/")[-1]: u[2] for u in b.unreadable}
    expected = {name: reason for name, (_, reason) in bad_file_kinds(photos["chelsea"]).items()}
    assert reasons.pop("missing.jpg") and reasons == expected


def test_an_embed_task_holds_far_less_than_an_imageref_per_own_row(tmp_path):
    """The traced peak of one embed task over a file list at two sizes (every path missing: read, counted
    unreadable, written in shards of 500): it grows by the list's arrays, not by ~420 B of ImageRef per row as when
    the task listed its refs (and its to-do refs) as Python objects. Each size runs twice and keeps the lower
    peak: a one-off allocation of the libraries (~8 MB, first made in whichever run) is not the task's."""
    import tracemalloc

    peaks = {}
    for n in (2_000, 8_000, 2_000, 8_000):
        lst = tmp_path / f"l{n}.txt"
        lst.write_text("".join(f"gone/d{i % 97:03d}/img{i:010d}.jpg\n" for i in range(n)))
        out = tmp_path / f"e{n}-{n in peaks}"
        tracemalloc.start()
        try:
            counts = _embed(str(lst), out, PCADescriptor(), shard_size=500, batch_size=50)
            peaks[n] = min(peaks.get(n, 1 << 62), tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert counts["images"] == n and len(open_embeddings(str(out)).unreadable) == n
    per_row = (peaks[8_000] - peaks[2_000]) / 6_000
    assert per_row < 120, f"{per_row:.0f} B per own row"
