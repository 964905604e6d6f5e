"""`curate run`'s embed step as W tasks of the step runner (issue 40), as a Slurm array embeds: task ``t`` of ``W``
lists only its share of the pool (the stable hash split of :mod:`dinopipe.data.sources`; a file list streamed,
keeping its own rows), reads, decodes and embeds it into its own parts (``part-<t>-<shard>``) and marks itself
done (``task-<t>-of-<W>.json``); the path tables are then built from the parts. The process that runs the chain
never lists the pool nor holds an image reference per row.

Every task makes its own embedders from the config: the copy descriptor from ``descriptor.npz`` (fitted once by
the orchestrator before the tasks start, so every task projects with the same one) and ``embed.model`` through
:func:`curation.embed.embedder.build_embedder` (a registry name's random weights are seeded: the same in every process).
The embeddings are per image, so the rows and every later decision do not depend on W.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import re

from curation.core.runner import launch, run_step
from curation.core.layout import RunLayout


def embed_task(t: int, w: int, sources, out_dir: str, embed, descriptor, dedup, with_model: bool) -> dict:
    """Task ``t`` of ``w``: this task's share of the pool into embeddings/descriptor (and embeddings/model)."""
    from curation.embed.embedder import build_embedder
    from curation.embed.embeddings import EmbedTarget, embed_pool_multi
    from curation.embed.copyspace import copy_embedder

    fn, tf = copy_embedder(out_dir, sources, descriptor, dedup.model, dedup.image_size, embed.device,
                           embed.precision, dedup.trust_code)
    targets = [EmbedTarget(fn, RunLayout(out_dir).embeddings("descriptor"), tf, "phash")]
    if with_model:
        model = build_embedder(embed.model, embed.image_size, embed.device, embed.precision)
        targets.append(EmbedTarget(model, RunLayout(out_dir).embeddings("model"), getattr(model, "transform", None)))
    # a local task is a daemonic process (curation.core.supervise), which may not start DataLoader workers: the W
    # tasks are the decoding processes (srun tasks and inline ones keep embed.num_workers)
    workers = 0 if mp.current_process().daemon else embed.num_workers
    counts = embed_pool_multi(sources, targets, shard_size=embed.shard_size, batch_size=embed.batch_size,
                              num_workers=workers, task_index=t, num_tasks=w, progress=False)
    return {"counts": counts}


def embed_tasks(out_dir: str, embed, tasks, embedder) -> int:
    """W of `curate run`'s embedding: 1 in an array task (``embed.num_tasks`` > 1 splits the pool already) or
    with a caller's embedder the config cannot rebuild; the W a partly embedded folder was started with (a rerun
    resumes it: its finished parts are kept); else ``tasks.count`` (null: 1 -- the pool's size is not known
    before it is listed, and listing it is the tasks' job)."""
    if embed.num_tasks != 1 or (embedder is not None and embed.model is None):
        return 1
    done = glob.glob(RunLayout(out_dir).embeddings("descriptor", "task-*-of-*.json"))
    if done:
        return int(re.search(r"-of-(\d+)", done[0]).group(1))
    count = getattr(tasks, "count", None)
    return max(1, int(count)) if count else 1


def embed_with_tasks(sources, out_dir: str, embed, descriptor, dedup, with_model: bool, w: int,
                     launcher: str) -> list[dict]:
    """Run the ``w`` embedding tasks (``launcher``: tasks.launcher; local: W fresh processes, each with its share
    of the cores and of the visible GPUs); returns the targets' counts summed over the tasks."""
    reports = run_step(embed_task, w, **launch(launcher, w), sources=sources, out_dir=out_dir, embed=embed,
                       descriptor=descriptor, dedup=dedup, with_model=with_model)
    total: list[dict] = []
    for r in reports:
        for j, c in enumerate(r["result"]["counts"]):
            if j == len(total):
                total.append({"tasks": w})
            for key in ("images", "shards", "shards_skipped", "shards_written"):
                total[j][key] = total[j].get(key, 0) + int(c.get(key, 0))
    return total
