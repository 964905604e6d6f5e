"""Copy-detection descriptors that need no pretrained weights.

* :class:`PCADescriptor` — in the spirit of the "PCA hash" of DINOv2's first deduplication pass
  (Oquab et al. 2023, App. A.2): a small whole-image thumbnail projected on its leading principal
  components (the low DCT frequencies, under the natural-image prior), whitened and
  L2-normalised; optionally whitened again with a PCA fitted on the pool. Resizing,
  recompression and small crops barely move it; different pictures land far apart. Cosine
  similarity between these vectors is what the copy-dedup threshold applies to.
* :func:`phash` / :func:`dhash` — 64-bit perceptual hashes on tiny greyscale thumbnails, for the
  cheap exact / near-exact pre-dedup by Hamming distance (see ``curation.dedup.hashdedup``).

A randomly initialised ViT separates nothing, so copy detection uses this descriptor and the ViT
(or official DINOv2 weights on a real cluster) is used for retrieval and clustering.
"""

from __future__ import annotations

import heapq
import json
import os
from dataclasses import asdict

import numpy as np
import torch
from PIL import Image

from dinopipe.config import InputError
from dinopipe.utils.io import atomic_path

from curation.config import DescriptorConfig
from curation.core.padding import strip_padding

# ----------------------------------------------------------------------------- thumbnails


