"""The layout of a training run folder (``train.output_dir`` of pretrain and distill, ``OUT/run`` of a dense head):
every path a stage writes there, and every reader of a run folder (``dinopipe.load``, ``dinopipe export``, the
pipeline), comes from :class:`TrainLayout`. The curation output folder's twin is ``curation.core.layout.RunLayout``.

::

    RUN/
      config.yaml           the resolved config (rank 0, before step 0)
      metrics.jsonl         one row per logged step (dinopipe.train.metrics)
      checkpoints/          step_XXXXXXXX/ DCP folders and ``latest`` (dinopipe.train.checkpoint)
      export/<name>/        consolidated backbones (+ heads): ``teacher`` for pretraining, a student's name for
                            distillation (dinopipe.train.run)
"""

from __future__ import annotations

from pathlib import Path


class TrainLayout:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def latest(self) -> Path:
        """The pointer file naming the newest complete checkpoint."""
        return self.checkpoints / "latest"

    def export(self, name: str = "") -> Path:
        """``export/`` or ``export/<name>``."""
        return self.root / "export" / name if name else self.root / "export"


__all__ = ["TrainLayout"]
