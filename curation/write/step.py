"""The write step of the chain (curation.pipeline runs it): the kept images as webdataset shards and the decisions
parts as W tasks, then manifest.json and decisions.tsv."""

from __future__ import annotations

import os

import numpy as np

from curation.config import TasksConfig, WriteConfig, task_plan
from curation.core.decisions import finish_decisions, selection_digest
from curation.core.runner import BLOCK, launch
from curation.core.runner import run_step as run_tasks
from curation.write.tasks import (_decisions_part_task, write_inputs, _write_shards_task,
                                  write_selection)
from curation.write.shards import finish_shard_tasks, manifest_from_counts
from curation.core.stepfiles import write_json_atomic
from curation.core.layout import RunLayout


def step_write(sources, out_dir: str, write: WriteConfig | None = None, extra: dict | None = None,
               progress: bool = False, num_tasks: int | None = None, tasks: TasksConfig | None = None,
               launcher: str | None = None) -> dict:
    """Write kept images as webdataset shards (``write.shard_size`` images each) and the decisions
    parts, each as W tasks of the step runner (``num_tasks``, else ``tasks``' plan: inline, or W local
    processes), then manifest.json and decisions.tsv. The manifest records W (``tasks.write``).

    The selection (its digest, the kept count, kept rows per block) is computed here once, streamed over the
    memory-mapped status array, and handed to the tasks: each maps only the rows it owns."""
    shard_size = (write or WriteConfig()).shard_size
    sel = write_selection(out_dir, shard_size)
    plan = task_plan(tasks or TasksConfig(), sel.n_kept)
    w = int(num_tasks if num_tasks is not None else plan["tasks"])
    how = launch(launcher or plan["launcher"], w)
    if (write or WriteConfig()).shards:
        run_tasks(_write_shards_task, w, **how, out_dir=out_dir,
                  sources=sources, shard_size=shard_size, progress=progress, selection=sel)
        shards = finish_shard_tasks(out_dir, RunLayout(out_dir).shards(), sel.n_kept, shard_size, sel.digest)
    else:  # decisions only (write.shards=false)
        shards = {"shards": [], "failed": []}
    emb, rb, dd = write_inputs(out_dir)
    failed = np.sort(emb.ids[emb.positions_of([f[0] for f in shards["failed"]])]) if shards["failed"] else \
        np.zeros(0, np.int64)  # vanished between embedding and writing: few, by nature
    digest = selection_digest(emb, rb["status"], dd["component"], failed, BLOCK)  # streamed: a block at a time
    del emb, rb, dd
    run_tasks(_decisions_part_task, w, **how, out_dir=out_dir, failed=failed,
             digest=digest)
    per_source, reasons = finish_decisions(out_dir, w)
    manifest = manifest_from_counts(per_source, reasons, {
        "shards": [os.path.relpath(s, out_dir) for s in shards["shards"]], "decisions_parts": w,
        "tasks": {"write": w}, **(extra or {})})
    write_json_atomic(RunLayout(out_dir).manifest, manifest)
    return manifest
