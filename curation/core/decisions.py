"""Why each input was kept or dropped: ``decisions/`` parts written by the tasks that own the rows.

Task ``t`` of ``W`` owns the inputs with ids in ``[t * N // W, (t + 1) * N // W)`` (input ids: ranks of the
string ids, :mod:`curation.core.pathtable`), and writes, chunk by chunk::

    decisions/part-TTTTT-of-WWWWW.tsv    id, source, status, group_or_reason; one line per input, by id
    decisions/part-TTTTT-of-WWWWW.json   its counts per source and status, unreadable reasons, digest

The parts concatenated in task order are the table ``decisions.tsv`` (sorted by id, the same bytes for
any W); :func:`iter_decisions` reads them as one table and :func:`finish_decisions` sums their counts
into the manifest and writes the merged ``decisions.tsv`` too (a streamed copy: disk, not memory).
Memory per task: one chunk of rows (the step arrays are memory-mapped: a task reads its rows of them).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
from typing import Iterator

import numpy as np

from dinopipe.utils.exits import UnfinishedError  # a killed task, not a mistake: exit 75
from dinopipe.utils.io import atomic_open, atomic_write_json

from curation.core.status import STATUS_NAMES, UNREADABLE
from curation.core.layout import RunLayout

HEADER = "id\tsource\tstatus\tgroup_or_reason\n"
CHUNK = 65536
_PART = re.compile(r"part-(\d{5})-of-(\d{5})\.json$")


def input_range(n_inputs: int, task_index: int, num_tasks: int) -> tuple[int, int]:
    return task_index * n_inputs // num_tasks, (task_index + 1) * n_inputs // num_tasks


def selection_digest(emb, status: np.ndarray, component: np.ndarray, failed: np.ndarray, chunk: int = CHUNK) -> str:
    """What the decisions depend on (a part with another digest is stale and rewritten); read ``chunk`` rows at
    a time (the arrays may be memory-mapped: memory is one chunk)."""
    h = hashlib.sha1(emb.digest.encode())
    for a in (status, component, failed):  # a chunk at a time: the same digest as the whole arrays' bytes
        for lo in range(0, len(a), chunk):
            h.update(np.ascontiguousarray(a[lo:lo + chunk]).tobytes())
    return h.hexdigest()[:16]


def part_path(out_dir: str, task_index: int, num_tasks: int, ext: str) -> str:
    return RunLayout(out_dir).decisions(f"part-{task_index:05d}-of-{num_tasks:05d}.{ext}")


def decisions_task(out_dir: str, emb, status: np.ndarray, component: np.ndarray, failed: np.ndarray,
                   task_index: int = 0, num_tasks: int = 1, digest: str | None = None) -> dict:
    """Write this task's decisions part (skipped when finished for the same selection); returns its counts.

    ``status``/``component``: per embedding row (step arrays); ``failed``: sorted input ids whose bytes
    could not be read again when writing shards (they count as unreadable, reason 'read_error')."""
    digest = digest or selection_digest(emb, status, component, failed)
    json_path = part_path(out_dir, task_index, num_tasks, "json")
    if os.path.exists(json_path):
        with open(json_path) as f:
            done = json.load(f)
        if done["digest"] == digest:
            return done
    lo, hi = input_range(emb.n_inputs, task_index, num_tasks)
    reasons = list(emb.reason_names) + (["read_error"] if "read_error" not in emb.reason_names else [])
    read_error = reasons.index("read_error")
    n_src, n_st, n_rs = len(emb.source_names), len(STATUS_NAMES), len(reasons)
    counts = np.zeros((n_src, n_st), np.int64)
    reason_counts = np.zeros((n_src, n_rs), np.int64)
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    with atomic_open(part_path(out_dir, task_index, num_tasks, "tsv")) as f:
        for start in range(lo, hi, CHUNK):
            inp = np.arange(start, min(hi, start + CHUNK), dtype=np.int64)
            pos = np.minimum(np.searchsorted(emb.ids, inp), max(len(emb.ids) - 1, 0))
            is_row = (emb.ids[pos] == inp) if len(emb.ids) else np.zeros(len(inp), bool)
            code = np.full(len(inp), UNREADABLE, np.int64)
            code[is_row] = status[pos[is_row]]
            reason = np.asarray(emb.input_reason[inp], np.int64)
            lost = np.isin(inp, failed)
            code[lost], reason[lost] = UNREADABLE, read_error
            src = np.asarray(emb.input_source[inp], np.int64)
            counts += np.bincount(src * n_st + code, minlength=n_src * n_st).reshape(n_src, n_st)
            bad = code == UNREADABLE
            reason_counts += np.bincount(src[bad] * n_rs + reason[bad], minlength=n_src * n_rs).reshape(n_src, n_rs)
            why = np.full(len(inp), "", dtype=object)  # one chunk of strings at a time
            ok = is_row & ~lost
            why[ok] = emb.table.strings(emb.ids[component[pos[ok]]])
            why[bad] = [reasons[r] for r in reason[bad]]
            names = emb.table.strings(inp)
            f.writelines(f"{n}\t{emb.source_names[s]}\t{STATUS_NAMES[c]}\t{w}\n"
                         for n, s, c, w in zip(names, src, code, why))
    out = {"task_index": task_index, "num_tasks": num_tasks, "digest": digest, "inputs": [lo, hi],
           "counts": {emb.source_names[s]: {STATUS_NAMES[c]: int(counts[s, c]) for c in range(n_st)}
                      for s in range(n_src) if counts[s].sum()},
           "reasons": {emb.source_names[s]: {reasons[r]: int(reason_counts[s, r]) for r in range(n_rs)
                                             if reason_counts[s, r]} for s in range(n_src) if counts[s].sum()}}
    atomic_write_json(json_path, out)  # last: marks the part finished
    return out


def part_files(out_dir: str, num_tasks: int | None = None) -> list[str]:
    """The finished parts' .json (of the newest split when ``num_tasks`` is None), in task order."""
    found = sorted(p for p in glob.glob(RunLayout(out_dir).decisions("part-*.json")) if _PART.search(p))
    if num_tasks is None and found:
        num_tasks = int(_PART.search(found[-1]).group(2))
    return [p for p in found if int(_PART.search(p).group(2)) == num_tasks]


