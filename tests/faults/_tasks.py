"""Task functions for the supervision tests, in a module of their own: a task process unpickles its function by
importing its module, and this one imports only the runner (not torch through curation.pipeline)."""

from __future__ import annotations

import os
import time

import numpy as np

from curation.core import runner


def record(t: int, w: int, folder: str, block: int = -1, fail: int = -1) -> dict:
    """Task ``t``: writes its part; task ``block`` waits for an hour; task ``fail`` raises."""
    if t == fail:
        raise KeyError(f"task {t} was told to fail")
    if t == block:
        time.sleep(3600)
    runner.write_part(runner.part_path(folder, "rec", t, w), t=np.int64(t))
    return {"t": t, "pid": os.getpid()}
