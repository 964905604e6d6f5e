"""A file list read by W tasks: each task streams the list and keeps only its own rows (issue 40).

A Slurm array task used to hold the whole list's text, its lines and a set of every path (at 10^9 listed paths
~100 GB per task) to drop paths listed twice. Now the duplicates are found by the hash partition: both copies of a
path hash to the same task, so each task's own set of paths suffices, and what a task costs beyond its own rows
does not depend on the length of the list.
"""

from __future__ import annotations

import tracemalloc

import pytest

from dinopipe.data.sources import FileListSource, stable_hash


def _list(tmp_path, n: int, dup_every: int = 10):
    """n paths (a tenth listed twice, some absolute, comments and blank lines between)."""
    lines = ["# generated"]
    for i in range(n):
        lines.append(f"/abs/dir{i % 97}/img{i:07d}.jpg" if i % 13 == 0 else f"d{i % 31}/img{i:07d}.jpg")
        if i % dup_every == 0:
            lines.append(f"  d{i % 31}/img{i:07d}.jpg  " if i % 13 else lines[-1])
        if i % 1000 == 0:
            lines.append("")
    p = tmp_path / "paths.txt"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize("num_tasks", [2, 3, 4])
def test_tasks_keep_exactly_their_rows_of_the_single_process_listing_in_its_order(tmp_path, num_tasks):
    src = FileListSource(_list(tmp_path, 3000), name="l")
    every = src.refs()
    assert len(every) == 3000 and len({r.id for r in every}) == 3000  # a path listed twice is one image
    parts = [src.refs(t, num_tasks) for t in range(num_tasks)]
    for t, part in enumerate(parts):
        assert part == [r for r in every if stable_hash(r.id) % num_tasks == t]  # same refs, same order
    assert sorted(r.id for p in parts for r in p) == sorted(r.id for r in every)
    assert all(parts)


def _traced_peak(fn) -> tuple[int, object]:
    tracemalloc.start()
    try:
        out = fn()
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


def test_a_task_costs_its_own_rows_not_the_length_of_the_list(tmp_path):
    """Task 0 of 4 reading a 120k-path list vs one process reading a list of task 0's paths alone: the same refs,
    and the task's peak beyond them stays under 8 bytes per listed path (the old whole-list text, lines and set of
    every path: ~250 B per path)."""
    n, w = 120_000, 4
    big = FileListSource(_list(tmp_path, n), name="l")
    peak_task, mine = _traced_peak(lambda: big.refs(0, w))
    own = tmp_path / "own"
    own.mkdir()
    (own / "paths.txt").write_text("".join(r.id.split("/", 1)[1] + "\n" if not r.loc.startswith("/abs") else
                                           r.loc + "\n" for r in mine))
    alone = FileListSource(own / "paths.txt", name="l", root=big.root)
    peak_alone, same = _traced_peak(alone.refs)
    assert [(r.id, r.loc) for r in same] == [(r.id, r.loc) for r in mine]
    assert n // w * 0.9 < len(mine) < n // w * 1.1
    beyond = (peak_task - peak_alone) / n
    assert beyond < 8, f"task 0 of {w} holds {beyond:.1f} B per listed path beyond its own rows"


def _paths_list(path, n: int):
    with open(path, "w") as f:
        f.writelines(f"part{i // 100_000:02d}/d{i % 997:03d}/img{i:010d}.jpg\n" for i in range(n))
        f.writelines(f"part{i // 100_000:02d}/d{i % 997:03d}/img{i:010d}.jpg\n" for i in range(0, n, 50))
    return path


def test_a_task_holds_its_rows_as_arrays_not_imagerefs(tmp_path):
    """The embed step lists a task's own rows with ref_seq: what it holds grows by ~50 B per 40-byte path (the
    bytes and an offset), where a list of ImageRefs grew by ~420 B. Measured as the traced memory still held
    after listing a generated list at two sizes; the rows are the same refs as refs() gives, in order."""
    held = {}
    for n in (20_000, 80_000):
        src = FileListSource(_paths_list(tmp_path / f"l{n}.txt", n), name="pool")
        tracemalloc.start()
        try:
            seq = src.ref_seq(1, 2)
            held[n] = (tracemalloc.get_traced_memory()[0], len(seq))
        finally:
            tracemalloc.stop()
        if n == 20_000:
            assert list(seq) == src.refs(1, 2) and len(seq) == len({r.id for r in seq})
            assert seq[-1] == seq[len(seq) - 1] and seq[2:5] == list(seq)[2:5]
    per_row = (held[80_000][0] - held[20_000][0]) / (held[80_000][1] - held[20_000][1])
    assert 20_000 < held[80_000][1] * 2 < 82_000
    assert per_row < 100, f"{per_row:.0f} B held per own row"


def test_paths_listed_twice_are_kept_once_at_their_first_place(tmp_path):
    lst = tmp_path / "l.txt"
    lst.write_text("b.jpg\na.jpg\n b.jpg\n/x/c.jpg\na.jpg\n/b.jpg\n")
    src = FileListSource(lst, name="s")
    assert [(r.id, r.loc) for r in src.ref_seq()] == [
        ("s/b.jpg", str(tmp_path / "b.jpg")), ("s/a.jpg", str(tmp_path / "a.jpg")), ("s/x/c.jpg", "/x/c.jpg"),
        ("s/b.jpg", "/b.jpg")]  # '/b.jpg' is another path (as before: the set was of paths, not ids)
