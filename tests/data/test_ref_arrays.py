"""A task's own rows as arrays, never an ImageRef per row (issue 49): file lists, folders and bucket listings keep
the paths' bytes and an int64 end per row (PathRefs), tar shards the member names' bytes and an int64 end, offset
and size (MemberRefs). Measured with tracemalloc as the growth between two sizes (the constant part cancels),
against the bytes actually allocated for the paths, so the bounds hold on any machine."""

from __future__ import annotations

import io
import sys
import tarfile
import tracemalloc

import numpy as np
import pytest

from dinopipe.data.reflist import MemberRefs, PathRefs
from dinopipe.data.source_base import ImageRef
from dinopipe.data.sources import FileListSource, TarShardSource, stable_hash


def _paths_list(path, n: int):
    """n paths of ~32 bytes, 1% of them listed twice."""
    with open(path, "w") as f:
        for s in range(0, n, 100_000):
            lines = [f"part{i // 100_000:03d}/d{i % 997:03d}/img{i:010d}.jpg\n" for i in range(s, min(n, s + 100_000))]
            f.writelines(lines)
            f.writelines(lines[::100])
    return path


def _blob_capacity(seq) -> int:
    """Bytes allocated for the paths (the bytearray under the blob, with its growth slack)."""
    base = seq.blob.base
    while not isinstance(base, (bytearray, bytes)):
        base = base.obj
    return sys.getsizeof(base)


@pytest.mark.slow  # ~40 s: 10^6 lines listed under tracemalloc
def test_a_file_lists_rows_cost_at_most_16_bytes_beyond_their_paths(tmp_path):
    """Growth from 10^5 to 4*10^5 own rows: the listing's peak takes <= 16 B per row beyond the paths' bytes
    (measured ~11: the int64 end and a CRC-32 per row), and what stays held <= 9 (the int64 end); an ImageRef per
    row was ~420 B. The arrays are numpy arrays, and the rows the same refs, in order, as refs() gives."""
    got = {}
    for n in (100_000, 400_000):
        src = FileListSource(_paths_list(tmp_path / f"l{n}.txt", n), name="pool")
        tracemalloc.start()
        try:
            seq = src.ref_seq(0, 1)
            held, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert isinstance(seq, PathRefs) and len(seq) == n and len(seq.drops) == n // 100
        assert all(isinstance(a, np.ndarray) for a in (seq.blob, seq.ends, seq.drops))
        cap = _blob_capacity(seq)
        got[n] = (peak - cap, held - cap)
        del seq
    peak_row = (got[400_000][0] - got[100_000][0]) / 300_000
    held_row = (got[400_000][1] - got[100_000][1]) / 300_000
    print(f"peak {peak_row:.1f} B/row, held {held_row:.1f} B/row beyond the paths")
    assert peak_row <= 16, f"{peak_row:.1f} B per row at the listing's peak beyond the paths"
    assert held_row <= 9, f"{held_row:.1f} B per row held beyond the paths"


def test_a_task_of_four_keeps_its_own_rows_in_list_order(tmp_path):
    src = FileListSource(_paths_list(tmp_path / "l.txt", 20_000), name="pool")
    every = [r for r in src.iter_refs()]
    first = {}
    for r in every:
        first.setdefault(r.loc, r)
    for t in range(4):
        seq = src.ref_seq(t, 4)
        want = [r for r in first.values() if stable_hash(r.id) % 4 == t]
        assert list(seq) == want and seq[-1] == want[-1] and seq[3:6] == want[3:6]


def _shards(folder, n_shards: int, per_shard: int) -> list[str]:
    folder.mkdir()
    out = []
    for s in range(n_shards):
        path = folder / f"shard-{s:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for k in range(per_shard):
                for name, data in ((f"img{k:06d}.jpg", b"x" * (k % 7 + 1)), (f"img{k:06d}.json", b"{}")):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        out.append(str(path))
    return out


def _legacy_refs(src: TarShardSource, t: int, w: int) -> list[ImageRef]:
    """What TarShardSource.refs made before: every own shard's ImageRefs, one list."""
    out = []
    for shard in src.shards:
        name = shard.rsplit("/", 1)[-1]
        if stable_hash(f"{src.name}/{name}") % w == t:
            out.extend(src._shard_refs(shard, name))
    return out


def test_tar_members_are_arrays_and_the_same_refs(tmp_path):
    """Tar shards' members: the same refs as the per-shard lists the sources made (ids, locations, order), for a
    task of 1 and of 3; held per member: 24 B beyond its name's bytes (+ slack), not an ImageRef."""
    src = TarShardSource(_shards(tmp_path / "s", 6, 400), name="tars")
    for t, w in ((0, 1), (0, 3), (2, 3)):
        seq = src.ref_seq(t, w)
        assert isinstance(seq, MemberRefs) and list(seq) == _legacy_refs(src, t, w)
    held = {}
    for n in (2, 6):
        few = TarShardSource(src.shards[:n], name="tars")
        tracemalloc.start()
        try:
            seq = few.ref_seq()
            held[n] = (tracemalloc.get_traced_memory()[0], len(seq), seq.blob.nbytes)
        finally:
            tracemalloc.stop()
        del seq
    rows = held[6][1] - held[2][1]
    per_row = (held[6][0] - held[2][0] - (held[6][2] - held[2][2])) / rows
    print(f"tar members: {per_row:.1f} B held per member beyond its name")
    assert rows == 1600 and per_row <= 40, f"{per_row:.1f} B held per member beyond its name"
