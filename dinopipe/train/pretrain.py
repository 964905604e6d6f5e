"""dinopipe pretrain --config configs/pretrain/X.yaml [key=value ...]: self-supervised pretraining
(DINOv2 / DINOv3 recipes) of a backbone on your images; writes the run folder train.output_dir.

Rerunning the same command resumes from the run folder's latest checkpoint. Every config key, its default
and what it does: dinopipe config --kind pretrain. Exit codes: 0 done, 2 a mistake in the config or the
input (nothing written), 3 the loss became NaN/inf, 124 preempted (rerun to resume), 1 a bug to report.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from ..ssl.config import PretrainConfig
from ..ssl.task import SSLTask
from .builders import EXIT_NON_FINITE, stage_main
from .checks import validate_pretrain
from .run import run_training

__all__ = ["run", "main", "EXIT_NON_FINITE"]


def run(cfg: PretrainConfig) -> int:
    return run_training(cfg, SSLTask)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return stage_main("pretrain", PretrainConfig, validate_pretrain, run, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
