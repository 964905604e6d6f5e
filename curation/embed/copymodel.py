"""A pluggable copy-detection model (``dedup.model=PATH``) in place of the offline descriptor.

``PATH`` is a TorchScript archive — e.g. SSCD's released ``sscd_disc_mixup.torchscript.pt``
(Pizzi et al. 2022, the copy detector DINOv2 deduplicated with) — or anything ``dinopipe.load``
reads (a DINOv2 checkpoint, a run folder, ...). Its L2-normalised output replaces the descriptor
for the kNN candidates and for decontamination; the pixel verifier still confirms every pair.
The whole image is resized to ``image_size`` square (no centre crop: a copy detector must see the
borders that crops remove) and normalised with ImageNet statistics, as SSCD expects.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
from torchvision import transforms as T

from dinopipe.config import ConfigError
from dinopipe.utils.safe_load import UntrustedCodeError, require_trust

from curation.config import is_torchscript
from curation.embed.embedder import ModelEmbedder, build_embedder

RECORD = "copy_model.json"  # in the output folder: later steps embed eval/seed images alike


def copy_transform(image_size: int):
    return T.Compose([T.Resize((image_size, image_size), antialias=True), T.ToTensor(),
                      T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])


def build_copy_embedder(path: str, image_size: int = 224, device: str = "auto",
                        precision: str = "auto", trust_code: bool = False) -> ModelEmbedder:
    """An ``embed_fn`` (with ``.transform``) from a TorchScript file (runs its code: needs ``trust_code``,
    the config's ``dedup.trust_code``) or a ``dinopipe.load`` path."""
    if not os.path.exists(path):
        raise ConfigError(f"dedup.model: '{path}' does not exist (a TorchScript copy-detection "
                          f"model such as SSCD's .torchscript.pt, or a dinopipe.load checkpoint)")
    if is_torchscript(path):
        try:
            require_trust(path, "a TorchScript copy model (dedup.model)", trust_code, "dedup.trust_code=true")
        except UntrustedCodeError as exc:
            raise ConfigError(f"dedup.trust_code: {exc}") from None
        try:
            with warnings.catch_warnings():  # "jit is deprecated": SSCD is released as TorchScript
                warnings.simplefilter("ignore", FutureWarning)
                net = torch.jit.load(path, map_location="cpu")
        except RuntimeError as exc:
            raise ConfigError(f"dedup.model: cannot load TorchScript '{path}': {exc}") from None
        emb = ModelEmbedder(net, image_size, device, precision)
    else:
        try:
            emb = build_embedder(path, image_size, device, precision)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("embed.model", "dedup.model", 1)) from None
    emb.transform = copy_transform(image_size)
    return emb


def save_record(out_dir: str, path: str | None, image_size: int, trust_code: bool = False) -> None:
    """Remember which copy model embedded the pool (None: the descriptor; later steps embed eval / seed images
    with it); refuse a switch of model. ``trust_code`` is written as provenance only (``trust_code_given``): it is
    never read back as permission -- a folder someone hands over must not run its model's code on its own say."""
    rec_path = os.path.join(out_dir, RECORD)
    new = {"model": os.path.abspath(path) if path else None, "image_size": image_size}
    old = load_record(out_dir)
    if old is not None and {k: old.get(k) for k in new} != new:
        raise ConfigError(f"dedup.model: {out_dir} was embedded with {old}, not {new}; use a new "
                          f"output.dir (or delete embeddings/ to re-embed)")
    os.makedirs(out_dir, exist_ok=True)
    with open(rec_path, "w") as f:
        json.dump({**new, "trust_code_given": bool(trust_code)}, f)


def check_record_trust(out_dir: str, trust_code: bool) -> None:
    """Before a step writes anything: the copy model this folder's record names runs only with the opt-in given to
    *this* run (``dedup.trust_code=true``), whatever the record says (ConfigError naming the file and the key)."""
    rec = load_record(out_dir)
    path = (rec or {}).get("model")
    if isinstance(path, str) and os.path.exists(path) and is_torchscript(path):
        try:
            require_trust(path, f"a TorchScript copy model (named by {os.path.join(out_dir, RECORD)})",
                          trust_code, "dedup.trust_code=true")
        except UntrustedCodeError as exc:
            raise ConfigError(f"dedup.trust_code: {exc}") from None


def load_record(out_dir: str) -> dict | None:
    path = os.path.join(out_dir, RECORD)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
