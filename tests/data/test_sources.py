"""Image sources: stable ids, folders / file lists / tar shards, task splits, damage is counted."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from dinopipe.data.sources import (
    FileListSource,
    FolderSource,
    MultiSource,
    TarShardSource,
    open_source,
)


def _write(path, data: bytes = b"x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _tar(path, members: dict[str, bytes]):
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "photos"
    for rel in ["b.jpg", "a/c.PNG", "a/z/d.jpeg", "notes.txt", "a/.hidden/e.webp"]:
        _write(str(root / rel), rel.encode())
    return root


def test_folder_is_recursive_sorted_and_ids_are_relative(folder):
    src = FolderSource(folder)
    ids = [s.id for s in src]
    assert ids == ["photos/a/.hidden/e.webp", "photos/a/c.PNG", "photos/a/z/d.jpeg", "photos/b.jpg"]
    sample = next(iter(src))
    assert sample.data == b"a/.hidden/e.webp" and sample.source == "photos"


def test_ids_do_not_depend_on_where_the_folder_is(folder, tmp_path):
    moved = tmp_path / "elsewhere" / "photos"
    os.renames(folder, moved)
    assert [r.id for r in FolderSource(moved).refs()][0] == "photos/a/.hidden/e.webp"


def test_file_list_keeps_missing_files_as_unreadable(folder, tmp_path):
    lst = tmp_path / "list.txt"
    lst.write_text(f"# a comment\nphotos/b.jpg\n\n{folder}/a/c.PNG\nphotos/gone.jpg\nphotos/b.jpg\n")
    src = FileListSource(lst, name="mylist")
    samples = list(src)
    assert [s.id for s in samples] == ["mylist/photos/b.jpg", f"mylist{folder}/a/c.PNG",
                                       "mylist/photos/gone.jpg"]
    assert samples[0].data == b"b.jpg" and samples[2].data is None


def test_tar_shards_yield_image_members_by_offset(tmp_path):
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    _tar(shard_dir / "s-000.tar", {"k1.jpg": b"one", "k1.json": b"{}", "k2.png": b"two"})
    _tar(shard_dir / "s-001.tar", {"k3.jpg": b"three"})
    src = open_source(shard_dir)
    assert isinstance(src, TarShardSource)
    got = [(s.id, s.data) for s in src]
    assert got == [("shards/s-000.tar/k1.jpg", b"one"), ("shards/s-000.tar/k2.png", b"two"),
                   ("shards/s-001.tar/k3.jpg", b"three")]
    assert len(TarShardSource(str(shard_dir / "*.tar")).refs()) == 3


def test_damaged_tar_keeps_earlier_images_and_counts_the_damage(tmp_path):
    path = tmp_path / "d.tar"
    _tar(path, {"a.jpg": b"a" * 1000, "b.jpg": b"b" * 5000, "c.jpg": b"c" * 1000})
    data = path.read_bytes()
    path.write_bytes(data[:1536 + 512 + 200])  # a: header+1024, b: header + 200 of 5000 bytes
    with pytest.warns(UserWarning, match="damaged"):
        refs = TarShardSource(path, name="t").refs()
    src = TarShardSource(path, name="t")
    ids = [r.id for r in refs]
    assert ids[0] == "t/d.tar/a.jpg" and src.read(refs[0]) == b"a" * 1000
    # whatever tarfile could list of b is read short (decodes as truncated); the loss is visible
    assert ids[-1] == "t/d.tar/#damaged-after-2-images" and src.read(refs[-1]) is None
    assert ids[1] == "t/d.tar/b.jpg" and len(src.read(refs[1])) < 5000  # decodes as truncated


def test_compressed_shards_are_refused_with_a_hint(tmp_path):
    p = tmp_path / "x.tar.gz"
    p.write_bytes(b"")
    with pytest.raises(ValueError, match="decompress"):
        TarShardSource(p)


@pytest.mark.parametrize("num_tasks", [2, 3, 7])
def test_task_split_is_disjoint_and_complete(folder, tmp_path, num_tasks):
    for i in range(40):
        _write(str(folder / f"many/{i:03d}.jpg"))
    src = FolderSource(folder)
    every = [r.id for r in src.refs()]
    parts = [[r.id for r in src.refs(t, num_tasks)] for t in range(num_tasks)]
    assert sorted(sum(parts, [])) == sorted(every)
    assert len(set(sum(parts, []))) == len(every)
    assert all(parts), "hash split left a task empty on 44 files"
    assert [r.id for r in src.refs(1, num_tasks)] == parts[1]  # stable


def test_tar_split_is_per_shard(tmp_path):
    d = tmp_path / "sh"
    d.mkdir()
    for s in range(6):
        _tar(d / f"{s}.tar", {f"{s}_{j}.jpg": b"x" for j in range(3)})
    src = TarShardSource(d)
    for t in range(3):
        shards = {r.id.split("/")[1] for r in src.refs(t, 3)}
        assert all(len([r for r in src.refs(t, 3) if r.id.split("/")[1] == s]) == 3 for s in shards)


def test_multi_source_refuses_colliding_names(folder, tmp_path):
    other = tmp_path / "x" / "photos"
    _write(str(other / "q.jpg"))
    with pytest.raises(ValueError, match="share the name"):
        MultiSource([folder, other])
    ms = MultiSource([FolderSource(folder), FolderSource(other, name="photos2")])
    ref = next(r for r in ms.iter_refs() if r.id == "photos2/q.jpg")
    assert ms.read(ref) == b"x"


def test_bad_split_arguments_name_the_fix(folder):
    with pytest.raises(ValueError, match="SLURM_ARRAY_TASK_ID"):
        FolderSource(folder).refs(3, 3)


def test_missing_inputs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        open_source(tmp_path / "nope")


def test_folder_walk_streams_its_own_rows_in_id_order_as_arrays(tmp_path):
    """FolderSource lists a task's files as arrays (a PathRefs, as a file list's) in a walk that yields the files
    in id order: names that sort around a folder's ('a.jpg' < 'a/...' < 'a0.jpg', 'a-b/'), a symlinked folder not
    entered, the tasks' rows a partition of the folder, every loc readable -- the order and ids an os.walk of the
    folder sorted by id gives."""
    from dinopipe.data.reflist import PathRefs

    root = tmp_path / "pool"
    rels = ["a.jpg", "a/b.jpg", "a/c/d.png", "a0.jpg", "a-b/x.jpg", "A.jpg", "z.webp", "é.jpg", "a/notes.txt"]
    for rel in rels:
        _write(str(root / rel), rel.encode())
    os.symlink(root / "a", root / "linked")  # a symlinked folder: not entered
    expected = []
    for dirpath, _, files in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        expected += [f"pool/{f if rel_dir == '.' else rel_dir + '/' + f}" for f in files if not f.endswith(".txt")]
    expected.sort()
    src = FolderSource(root)
    seq = src.ref_seq()
    assert isinstance(seq, PathRefs)
    assert [r.id for r in seq] == expected == [r.id for r in src.refs()] == [r.id for r in src.iter_refs()]
    assert "pool/a.jpg" in expected and not any(i.startswith("pool/linked") for i in expected)
    for r in seq:
        assert src.read(r) == r.id[len("pool/"):].encode()
    parts = [src.ref_seq(t, 3) for t in range(3)]
    got = [r.id for p in parts for r in p]
    assert sorted(got) == expected and len(got) == len(expected)
    assert all([r.id for r in p] == sorted(r.id for r in p) for p in parts)