def thumbnail(img: Image.Image, size: int = 64) -> np.ndarray:
    """Whole image squashed to ``size x size`` RGB (aspect ignored: copies keep their aspect), its constant
    padding (borders, rotation corners: curation.core.padding.strip_padding) left out.

    The BOX filter averages every source pixel, so a 4000 px photo and its 500 px copy give
    nearly the same thumbnail. Returns (size, size, 3) float32 in [0, 1].
    """
    img = img.convert("RGB")
    # reduce() first makes huge images cheap without changing the BOX average much.
    factor = max(1, min(img.size) // (size * 4))
    if factor > 1:
        img = img.reduce(factor)
    img = strip_padding(img)  # borders and rotation corners out: a framed or rotated copy keeps its thumbnail
    return np.asarray(img.resize((size, size), Image.BOX), dtype=np.float32) / 255.0


class ThumbnailTransform:
    """DataLoader transform for the descriptor path: PIL image -> (3, size, size) float tensor."""

    def __init__(self, size: int = 64):
        self.size = size

    def __call__(self, img: Image.Image) -> torch.Tensor:
        return torch.from_numpy(thumbnail(img, self.size)).permute(2, 0, 1).contiguous()


# ----------------------------------------------------------------------------- descriptor

# RGB -> YCbCr (JPEG's): luminance carries the layout, chroma only coarse colour.
_YCC = np.array([[0.299, 0.587, 0.114], [-0.168736, -0.331264, 0.5], [0.5, -0.418688, -0.081312]],
                dtype=np.float32)


class PCADescriptor:
    """Whitened low-frequency thumbnail descriptor (a "PCA hash" with a natural-image prior).

    The principal components of natural images are close to the DCT basis with variance falling
    as 1/f^2, so projecting a thumbnail on its lowest DCT frequencies and scaling coefficient
    (u, v) by f^freq_power is PCA-whitening with a prior instead of a fit. Unlike a fit it needs
    no pool and is stable on a few dozen images, where a fitted 100-dim PCA is mostly noise.
    Measured on 32 real photos plus resized / recompressed / 5%-cropped / combined copies:
    copies >= 0.69 cosine (a periodic brick texture, cropped), distinct photos <= 0.36, so the
    DINOv2 default threshold 0.6 separates them. An optional pool-fitted PCA whitening on top
    (``pool_whiten``) lowers distinct similarities further on large pools, but lowered copy
    similarities more on the 160-image test pool, so it is off by default.
    """

    def __init__(self, config: DescriptorConfig | None = None,
                 mean: np.ndarray | None = None, projection: np.ndarray | None = None):
        self.config = config or DescriptorConfig()
        c = self.config
        n = c.size
        u = np.arange(n)
        k, i = u[:, None], u[None, :]
        dct = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
        dct[0] /= np.sqrt(2.0)
        self._dct = dct.astype(np.float32)  # (n, n) orthonormal DCT-II
        freq = np.sqrt(u[:, None] ** 2 + u[None, :] ** 2)
        luma = (u[:, None] < c.luma_freqs) & (u[None, :] < c.luma_freqs)
        luma[0, 0] = False  # DC = brightness, which copies often change
        chroma = (u[:, None] < c.chroma_freqs) & (u[None, :] < c.chroma_freqs)
        self._luma_idx, self._chroma_idx = np.flatnonzero(luma), np.flatnonzero(chroma)
        self._luma_w = (freq.ravel()[self._luma_idx] ** c.freq_power).astype(np.float32)
        self._chroma_w = (np.maximum(freq.ravel()[self._chroma_idx], 1.0) ** c.freq_power
                          ).astype(np.float32)
        self.mean = mean  # pool-PCA (optional): (F,) and (F, dim)
        self.projection = projection

    @property
    def dim(self) -> int:
        if self.projection is not None:
            return self.projection.shape[1]
        return len(self._luma_idx) + 2 * len(self._chroma_idx)

    def _prior_features(self, thumbs: np.ndarray) -> np.ndarray:
        """(N, size, size, 3) thumbnails in [0, 1] -> (N, F) whitened DCT features."""
        ycc = thumbs.astype(np.float32) @ _YCC.T  # (N, s, s, 3)
        coeffs = np.einsum("ij,njkc,lk->ncil", self._dct, ycc, self._dct, optimize=True)
        coeffs = coeffs.reshape(len(thumbs), 3, -1)  # (N, 3, s*s)
        return np.concatenate([
            coeffs[:, 0, self._luma_idx] * self._luma_w,
            coeffs[:, 1, self._chroma_idx] * self._chroma_w,
            coeffs[:, 2, self._chroma_idx] * self._chroma_w,
        ], axis=1)

    def embed_thumbnails(self, thumbs: np.ndarray) -> np.ndarray:
        """(N, size, size, 3) thumbnails -> (N, dim) L2-normalised float32 descriptors."""
        x = self._prior_features(thumbs)
        if self.projection is not None:
            x = (x - self.mean) @ self.projection
        # A flat grey image has no luminance detail; the epsilon keeps it finite (near zero).
        return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-6)).astype(np.float32)

    def fit(self, thumbs: np.ndarray) -> "PCADescriptor":
        """Fit the optional pool PCA whitening (no-op when ``config.pool_whiten == 0``)."""
        c = self.config
        if c.pool_whiten <= 0:
            return self
        x = self._prior_features(thumbs).astype(np.float64)
        if len(x) < 2 * x.shape[1]:
            raise InputError(  # data too small for a setting: the user's to change (exit 2), not a bug
                f"descriptor.pool_whiten={c.pool_whiten}: pool PCA whitening needs at least {2 * x.shape[1]} "
                f"images to fit, got {len(x)}; set pool_whiten=0 (the prior-only descriptor) for small pools"
            )
        mean = x.mean(axis=0)
        _, s, vt = np.linalg.svd(x - mean, full_matrices=False)
        eig = s**2 / (len(x) - 1)
        scale = (eig + c.shrink * eig.mean()) ** (-0.5 * c.pool_whiten)
        # Sign convention (largest |loading| positive) makes refits on the same data identical.
        axes = vt.T
        signs = np.sign(axes[np.abs(axes).argmax(axis=0), np.arange(axes.shape[1])])
        signs[signs == 0] = 1
        self.mean = mean.astype(np.float32)
        self.projection = (axes * signs * scale).astype(np.float32)
        return self

    def embed_images(self, images) -> np.ndarray:
        return self.embed_thumbnails(np.stack([thumbnail(im, self.config.size) for im in images]))

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        """``embed_fn`` for :func:`curation.embed.embeddings.embed_pool`: (B, 3, H, W) thumbnails."""
        thumbs = batch.detach().float().cpu().permute(0, 2, 3, 1).numpy()
        return torch.from_numpy(self.embed_thumbnails(thumbs))

    def transform(self) -> ThumbnailTransform:
        return ThumbnailTransform(self.config.size)

    def save(self, path: str | os.PathLike) -> None:
        """Atomic save (.npz); every array task must embed with the same descriptor."""
        path = str(path)
        arrays = {"config": np.array(json.dumps(asdict(self.config)))}
        if self.projection is not None:
            arrays.update(mean=self.mean, projection=self.projection)
        with atomic_path(path, suffix=".npz") as tmp:
            np.savez(tmp, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PCADescriptor":
        with np.load(str(path)) as z:
            config = DescriptorConfig(**json.loads(str(z["config"])))
            if "projection" in z:
                return cls(config, z["mean"], z["projection"])
            return cls(config)


def fit_descriptor(sources, config: DescriptorConfig | None = None, sample_size: int = 20000,
                   max_pixels: int | None = None) -> PCADescriptor:
    """Build a :class:`PCADescriptor`, fitting pool whitening on a stable sample if enabled.

    The sample is chosen by id hash, so every machine fitting on the same pool gets the same
    descriptor. Unreadable images are skipped (they are counted later, during embedding).
    """
    desc = PCADescriptor(config)
    if desc.config.pool_whiten <= 0:
        return desc
    from dinopipe.data.decode import DEFAULT_MAX_PIXELS, safe_decode
    from dinopipe.data.sources import as_multi

    src = as_multi(sources)
    refs = sample_refs(src, sample_size)
    thumbs = []
    for ref in refs:
        img, _ = safe_decode(src.read(ref), max_pixels=max_pixels or DEFAULT_MAX_PIXELS)
        if img is not None:
            thumbs.append(thumbnail(img, desc.config.size))
    return desc.fit(np.stack(thumbs) if thumbs else np.zeros((0, desc.config.size,
                                                             desc.config.size, 3), np.float32))


class _Held:
    """A ref in :func:`sample_refs`' heap, ordered largest key first (heapq keeps the smallest on top)."""

    __slots__ = ("key", "ref")

    def __init__(self, key, ref):
        self.key, self.ref = key, ref

    def __lt__(self, other: "_Held") -> bool:
        return self.key > other.key


def sample_refs(src, sample_size: int) -> list:
    """The ``sample_size`` refs of ``src`` (a MultiSource) with the smallest ``(stable_hash(id), id)``, in that
    order: ``sorted(src.refs(), key)[:sample_size]``, streamed (``src.iter_refs()``) through a bounded heap, so
    the fitting process holds the sample, not a ref per pool image (issue 40: ~400 B each, 400 GB at 10^9).
    Ties keep the listing order (as a stable sort does); a path a file list names twice is taken once (as
    ``refs`` does): its second sighting has the same key, so it is either held already or above the cut."""
    from dinopipe.data.sources import stable_hash

    heap: list[_Held] = []
    held: set = set()
    if sample_size <= 0:
        return []
    for seq, ref in enumerate(src.iter_refs()):
        ident = (ref.id, ref.loc)
        if ident in held:
            continue
        item = _Held((stable_hash(ref.id), ref.id, seq), ref)
        if len(heap) < sample_size:
            heapq.heappush(heap, item)
        elif heap[0].key > item.key:
            held.discard((heap[0].ref.id, heap[0].ref.loc))
            heapq.heapreplace(heap, item)
        else:
            continue
        held.add(ident)
    return [h.ref for h in sorted(heap, key=lambda h: h.key)]


# ----------------------------------------------------------------------------- perceptual hashes


def _gray_small(img: Image.Image, w: int, h: int) -> np.ndarray:
    img = img.convert("L")
    factor = max(1, min(img.size) // (max(w, h) * 4))
    if factor > 1:
        img = img.reduce(factor)
    return np.asarray(img.resize((w, h), Image.BOX), dtype=np.float32)


def dhash(img: Image.Image, hash_size: int = 8) -> int:
    """Difference hash: sign of horizontal gradients of a (hash_size+1) x hash_size thumbnail."""
    px = _gray_small(img, hash_size + 1, hash_size)
    return _pack_bits(px[:, 1:] > px[:, :-1])


def _dct_matrix(n: int) -> np.ndarray:
    k, i = np.arange(n)[:, None], np.arange(n)[None, :]
    m = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
    m[0] /= np.sqrt(2.0)
    return m


_DCT32 = _dct_matrix(32)


def phash(img: Image.Image) -> int:
    """DCT perceptual hash: the 8x8 lowest frequencies of a 32x32 thumbnail vs their median.

    More robust to recompression and resizing than :func:`dhash` at the same 64 bits.
    """
    px = _gray_small(img, 32, 32)
    coeffs = (_DCT32 @ px @ _DCT32.T)[:8, :8].ravel()
    # The DC term measures brightness only; comparing against the median of the others.
    return _pack_bits(coeffs > np.median(coeffs[1:]))


def _pack_bits(bits: np.ndarray) -> int:
    return int.from_bytes(np.packbits(bits.ravel().astype(np.uint8)).tobytes(), "big")


HASHES = {"phash": phash, "dhash": dhash}
