"""The layout of a curation output folder: every path a step reads or writes there comes from :class:`RunLayout`,
so the folder's shape is written once (steps ask it rather than joining names again).

::

    OUT/
      embeddings/<space>/   descriptor, model, eval, seeds: fp16 shards + ids + the path table (core.embstore)
      steps/<step>/         a step's arrays + done.json (core.stepfiles); steps/<step>.json its summary
      knn/<job>/            the saved indexes and search chunks (knn.shards)
      copy_model.json       which copy model embedded the pool (embed.copyspace)
      decisions/            decisions parts (core.decisions); decisions.tsv the table read from them
      shards/               the curated webdataset shards (write)
      manifest.json         the accounting of every input (write)
      report/               plots and summary.md (report)
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RunLayout:
    root: str

    def embeddings(self, space: str, *parts: str) -> str:
        return os.path.join(self.root, "embeddings", space, *parts)

    def steps(self, *parts: str) -> str:
        return os.path.join(self.root, "steps", *parts)

    def step_json(self, name: str) -> str:
        return os.path.join(self.root, "steps", f"{name}.json")

    def knn(self, *parts: str) -> str:
        return os.path.join(self.root, "knn", *parts)

    def decisions(self, *parts: str) -> str:
        return os.path.join(self.root, "decisions", *parts)

    def shards(self, *parts: str) -> str:
        return os.path.join(self.root, "shards", *parts)

    def report(self, *parts: str) -> str:
        return os.path.join(self.root, "report", *parts)

    @property
    def copy_model(self) -> str:
        return os.path.join(self.root, "copy_model.json")

    @property
    def decisions_tsv(self) -> str:
        return os.path.join(self.root, "decisions.tsv")

    @property
    def manifest(self) -> str:
        return os.path.join(self.root, "manifest.json")
