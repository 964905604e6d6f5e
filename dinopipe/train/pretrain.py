"""``dinopipe pretrain --config configs/pretrain/X.yaml [key=value ...]``: load config -> build -> run -> close.

Rerunning the same command resumes from the run directory's latest checkpoint.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from ..ssl.config import PretrainConfig, validate
from ..ssl.task import SSLTask
from .builders import EXIT_NON_FINITE, stage_main
from .run import run_training

__all__ = ["run", "main", "EXIT_NON_FINITE"]


def run(cfg: PretrainConfig) -> int:
    return run_training(cfg, SSLTask)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return stage_main("pretrain", PretrainConfig, validate, run, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
