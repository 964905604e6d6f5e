"""Data loaders of a resolution phase, including DINOv3's high-resolution adaptation (Siméoni et al. 2025, §5.1):
a phase with ``sizes`` draws one (global, local, Gram-teacher) crop-size triple per global batch with the given
probabilities (dinopipe/data/multires.py); a phase without is DINOv2's single size. With Gram anchoring and a
Gram crop size, samples also carry the Gram teacher's crops (same boxes, its resolution)."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, Iterable, Optional

from ..data.channels import decode_channels

from ..data.device_stage import DeviceStage
from ..data.gpu_augment import EncodedCollator, EncodedCrops, GpuMultiCrop, resolve_augment_on
from ..data.loader import DataPosition, build_train_loader
from ..data.multires import GramCropAugmentation, GramCropCollator, build_multisize_loader
from ..data.transforms import MultiCropAugmentation
from ..ssl.config_checks import data_reader
from .dist import DistInfo
from .signals import worker_ignore_signals

log = logging.getLogger(__name__)


def _gram_on(cfg: Any) -> bool:
    g = getattr(cfg, "gram", None)
    return bool(g is not None and g.enabled)


def size_triples(cfg: Any, ph: Any) -> list[tuple[int, int, Optional[int], float]]:
    """(global, local, gram or None, probability) of each size this phase draws from (one for a plain phase)."""
    gram = _gram_on(cfg)
    if ph.sizes:
        return [(s.global_crops_size, s.local_crops_size, s.gram_crops_size if gram else None, s.probability)
                for s in ph.sizes]
    return [(ph.global_crops_size, ph.local_crops_size, ph.gram_crops_size if gram else None, 1.0)]


def _augmentation(cfg: Any, global_size: int, local_size: int, gram_size: Optional[int]) -> Callable:
    # uint8 crops leave the workers; DeviceStage normalises them on the training device
    kw = dict(uint8_output=True, global_size=global_size, local_size=local_size, n_local=cfg.crops.local_crops_number,
              global_scale=tuple(cfg.crops.global_crops_scale), local_scale=tuple(cfg.crops.local_crops_scale),
              blur=str(getattr(cfg.crops, "blur", "released")), horizontal_flip=getattr(cfg.crops, "horizontal_flip", True),
              **channel_kwargs(cfg.data))
    if gram_size is None:
        return MultiCropAugmentation(**kw)
    return GramCropAugmentation(gram_size=gram_size, **kw)


def channel_kwargs(data: Any) -> dict:
    """The augmentation's channel count, input kind and per-channel statistics (data.channels / mean / std)."""
    kw: dict = {"channels": data.channels, "float_input": data_reader(data) == "array"}
    if data.mean is not None:
        kw.update(mean=tuple(data.mean), std=tuple(data.std))
    return kw


def sample_decoder(data: Any) -> Optional[Callable]:
    """None (Pillow RGB, the default) or the N-channel reader for data.reader=array (data/channels.py)."""
    if data_reader(data) != "array":
        return None
    return partial(decode_channels, channels=data.channels)


def phase_loader(cfg: Any, ph: Any, info: DistInfo, refs, read, patch_size: int
                 ) -> Callable[[DataPosition], Iterable]:
    """DataPosition -> this phase's loader (single size, or one drawn size triple per batch)."""
    collator = GramCropCollator(patch_size, tuple(cfg.ibot.mask_ratio_min_max), cfg.ibot.mask_sample_probability)
    triples = size_triples(cfg, ph)
    augs = [_augmentation(cfg, g, loc, gr) for g, loc, gr, _ in triples]
    common = dict(num_workers=cfg.data.num_workers, pin_memory=info.device.type == "cuda",
                  worker_init_fn=worker_ignore_signals, persistent_workers=cfg.data.persistent_workers,
                  decode=sample_decoder(cfg.data))

    transform, augment = augs[0], None
    if gpu_augmentation(cfg, augs, info.device):  # workers read bytes; the device decodes and crops
        aug = augs[0]
        transform, augment = EncodedCrops(aug.recipe, aug.mean, aug.std), GpuMultiCrop(aug.recipe, info.device)
        collator = EncodedCollator(patch_size, aug.global_size, mask_ratio_min_max=tuple(cfg.ibot.mask_ratio_min_max),
                                   mask_probability=cfg.ibot.mask_sample_probability)

    def loader(pos: DataPosition):
        if len(augs) == 1:
            batches = build_train_loader(refs, read, transform, collator, ph.batch_size_per_gpu, info.rank,
                                         info.world_size, cfg.train.seed, pos, **common)
        else:
            batches = build_multisize_loader(refs, read, augs, [t[3] for t in triples], collator,
                                             ph.batch_size_per_gpu, info.rank, info.world_size, cfg.train.seed, pos,
                                             **common)
        return DeviceStage(batches, info.device, augs[0].mean, augs[0].std, augment=augment)

    return loader


def gpu_augmentation(cfg: Any, augs: list, device: Any) -> bool:
    """Whether this phase augments on the device: data.augment_on (auto: on CUDA), for RGB single-size phases
    without Gram crops (the others stay on the CPU path, said once in the log)."""
    if resolve_augment_on(getattr(cfg.data, "augment_on", "cpu"), device) != "gpu":
        return False
    ok = len(augs) == 1 and type(augs[0]) is MultiCropAugmentation and augs[0].fast
    if not ok:
        log.info("data.augment_on=gpu: this phase (N channels, Gram crops or several sizes) augments on the CPU")
    return ok


def phase_sizes(cfg: Any, ph: Any) -> tuple[int, int]:
    """(global, local) crop size the Phase record reports: the largest a multi-size phase draws."""
    triples = size_triples(cfg, ph)
    return max(t[0] for t in triples), max(t[1] for t in triples)


__all__ = ["phase_loader", "phase_sizes", "size_triples"]