def finish_decisions(out_dir: str, num_tasks: int, merged: bool = True) -> tuple[dict, dict]:
    """Sum the parts' counts -> ({source: {status: n}}, {source: {reason: n}}); remove parts of other splits;
    write the merged ``decisions.tsv`` (``merged``). Raises naming the parts not finished yet."""
    parts = part_files(out_dir, num_tasks)
    have = {int(_PART.search(p).group(1)) for p in parts}
    missing = sorted(set(range(num_tasks)) - have)
    if missing:
        raise UnfinishedError(f"decisions parts {missing} of {num_tasks} are not written yet: rerun those tasks")
    for p in glob.glob(RunLayout(out_dir).decisions("part-*")):
        m = re.search(r"-of-(\d{5})\.", p)
        if m and int(m.group(1)) != num_tasks:
            os.remove(p)  # an earlier split of the same folder
    per_source: dict[str, dict] = {}
    reasons: dict[str, dict] = {}
    for p in parts:
        with open(p) as f:
            part = json.load(f)
        for target, got in ((per_source, part["counts"]), (reasons, part["reasons"])):
            for s, c in got.items():
                t = target.setdefault(s, {})
                for k, v in c.items():
                    t[k] = t.get(k, 0) + v
    if merged:
        with atomic_open(RunLayout(out_dir).decisions_tsv) as out:
            out.write(HEADER)
            for p in parts:
                with open(p[:-len(".json")] + ".tsv") as f:
                    shutil.copyfileobj(f, out)
    return per_source, reasons


def iter_decisions(out_dir: str) -> Iterator[tuple[str, str, str, str]]:
    """``(id, source, status, group_or_reason)`` of every input, by id, read from the parts."""
    for p in part_files(out_dir):
        with open(p[:-len(".json")] + ".tsv") as f:
            for line in f:
                yield tuple(line.rstrip("\n").split("\t"))
