"""The pool's copy space: the copy model recorded in the output folder, else the offline descriptor fitted once
and saved (every task, and the eval and seed images, embedded alike)."""

from __future__ import annotations

import os

def get_descriptor(out_dir: str, sources=None, config=None):
    """Load ``descriptor.npz``, or build/fit and save it (so every array task uses the same); a
    curation.embed.descriptor.PCADescriptor (torch: imported here, not by the tasks that read step files)."""
    from curation.embed.descriptor import PCADescriptor, fit_descriptor

    path = os.path.join(out_dir, "descriptor.npz")
    if os.path.exists(path):
        return PCADescriptor.load(path)
    os.makedirs(out_dir, exist_ok=True)
    desc = fit_descriptor(sources, config) if sources is not None else PCADescriptor(config)
    desc.save(path)
    return desc


def copy_embedder(out_dir: str, sources=None, config=None,
                  model: str | None = None, image_size: int = 224, device: str = "auto",
                  precision: str = "auto", trust_code: bool = False):
    """``(embed_fn, transform)`` of the copy space: the copy model recorded in ``out_dir`` (or
    given as ``model``), else the descriptor. Eval and seed images must be embedded alike. ``trust_code`` is this
    run's own opt-in (``dedup.trust_code``): the record says which model, never whether its code may run."""
    from curation.embed.copymodel import build_copy_embedder, load_record, save_record

    rec = load_record(out_dir)
    if model is not None:
        save_record(out_dir, model, image_size, trust_code)
    elif rec is not None and rec["model"]:  # which model embedded the pool; the permission is not in the file
        model, image_size = rec["model"], rec["image_size"]
    if model is None:
        desc = get_descriptor(out_dir, sources, config)
        return desc, desc.transform()
    emb = build_copy_embedder(model, image_size, device, precision, trust_code)
    return emb, emb.transform
