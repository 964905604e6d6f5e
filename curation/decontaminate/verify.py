"""Decontamination's pixel verification (curation.decontaminate.step.step_decontaminate): the candidates -- pool rows whose
nearest eval image in the copy space has cosine > ``decontaminate.threshold`` -- verified by
:class:`curation.decontaminate.leakverify.LeakVerifier` as W tasks of the step runner (curation.verify.pixels.PartedVerifier: each
task owns the pairs of a range of pool positions and writes its part; a rerun skips the parts written for the
same pairs), so the verdicts are the same for any W. Each part holds the pairs' scores; the verdict is score >
``decontaminate.verify_threshold`` (the scorer refuses a match without local agreement or a unique alignment by
scoring it <= 0).

The parts live in ``steps/decontaminate-verify/<settings digest>/``: other settings (size, scale range), other
parts; another threshold reuses the scores.
"""

from __future__ import annotations

import functools
import hashlib
import json

import numpy as np

from curation.config import DecontaminateConfig
from curation.decontaminate.leakverify import leak_verifier_of
from curation.verify.pixels import PartedVerifier
from curation.core.layout import RunLayout


def parts_dir(out_dir: str, d: DecontaminateConfig, eval_digest: str) -> str:
    key = json.dumps([d.verify_size, d.min_scale, eval_digest, "leakverify-1"])
    return RunLayout(out_dir).steps("decontaminate-verify", hashlib.sha1(key.encode()).hexdigest()[:12])


def candidate_scores(out_dir: str, pos: np.ndarray, nearest: np.ndarray, alive_path: str, eval_sources,
                     pool_sources, d: DecontaminateConfig, eval_digest: str, plan: dict) -> np.ndarray:
    """(C,) float32 scores of the candidates (``pos``: positions in the alive rows ``alive_path``, sorted;
    ``nearest``: their eval positions), verified as ``plan``'s W tasks."""
    if not len(pos):
        return np.zeros(0, np.float32)
    factory = functools.partial(leak_verifier_of, eval_sources, RunLayout(out_dir).embeddings("eval"),
                                pool_sources, RunLayout(out_dir).embeddings("descriptor"), alive_path,
                                d.verify_size, d.verify_threshold, d.min_scale)
    w = max(1, min(int(plan["tasks"]), len(pos)))
    verifier = PartedVerifier(None, parts_dir(out_dir, d, eval_digest), w, plan["launcher"], factory, scores=True)
    # first = the pool position (parts split by it), second = the eval position encoded below zero
    return verifier(np.asarray(pos, np.int64), -1 - np.asarray(nearest, np.int64))
