"""The files of a curation output folder that several steps share: statuses, ``steps/<step>.npz``, the copy
space (descriptor or copy model) and the rows rebalancing clusters.

A leaf of the curation step modules: :mod:`curation.pipeline`, :mod:`curation.knn_steps`,
:mod:`curation.dist_kmeans` and :mod:`curation.report` import from here, and this module imports none of
them (tests/curation/test_import_graph.py walks every import and fails on a cycle).
"""

from __future__ import annotations

import os

import numpy as np

from dinopipe.config import ConfigError
from dinopipe.utils.io import atomic_path

from .descriptor import DescriptorConfig, PCADescriptor, fit_descriptor
from .embeddings import open_embeddings

KEPT, HASH_DUP, COPY_DUP, DECONTAM, NOT_SELECTED = 0, 1, 2, 3, 4
_STATUS_NAMES = {KEPT: "kept", HASH_DUP: "hash_duplicates", COPY_DUP: "copy_duplicates",
                 DECONTAM: "decontaminated", NOT_SELECTED: "not_selected"}


def _p(out_dir: str, *parts: str) -> str:
    return os.path.join(out_dir, *parts)


def _save_step(out_dir: str, name: str, **arrays) -> None:
    os.makedirs(_p(out_dir, "steps"), exist_ok=True)
    path = _p(out_dir, "steps", f"{name}.npz")
    with atomic_path(path, suffix=".npz") as tmp:
        np.savez(tmp, **arrays)


def load_step(out_dir: str, name: str) -> dict:
    path = _p(out_dir, "steps", f"{name}.npz")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: run the '{name}' step first")
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def get_descriptor(out_dir: str, sources=None, config: DescriptorConfig | None = None
                   ) -> PCADescriptor:
    """Load ``descriptor.npz``, or build/fit and save it (so every array task uses the same)."""
    path = _p(out_dir, "descriptor.npz")
    if os.path.exists(path):
        return PCADescriptor.load(path)
    os.makedirs(out_dir, exist_ok=True)
    desc = fit_descriptor(sources, config) if sources is not None else PCADescriptor(config)
    desc.save(path)
    return desc


def copy_embedder(out_dir: str, sources=None, config: DescriptorConfig | None = None,
                  model: str | None = None, image_size: int = 224, device: str = "auto",
                  precision: str = "auto", trust_code: bool = False):
    """``(embed_fn, transform)`` of the copy space: the copy model recorded in ``out_dir`` (or
    given as ``model``), else the descriptor. Eval and seed images must be embedded alike."""
    from .copymodel import build_copy_embedder, load_record, save_record

    rec = load_record(out_dir)
    if model is not None:
        save_record(out_dir, model, image_size, trust_code)
    elif rec is not None and rec["model"]:  # the user's opt-in for this model, recorded with it
        model, image_size, trust_code = rec["model"], rec["image_size"], bool(rec.get("trust_code", False))
    if model is None:
        desc = get_descriptor(out_dir, sources, config)
        return desc, desc.transform()
    emb = build_copy_embedder(model, image_size, device, precision, trust_code)
    return emb, emb.transform



def rebalance_rows(out_dir: str):
    """What the rebalance step clusters: (embedding folder, its positions of the rows still kept
    after dedup + decontamination, in canonical order, those rows' pool positions, the statuses)."""
    status = load_step(out_dir, "decontaminate")["status"]
    desc_set = open_embeddings(_p(out_dir, "embeddings", "descriptor"))
    model_dir = _p(out_dir, "embeddings", "model")
    space_dir = model_dir if os.path.isdir(model_dir) else _p(out_dir, "embeddings", "descriptor")
    space = open_embeddings(space_dir)
    if space.digest != desc_set.digest:
        raise ConfigError(f"{space_dir} and the copy descriptors list different inputs: embed both in one "
                         f"`curate embed` run (use a fresh output folder)")
    alive = np.flatnonzero(status == KEPT)
    rows_idx = np.searchsorted(space.ids, desc_set.ids[alive])  # both sorted by input id: one pass, no dict
    if len(alive) and (rows_idx.max() >= len(space) or (space.ids[rows_idx] != desc_set.ids[alive]).any()):
        raise ConfigError(f"{space_dir} lacks rows the copy descriptors have: rerun `curate embed`")
    return space_dir, rows_idx.astype(np.int64), alive, status


