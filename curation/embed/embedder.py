"""The backbone embedder: a ``dinopipe.load``-able model as an ``embed_fn`` for ``embed_pool``.

The device is chosen once here (CUDA when available); the model runs under bf16 autocast on CUDA
and returns L2-normalised CLS embeddings in fp32 (stored as fp16 by the embedding writer).
The transform is DINOv2's eval transform: resize the shorter side to size*256/224, centre-crop
``image_size`` (a multiple of the patch size), ImageNet normalisation — or, for an N-channel backbone, its
N-channel input (npy / TIFF through dinopipe.data.channels) normalised by the statistics its export records.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn.functional as F

from dinopipe.config import ConfigError
from dinopipe.data.transforms import eval_transform
from dinopipe.utils.norm import in_channels, input_norm
from dinopipe.utils.device import pick_device


log = logging.getLogger(__name__)


class ModelEmbedder:
    """``embedder(batch (B, C, H, W)) -> (B, D)`` L2-normalised CLS embeddings (fp32, on CPU)."""

    def __init__(self, model: torch.nn.Module, image_size: int = 224, device: str = "auto",
                 precision: str = "auto"):
        self.device = pick_device(device, key="embed.device")
        patch = int(getattr(model, "patch_size", 1))
        if image_size % patch:
            raise ConfigError(f"embed.image_size: {image_size} is not a multiple of the model's "
                              f"patch size {patch} (try {image_size // patch * patch})")
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" else "fp32"
        self.precision = precision
        self.image_size = image_size
        self.model = model.to(self.device).eval()
        self.channels = in_channels(model)  # a ViT, or 3 for a scripted copy-detection model
        mean, std = input_norm(model)
        self.transform: Callable = eval_transform(image_size, mean=mean, std=std)
        if self.channels != 3:  # an N-channel backbone sees the N-channel array (embeddings.py reads it so)
            self.transform.channels = self.channels

    def _autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def release(self) -> None:
        """Give the accelerator memory back (weights to CPU, CUDA cache emptied) so that faiss-gpu can
        build its index on the same GPU; the next call moves the model back."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._released = True

    @torch.no_grad()
    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        if getattr(self, "_released", False):  # needed again (seed images) after release()
            self.model.to(self.device)
            self._released = False
        x = batch.to(self.device, non_blocking=True)
        with self._autocast():
            out = self.model(x)  # (B, D) CLS embedding
        return F.normalize(out.float(), dim=-1).cpu()

    def __repr__(self) -> str:
        return (f"ModelEmbedder({type(self.model).__name__}, device={self.device}, "
                f"precision={self.precision}, image_size={self.image_size})")


def build_embedder(model: str, image_size: int = 224, device: str = "auto",
                   precision: str = "auto") -> ModelEmbedder:
    """From a registry name (random init: smoke tests only) or anything ``dinopipe.load`` accepts."""
    from dinopipe.hub import CheckpointError, load
    from dinopipe.models import list_models

    dev = pick_device(device, key="embed.device")
    if model in list_models():
        log.warning("embed.model=%s is a registry name: random weights, so retrieval and "
                    "clustering follow no semantics (use real DINOv2 weights for curation)", model)
    try:
        # a registry name's random weights seeded: every process that builds it (each embedding task, the
        # process embedding the seed images) embeds with the same network
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            net = load(model, device=dev)
    except (CheckpointError, FileNotFoundError) as exc:
        raise ConfigError(f"embed.model: cannot load '{model}': {exc}") from None
    return ModelEmbedder(net, image_size, dev, precision)


__all__ = ["ModelEmbedder", "build_embedder"]
