"""Logging for every entry point (``dinopipe`` stages, ``curate``, the pipeline): one call, ``setup_logging()``.

Only the project's own loggers (``dinopipe``, ``curation``) get a handler and a level: INFO on rank 0, WARNING on
the other ranks (N ranks repeating every line makes a job log unreadable). The root logger is left as the user or
the host application set it, so third-party INFO lines (faiss's loader, matplotlib's category units, PIL's plugin
probing) stay quiet. Records go to stderr, as Python's logging does by default, beside the progress lines
(``dinopipe/utils/progress.py``): stdout stays for
results a script captures (`P=$(dinopipe export ...)` gets the path, not a warning).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

PACKAGES = ("dinopipe", "curation")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (not the one at setup): pytest's capture
    and the pipeline running several stages in one process swap it, and a handler holding the old object would
    write into a closed stream."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property above wins
        pass


def env_rank() -> int:
    """This process's rank as its launcher tells it (torchrun: RANK; an srun step: SLURM_PROCID), before any
    process group exists; 0 for a plain process."""
    for key in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 0


def setup_logging(rank: Optional[int] = None) -> None:
    """Give the package loggers one stderr handler, at INFO on rank 0 and WARNING elsewhere. Idempotent: stages
    run inside the pipeline call it again, which only updates the level."""
    level = logging.INFO if (env_rank() if rank is None else rank) == 0 else logging.WARNING
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter(FORMAT))
            logger.addHandler(handler)
        # Our handler prints the record; a root handler configured by a host application would print it again.
        logger.propagate = False


__all__ = ["setup_logging", "env_rank", "PACKAGES"]
