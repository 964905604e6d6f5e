"""The fault table's curation-task rows: a task of `curate run` SIGKILLed (as by the OOM killer) at a chosen point of
every step (tests/faults/test_task_faults.py runs them; the kill is the ``kill_task`` debug hook, so it lands at the
same point every time). Each row: `curate run` exits 75 within ``bound_s`` of the kill with one line naming the step
and the task, and the rerun's decisions.tsv and manifest.json equal the undisturbed run's byte for byte."""

from __future__ import annotations

from dataclasses import dataclass

from tests.faults.table import Row


@dataclass(frozen=True)
class Point:
    step: str      # the pipeline step (curate run's)
    fn: str        # the runner's task function
    task: int      # the task that is killed (of 2)
    when: str      # "start": before it works; "end": after its parts are written, before it reports
    what: str      # the point in words

    def hook(self) -> str:
        """The ``kill_task`` debug hook's value (dinopipe/utils/debug_hooks.py)."""
        return f"{self.step}/{self.fn}:{self.task}:{self.when}"

    def row(self, launcher: str, slow: bool) -> Row:
        at = "before it works" if self.when == "start" else "after writing its parts"
        return Row(area=f"curation tasks ({launcher})", fault="SIGKILL", code=75, bound_s=30, slow=slow,
                   point=f"{self.what}, task {self.task} of 2 {at} [{launcher}]",
                   kept="finished tasks' parts (atomic); no manifest until write ends",
                   rerun="decisions.tsv and manifest.json equal to the undisturbed run's")


# In pipeline order: the tests run them one after another on one folder, each run resuming what the last left.
LOCAL = [
    Point("embed", "embed_task", 1, "start", "embed"),
    Point("embed", "run_task", 0, "end", "path table (sort runs)"),
    Point("dedup", "pairs_task", 1, "start", "hash dedup"),
    Point("dedup", "add_task", 1, "start", "index add"),
    Point("dedup", "search_task", 0, "start", "kNN search"),
    Point("dedup", "verify_candidates_task", 1, "end", "copy verification"),
    Point("decontaminate", "search_task", 1, "start", "decontamination search"),
    Point("rebalance", "tree_task", 0, "start", "k-means tree"),
    Point("rebalance", "select_task", 1, "start", "rebalance sampling"),
    Point("write", "_write_shards_task", 0, "start", "write shards"),
    Point("write", "_decisions_part_task", 1, "end", "write decisions"),
    Point("report", "report_scan_task", 0, "start", "report"),
]
SRUN = [
    Point("embed", "rank_task", 1, "start", "path table (ranks)"),
    Point("dedup", "verify_candidates_task", 0, "start", "copy verification"),
    Point("rebalance", "hist_task", 1, "end", "rebalance histogram"),
    Point("write", "_decisions_part_task", 0, "start", "write decisions"),
]

ROWS = [p.row("local", slow=True) for p in LOCAL] + [p.row("srun", slow=True) for p in SRUN]
