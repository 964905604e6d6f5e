"""fit_descriptor's whitening sample is streamed (issue 40): the same refs as sorting the whole pool by
(id hash, id), while the fitting process holds the sample, not a ref per listed image."""

from __future__ import annotations

import io
import tarfile
import tracemalloc

import pytest

from curation.embed.descriptor import sample_refs
from dinopipe.data.sources import FileListSource, MultiSource, TarShardSource, stable_hash


@pytest.fixture
def tiny_tars(tmp_path):
    """Three shards of 40 members named like images (refs never decode them)."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for j in range(3):
        with tarfile.open(folder / f"shard-{j:03d}.tar", "w") as tar:
            for i in range(40):
                info = tarfile.TarInfo(f"{i:04d}.jpg")
                info.size = 3
                tar.addfile(info, io.BytesIO(b"abc"))
    return str(folder)


def _sorted_sample(src, k):
    return sorted(src.refs(), key=lambda r: (stable_hash(r.id), r.id))[:k]


def _file_list(path, n, extra=()):
    with open(path, "w") as f:
        f.write("# generated\n\n")
        for i in range(n):
            f.write(f"d{i % 97:02d}/img-{i:09d}.jpg\n")
        for line in extra:
            f.write(line + "\n")
    return path


def test_the_streamed_sample_is_the_sorted_one(tmp_path, tiny_tars):
    # a path listed twice (refs keeps it once), an absolute path, two lists and tar shards in one pool
    lists = [_file_list(tmp_path / "a.txt", 3000, extra=["d05/img-000000005.jpg", "/abs/x.jpg", "d01/img-000000001.jpg"]),
             _file_list(tmp_path / "b.txt", 500)]
    src = MultiSource([FileListSource(lists[0]), FileListSource(lists[1]), TarShardSource(tiny_tars)])
    n = len(src.refs())
    for k in (1, 7, 100, n - 1, n, n + 10):
        assert sample_refs(src, k) == _sorted_sample(src, k), k
    assert len(sample_refs(src, n + 10)) == n  # every image once, the twice-listed path too
    assert sample_refs(src, 0) == []


def test_the_sample_holds_the_same_memory_for_a_ten_times_longer_list(tmp_path):
    peaks = {}
    for n in (20_000, 200_000):
        src = MultiSource([FileListSource(_file_list(tmp_path / f"l{n}.txt", n))])
        tracemalloc.start()
        try:
            got = sample_refs(src, 200)
            peaks[n] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert len(got) == 200
    # one ImageRef per listed line (what sorting src.refs() held) is > 200 B: 180,000 more lines would add
    # > 36 MB; streamed, the sample and one line at a time (measured: 0.12-0.14 MB either way; 3.8 / 7.8 MB
    # before the list's paths were joined without pathlib, which interned every file name for good)
    assert peaks[200_000] - peaks[20_000] < 180_000 * 8, peaks
    assert peaks[200_000] < 20_000 * 200, peaks
