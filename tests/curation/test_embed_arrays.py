"""The embed step on a pool of every local input kind -- a folder, a file list (a path listed twice) and tar shards --
whose tasks hold their rows as arrays (issue 49): each source's task rows are the refs the sources listed before
(the per-shard ImageRef lists, the file list's first copies), and the decisions and embeddings of W = 1 and W = 4
are the same."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from curation.cli import main
from curation.core.embstore import open_embeddings
from dinopipe.data.reflist import MemberRefs, PathRefs
from dinopipe.data.sources import FileListSource, FolderSource, TarShardSource, as_multi, stable_hash

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")


def _mixed_pool(pool: Path, work: Path) -> list[str]:
    """The pool's files split three ways: a folder, a file list naming its files (one twice), two tar shards."""
    files = sorted(p.relative_to(pool).as_posix() for p in pool.rglob("*.jpg"))
    folder, listed, tarred = files[0::3], files[1::3], files[2::3]
    (work / "folder").mkdir(parents=True)
    for rel in folder:
        (work / "folder" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(pool / rel, work / "folder" / rel)
    lst = work / "list.txt"
    lst.write_text("".join(f"{pool / rel}\n" for rel in listed) + f"{pool / listed[0]}\n")
    (work / "tars").mkdir()
    for s, part in enumerate((tarred[0::2], tarred[1::2])):
        with tarfile.open(work / "tars" / f"part-{s}.tar", "w") as tar:
            for rel in part:
                tar.add(pool / rel, arcname=rel)
    return [str(work / "folder"), str(lst), str(work / "tars")]


def _legacy(src, t: int, w: int) -> list:
    """The refs each source listed before its rows became arrays."""
    if isinstance(src, TarShardSource):
        return [r for shard in src.shards if stable_hash(f"{src.name}/{Path(shard).name}") % w == t
                for r in src._shard_refs(shard, Path(shard).name)]
    first: dict = {}
    for r in src.iter_refs():
        first.setdefault(r.loc, r)
    rows = [r for r in first.values() if stable_hash(r.id) % w == t]
    return sorted(rows, key=lambda r: r.id) if isinstance(src, FolderSource) else rows


def _run(paths, out, *extra) -> None:
    args = ["run", "--config", QUICKSTART, f"input.paths=[{','.join(paths)}]", f"output.dir={out}", "progress=false",
            "embed.num_workers=0", "report.enabled=false", "rebalance.target_size=20", "tasks.launcher=inline", *extra]
    assert main(args) == 0


@pytest.mark.slow  # ~40 s: two curate runs
def test_mixed_pool_rows_are_arrays_and_decide_as_before_for_w_1_and_4(pool_dir, tmp_path):
    paths = _mixed_pool(pool_dir[0], tmp_path / "in")
    src = as_multi(paths)
    kinds = [type(s) for s in src.sources]
    assert kinds == [FolderSource, FileListSource, TarShardSource]
    for t, w in ((0, 1), (1, 4), (3, 4)):
        seq = src.ref_seq(t, w)
        assert all(isinstance(p, (PathRefs, MemberRefs)) for p in seq.parts)  # no list of ImageRefs in a task
        assert list(seq) == [r for s in src.sources for r in _legacy(s, t, w)]
    _run(paths, tmp_path / "one", "tasks.count=1")
    _run(paths, tmp_path / "four", "tasks.count=4")
    a, b = (open_embeddings(str(tmp_path / d / "embeddings" / "descriptor")) for d in ("one", "four"))
    assert len(a) == len(list(pool_dir[0].rglob("*.jpg")))  # every image once (the path listed twice: once)
    assert a.id_strings(np.arange(len(a))) == b.id_strings(np.arange(len(b)))
    np.testing.assert_allclose(a.rows(np.arange(len(a))), b.rows(np.arange(len(b))), atol=2e-3)
    assert (tmp_path / "one" / "decisions.tsv").read_bytes() == (tmp_path / "four" / "decisions.tsv").read_bytes()
    one, four = (json.loads((tmp_path / d / "manifest.json").read_text())["counts"] for d in ("one", "four"))
    assert one == four and one["kept"] > 0
