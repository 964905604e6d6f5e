"""The files of a curation output folder that several steps share: statuses (``steps/<step>/<array>.npy``, one
memory-mappable array per file, ``done.json`` last), the copy space (descriptor or copy model) and the rows
rebalancing clusters.

A leaf of the curation step modules: :mod:`curation.pipeline`, :mod:`curation.knn_steps`,
:mod:`curation.dist_kmeans` and :mod:`curation.report` import from here, and this module imports none of
them (tests/curation/test_import_graph.py walks every import and fails on a cycle).
"""

from __future__ import annotations

import json
import os

import numpy as np

from dinopipe.config import ConfigError
from dinopipe.utils.io import atomic_path, atomic_write_json

from .descriptor import DescriptorConfig, PCADescriptor, fit_descriptor
from .embeddings import open_embeddings

KEPT, HASH_DUP, COPY_DUP, DECONTAM, NOT_SELECTED = 0, 1, 2, 3, 4
_STATUS_NAMES = {KEPT: "kept", HASH_DUP: "hash_duplicates", COPY_DUP: "copy_duplicates",
                 DECONTAM: "decontaminated", NOT_SELECTED: "not_selected"}


def _p(out_dir: str, *parts: str) -> str:
    return os.path.join(out_dir, *parts)


STEP_DONE = "done.json"
"""Written last into ``steps/<step>/``: without it the folder is a step still being written (or killed)."""


def step_dir(out_dir: str, name: str) -> str:
    return _p(out_dir, "steps", name)


def _legacy_path(out_dir: str, name: str) -> str:
    return _p(out_dir, "steps", f"{name}.npz")  # the format before one .npy per array (still read)


def step_exists(out_dir: str, name: str) -> bool:
    """Whether step ``name`` has finished writing its arrays (either format)."""
    return os.path.exists(os.path.join(step_dir(out_dir, name), STEP_DONE)) or \
        os.path.exists(_legacy_path(out_dir, name))


def step_path(out_dir: str, name: str) -> str:
    """The file or folder a step's arrays are read from (for messages): the folder, else an old ``.npz``."""
    d = step_dir(out_dir, name)
    return d if os.path.exists(os.path.join(d, STEP_DONE)) or not os.path.exists(_legacy_path(out_dir, name)) \
        else _legacy_path(out_dir, name)


def _save_step(out_dir: str, name: str, **arrays) -> None:
    """``steps/<name>/<key>.npy`` per array, each written atomically, then ``done.json`` (names, dtypes,
    shapes) last: a reader sees a finished step or none, and a task can memory-map the rows it owns."""
    d = step_dir(out_dir, name)
    os.makedirs(d, exist_ok=True)
    done = os.path.join(d, STEP_DONE)
    if os.path.exists(done):
        os.remove(done)  # rewriting: unfinished until every array is replaced
    for key, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.hasobject:
            raise TypeError(f"step '{name}' array '{key}' holds Python objects: steps store numeric arrays only")
        with atomic_path(os.path.join(d, f"{key}.npy"), suffix=".npy") as tmp:
            np.save(tmp, a, allow_pickle=False)
    for stale in os.listdir(d):  # arrays of an earlier version of this step
        if stale.endswith(".npy") and stale[:-4] not in arrays:
            os.remove(os.path.join(d, stale))
    atomic_write_json(done, {"arrays": {k: {"dtype": np.asarray(a).dtype.str, "shape": list(np.shape(a))}
                                        for k, a in arrays.items()}})
    legacy = _legacy_path(out_dir, name)
    if os.path.exists(legacy):
        os.remove(legacy)  # the folder replaces it


def load_step(out_dir: str, name: str, keys=None, mmap: bool = False) -> dict:
    """The arrays of step ``name`` (``keys``: only these). ``mmap``: memory-mapped read-only arrays, so a task
    touches only the rows it indexes (a folder written before this format, ``steps/<name>.npz``, is read whole)."""
    d = step_dir(out_dir, name)
    done = os.path.join(d, STEP_DONE)
    if os.path.exists(done):
        with open(done) as f:
            names = list(json.load(f)["arrays"])
        return {k: np.load(os.path.join(d, f"{k}.npy"), mmap_mode="r" if mmap else None, allow_pickle=False)
                for k in names if keys is None or k in keys}
    path = _legacy_path(out_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{d} is missing or unfinished (no {STEP_DONE}): run the '{name}' step first")
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files if keys is None or k in keys}


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
    status = load_step(out_dir, "decontaminate", keys=("status",))["status"]
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


