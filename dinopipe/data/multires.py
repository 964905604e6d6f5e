"""Crops for DINOv3's Gram teacher and its high-resolution adaptation (Siméoni et al. 2025, §4.3 and §5.1).

* :class:`GramCropAugmentation`: the usual multi-crop sample plus ``gram_crops``, the two global crops' boxes
  (same crop, same flip) at the Gram teacher's resolution and without photometric distortions (as DINOv3's
  ``gram_teacher_no_distortions``), so a higher-resolution Gram teacher sees the same content in more detail.
* :class:`GramCropCollator`: stacks them crop-major next to the global crops.
* Multi-size batches: in a high-resolution adaptation phase every batch draws one (global, local, gram) size
  triple with given probabilities. The draw is a function of (seed, epoch, offset) — the global batch's
  position, identical on every rank and after a resume — made in the batch sampler, so each data worker
  knows which augmentation the batch's samples get (:func:`choose_size`, :func:`build_multisize_loader`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from .loader import DataPosition, GlobalBatchSampler, ImagePoolDataset, SkipCorrupt
from .sources import stable_hash
from .transforms import IMAGENET_MEAN, IMAGENET_STD, MultiCropAugmentation, MultiCropCollator

class GramCropAugmentation(MultiCropAugmentation):
    """MultiCropAugmentation whose samples also hold ``gram_crops``: the global crops' boxes at ``gram_size``."""

    def __init__(self, gram_size: int, global_size: int = 224, global_scale: Sequence[float] = (0.32, 1.0),
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD, **kwargs: Any) -> None:
        super().__init__(global_size=global_size, global_scale=global_scale, mean=mean, std=std, **kwargs)
        self.gram_size, self.global_scale = gram_size, tuple(global_scale)
        # The photometric rest of each global pipeline (colour, blur, solarise, normalise), after our own
        # geometric step that produces the student's crop and the Gram teacher's from one drawn box.
        self.photo = [v2.Compose(t.transforms[self.n_geometric:]) for t in (self.global1, self.global2)]
        self.normalize = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))])

    def _global_pair(self, image: Any, photo: v2.Transform) -> tuple[Tensor, Tensor]:
        top, left, h, w = v2.RandomResizedCrop.get_params(image, scale=list(self.global_scale), ratio=[3 / 4, 4 / 3])
        flip = self.horizontal_flip and bool(torch.rand(1) < 0.5)

        def crop(size: int) -> Tensor:
            t = v2.functional.resized_crop(image, top, left, h, w, [size, size],
                                           interpolation=v2.InterpolationMode.BICUBIC, antialias=True)
            t = v2.functional.to_image(t)
            return v2.functional.horizontal_flip(t) if flip else t

        return self._plain(photo(crop(self.global_size))), self._plain(self.normalize(crop(self.gram_size)))

    def _crops(self, image: Any) -> dict[str, list[Tensor]]:
        if hasattr(image, "mode") and image.mode != "RGB":
            image = image.convert("RGB")
        elif not hasattr(image, "mode") and not torch.is_tensor(image):  # HWC uint8 array
            image = v2.functional.to_image(image)
        (g1, r1), (g2, r2) = (self._global_pair(image, p) for p in self.photo)
        return {"global_crops": [g1, g2], "gram_crops": [r1, r2],
                "local_crops": [self._plain(self.local(image)) for _ in range(self.n_local)]}


class GramCropCollator(MultiCropCollator):
    """MultiCropCollator that also stacks ``gram_crops`` (n_g * B, 3, S, S), crop-major like the global crops."""

    def __call__(self, samples: Sequence[Any], rng=None) -> dict[str, Any]:
        dicts = [s[0] if isinstance(s, (tuple, list)) else s for s in samples]
        gram = [d.pop("gram_crops", None) for d in dicts]
        out = super().__call__(samples, rng=rng)
        if all(g is not None for g in gram) and gram:
            out["gram_crops"] = torch.stack([g[i] for i in range(len(gram[0])) for g in gram])
        return out


def choose_size(probabilities: Sequence[float], seed: int, epoch: int, offset: int) -> int:
    """Index of the size triple of the global batch at (epoch, offset): same on every rank and every rerun."""
    u = (stable_hash(f"size/{seed}/{epoch}/{offset}") % (2**53)) / 2**53
    acc = 0.0
    for i, p in enumerate(probabilities):
        acc += p
        if u < acc:
            return i
    return len(probabilities) - 1  # rounding at the top end


class SizedBatchSampler(GlobalBatchSampler):
    """GlobalBatchSampler whose items carry the batch's size index: [(index, epoch, size), ...]."""

    def __init__(self, *args: Any, probabilities: Sequence[float], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.probabilities = list(probabilities)

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        G = self.b * self.world
        for batch in super().__iter__():
            # super() advanced self.pos only after the yield; here it still points at this batch.
            epoch, offset = self.pos.next_batch(G, self.n)
            k = choose_size(self.probabilities, self.seed, epoch, offset)
            yield [(i, e, k) for i, e in batch]


class MultiSizeDataset(ImagePoolDataset):
    """(index, epoch, size) -> the ``size``-th augmentation of the sample (seeded as ImagePoolDataset does)."""

    def __init__(self, refs, read: Callable, transforms: Sequence[Callable], seed: int = 0,
                 decode: Optional[Callable] = None) -> None:
        super().__init__(refs, read, transforms[0], seed, decode)
        self.transforms = list(transforms)

    def __getitem__(self, key: tuple[int, int, int]):
        index, epoch, k = key
        self.transform = self.transforms[k]  # each worker process holds its own copy; items run one at a time
        return super().__getitem__((index, epoch))


def build_multisize_loader(refs, read: Callable, transforms: Sequence[Callable], probabilities: Sequence[float],
                           collate: Callable, batch_per_rank: int, rank: int, world_size: int, seed: int,
                           start: DataPosition, num_workers: int = 2, pin_memory: bool = False,
                           worker_init_fn: Optional[Callable] = None, persistent_workers: bool = False,
                           decode: Optional[Callable] = None) -> DataLoader:
    """build_train_loader with one augmentation per size triple and one triple per global batch."""
    if len(transforms) != len(probabilities):
        raise ValueError(f"{len(transforms)} augmentations but {len(probabilities)} probabilities")
    dataset = MultiSizeDataset(refs, read, transforms, seed, decode)
    sampler = SizedBatchSampler(len(dataset), batch_per_rank, rank, world_size, seed, start,
                                probabilities=probabilities)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=SkipCorrupt(collate), num_workers=num_workers,
                      pin_memory=pin_memory, persistent_workers=persistent_workers and num_workers > 0,
                      worker_init_fn=worker_init_fn, prefetch_factor=2 if num_workers > 0 else None)


__all__ = ["GramCropAugmentation", "GramCropCollator", "MultiSizeDataset", "SizedBatchSampler",
           "build_multisize_loader", "choose_size"]
