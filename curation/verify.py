"""Pixel verification of candidate copy pairs: aligned normalised correlation at 128 px.

The kNN on the copy descriptor gives *candidates* (high recall); a candidate becomes a copy edge
only if the two images, read again at a higher resolution than the descriptor's 64 px thumbnail,
align. Copies as the web makes them (resized, recompressed, cropped by a few percent, brightness
changed, shifted by a few pixels) differ from their original by a small scale, a translation and a
brightness gain: a band-pass of the luminance (difference of Gaussians, which removes brightness
and the JPEG-noise band) matched over a grid of per-axis scales and every shift within the crop
margin correlates at >= ~0.6 for such copies. Distinct tiles of one homogeneous scene (retina,
micrographs, gravel) share the descriptor's low frequencies but not their band-passed detail:
measured <= ~0.3 (see README, "Copy detection"). This is template matching (normalised
cross-correlation, as in OpenCV's ``TM_CCORR_NORMED``), computed with FFTs in torch.

Images with no detail at all (blank scan background, flat colour) have no band-pass energy to
correlate: two such images are copies when their mean colours agree; a flat and a textured image
never are.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

# Measured on the bench pools (bench/bench_copy.py): copies >= 0.6, distinct tiles <= 0.35.
DEFAULT_THRESHOLD = 0.5
# Band-pass std (luminance in [0, 1]). Below LOW_ENERGY in the fine band (sky, blur, smooth
# gradients: JPEG noise would dominate) a pair is compared on the coarse band; below FLAT_ENERGY
# there too, an image is blank (constant scan background measures 0).
LOW_ENERGY = 0.0025
FLAT_ENERGY = 0.0005


def _gauss_kernel(sigma: float) -> torch.Tensor:
    r = max(1, int(round(3 * sigma)))
    x = torch.arange(-r, r + 1, dtype=torch.float32)
    k = torch.exp(-0.5 * (x / sigma) ** 2)
    return k / k.sum()


def _blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of (B, 1, H, W), reflect-padded."""
    k = _gauss_kernel(sigma)
    r = len(k) // 2
    x = F.conv2d(F.pad(x, (r, r, 0, 0), mode="reflect"), k.view(1, 1, 1, -1))
    return F.conv2d(F.pad(x, (0, 0, r, r), mode="reflect"), k.view(1, 1, -1, 1))


# Constant padding: pixels within PAD_TOL (RGB, [0, 1]) of the border's dominant colour, connected to the
# border, covering at least PAD_MIN of the image; grown by PAD_GROW px over the anti-aliased edge. The
# colour must be a fill colour (black, white, grey: channels within PAD_GREY) and the region flat (luma
# std < PAD_FLAT), so a smooth coloured background of the content (retina, sky) is never taken for one.
PAD_TOL, PAD_MIN, PAD_GROW, PAD_GREY, PAD_FLAT = 0.05, 0.01, 2, 0.08, 0.012
MIN_CONTENT = 0.05  # below this share of non-padding pixels an image counts as blank
FILL_SIGMA = 6.0  # px: the smooth fill of the padding (normalised convolution of the content)


def _grow(m: np.ndarray) -> np.ndarray:
    g = m.copy()
    g[1:] |= m[:-1]
    g[:-1] |= m[1:]
    g[:, 1:] |= m[:, :-1]
    g[:, :-1] |= m[:, 1:]
    return g


def padding_mask(rgb: np.ndarray) -> np.ndarray | None:
    """(S, S) bool: constant padding connected to the image border (rotation corners, flat margins),
    or None when there is none. ``rgb``: (S, S, 3) in [0, 1]."""
    frame = np.concatenate([rgb[0], rgb[-1], rgb[:, 0], rgb[:, -1]])  # (4S, 3) border pixels
    q = np.round(frame * 15).astype(np.int64) @ np.array([256, 16, 1])
    vals, cnt = np.unique(q, return_counts=True)
    if cnt.max() < 0.1 * len(q):  # no dominant border colour: no padding
        return None
    colour = np.median(frame[q == vals[cnt.argmax()]], axis=0)
    if colour.max() - colour.min() > PAD_GREY:
        return None
    cand = np.abs(rgb - colour).max(axis=-1) < PAD_TOL
    m = np.zeros_like(cand)
    m[0], m[-1], m[:, 0], m[:, -1] = cand[0], cand[-1], cand[:, 0], cand[:, -1]
    for _ in range(2 * len(rgb)):  # flood fill from the border through padding-coloured pixels
        g = _grow(m) & cand
        if (g == m).all():
            break
        m = g
    if m.mean() < PAD_MIN or (rgb[m] @ np.array([0.299, 0.587, 0.114], np.float32)).std() > PAD_FLAT:
        return None
    for _ in range(PAD_GROW):
        m = _grow(m)
    return m


class PixelVerifier:
    """``verifier(a, b) -> (P,) bool``: which candidate pairs (positions) are verified copies.

    ``read(position) -> PIL.Image | None`` gives pixels; features of recently read images are
    cached (``cache_size`` images of ``size``² float32), so pairs sorted by their first image
    decode each image about once. Cost is proportional to the number of pairs: per pair, one
    batched FFT correlation over ``len(scales)²`` scale hypotheses.
    """

    def __init__(self, read: Callable[[int], Image.Image | None], size: int = 128,
                 threshold: float = DEFAULT_THRESHOLD, scales=(0.96, 1.0, 1.04),
                 max_shift: float = 0.08, sigmas=(1.0, 3.0), cache_size: int = 4096,
                 batch_pairs: int = 64):
        self.read, self.size, self.threshold = read, size, threshold
        self.scales, self.max_shift, self.sigmas = tuple(scales), max_shift, tuple(sigmas)
        self.cache_size, self.batch_pairs = cache_size, batch_pairs
        self._cache: OrderedDict[int, tuple] = OrderedDict()
        self.n_pairs = 0
        self.n_reads = 0

    # -- features ---------------------------------------------------------------------------
    def features(self, img: Image.Image | None):
        """(fine band (S, S), its std, coarse band (S, S), its std, mean RGB); None if unreadable.

        Constant padding (the black corners of a rotated image, a flat border or letterbox touching the
        image's edge) is masked out: it is filled smoothly from the content before the band-pass, and
        the bands are zero over it, so the edge between padding and content (which every rotated image
        has) correlates with nothing."""
        if img is None:
            return None
        s = self.size
        img = img.convert("RGB")
        factor = max(1, min(img.size) // (s * 2))
        if factor > 1:
            img = img.reduce(factor)
        rgb = np.asarray(img.resize((s, s), Image.BOX), dtype=np.float32) / 255.0
        luma = torch.from_numpy(rgb @ np.array([0.299, 0.587, 0.114], np.float32))[None, None]
        pad = padding_mask(rgb)
        if pad is not None:
            valid = (~pad).astype(np.float32)
            if valid.mean() < MIN_CONTENT:
                pad = None  # (almost) nothing but one colour: a blank image, compared by colour
            else:
                v = torch.from_numpy(valid)[None, None]
                fill = _blur(luma * v, FILL_SIGMA) / _blur(v, FILL_SIGMA).clamp_min(1e-6)
                luma = torch.where(v > 0, luma, fill)
        b0, b1, b2 = (_blur(luma, sg) for sg in (self.sigmas[0], self.sigmas[1], 3 * self.sigmas[1]))
        fine, coarse = (b0 - b1)[0, 0], (b1 - b2)[0, 0]
        if pad is not None:
            keep = torch.from_numpy(~pad).float()
            fine, coarse = fine * keep, coarse * keep
        return fine, float(fine.std()), coarse, float(coarse.std()), rgb.reshape(-1, 3).mean(axis=0)

    def _get(self, pos: int):
        pos = int(pos)
        if pos in self._cache:
            self._cache.move_to_end(pos)
            return self._cache[pos]
        self.n_reads += 1
        f = self.features(self.read(pos))
        self._cache[pos] = f
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return f

    # -- scoring ----------------------------------------------------------------------------
    def _grid(self, s: int) -> tuple[torch.Tensor, int]:
        """Sampling grids of the central template of an (s, s) image at every (sx, sy):
        (K, T, T, 2), and the template side T (the image minus the shift margin)."""
        t = s - 2 * (int(np.ceil(self.max_shift * s)) + 1)
        half = (t - 1) / s  # template half-extent in normalised coordinates
        lin = torch.linspace(-half, half, t)
        grids = [torch.stack(torch.meshgrid(lin * sy, lin * sx, indexing="ij")[::-1], dim=-1)
                 for sx in self.scales for sy in self.scales]
        return torch.stack(grids), t

    @staticmethod
    def _ncc(a: torch.Tensor, b: torch.Tensor, grids: torch.Tensor, t: int):
        """Normalised correlation of b's resampled centre (``grids``: (P*K, T, T, 2), K
        hypotheses per pair) with a at every shift. Returns (best (P,), best hypothesis (P,))."""
        p, s = a.shape[0], a.shape[-1]
        k = grids.shape[0] // p
        src = b[:, None, None].expand(p, k, 1, s, s).reshape(p * k, 1, s, s)
        tpl = F.grid_sample(src, grids, mode="bilinear", align_corners=False)[:, 0]  # (P*K, T, T)
        tpl = tpl - tpl.mean(dim=(-2, -1), keepdim=True)
        tpl = tpl / tpl.flatten(1).norm(dim=1).clamp_min(1e-8)[:, None, None]
        n = s - t + 1  # shifts per axis
        fa = torch.fft.rfft2(a)  # (P, S, S/2+1)
        ft = torch.fft.rfft2(tpl, s=(s, s)).view(p, k, s, -1)
        corr = torch.fft.irfft2(fa[:, None] * ft.conj(), s=(s, s))[..., :n, :n]  # (P, K, n, n)

        # a's energy under every template position (box sums from a summed-area table); the
        # template has zero mean, so a's local mean drops out of the numerator.
        def box(x):
            c = F.pad(x.cumsum(1).cumsum(2), (1, 0, 1, 0))
            return c[:, t:, t:] - c[:, :-t, t:] - c[:, t:, :-t] + c[:, :-t, :-t]

        tot = box(a)
        var = (box(a * a) - tot * tot / (t * t)).clamp_min(1e-12)  # (P, n, n)
        ncc = (corr / var.sqrt()[:, None]).flatten(2).max(dim=2).values  # (P, K)
        best, arg = ncc.max(dim=1)
        return best, arg

    def _score_textured(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Coarse to fine: every scale hypothesis at half resolution, the best one at full."""
        p = a.shape[0]
        ca, cb = F.avg_pool2d(a[:, None], 2)[:, 0], F.avg_pool2d(b[:, None], 2)[:, 0]
        coarse_grid, ct = self._grid(ca.shape[-1])
        _, arg = self._ncc(ca, cb, coarse_grid.repeat(p, 1, 1, 1), ct)
        fine_grid, ft = self._grid(self.size)
        best, _ = self._ncc(a, b, fine_grid[arg], ft)
        return best

    def scores(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """(P,) verification score of each pair (a[i], b[i]) in [-1, 1] (b's centre found in a).

        Callers pass pairs in a canonical order (``copy_dedup_from_pairs``: smaller id first),
        so the decision about a pair never depends on which side the kNN found it from.
        """
        a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        out = np.zeros(len(a), np.float32)
        for start in range(0, len(a), self.batch_pairs):
            sl = slice(start, start + self.batch_pairs)
            fa = [self._get(i) for i in a[sl]]
            fb = [self._get(j) for j in b[sl]]
            jobs = {0: [], 2: []}  # pairs compared on the fine band / on the coarse band
            for i, (x, y) in enumerate(zip(fa, fb)):
                self.n_pairs += 1
                if x is None or y is None:
                    continue  # unreadable: never a verified copy
                if min(x[1], y[1]) >= LOW_ENERGY:
                    jobs[0].append(i)
                elif min(x[3], y[3]) >= FLAT_ENERGY:  # little fine detail (sky, blur): coarser
                    jobs[2].append(i)
                elif max(x[3], y[3]) < FLAT_ENERGY:  # two blank images: same colour or not
                    out[start + i] = 1.0 if np.abs(x[4] - y[4]).max() < 0.06 else 0.0
            for band, idx in jobs.items():
                if idx:
                    with torch.no_grad():
                        sc = self._score_textured(torch.stack([fa[i][band] for i in idx]),
                                                  torch.stack([fb[i][band] for i in idx]))
                    out[start + np.array(idx)] = sc.numpy()
        return out

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.scores(a, b) > self.threshold


def source_reader(sources, emb, max_pixels: int | None = None) -> Callable[[int], Image.Image | None]:
    """``read(position)``: the decoded image of row ``position`` of the EmbeddingSet ``emb``, read
    through its path table from curation ``sources`` (no listing of the pool)."""
    from dinopipe.data.decode import DEFAULT_MAX_PIXELS, safe_decode
    from dinopipe.data.sources import as_multi

    src = as_multi(sources)

    def read(pos: int):
        ref = emb.ref(pos)
        if ref is None or ref.source not in src.by_name:
            return None
        img, _ = safe_decode(src.read(ref), max_pixels=max_pixels or DEFAULT_MAX_PIXELS)
        return img

    return read


def pixel_verifier(sources, emb, rows: np.ndarray | None = None, size: int = 128,
                   threshold: float = DEFAULT_THRESHOLD) -> PixelVerifier:
    """The verifier ``copy_dedup_from_pairs`` needs for pairs of positions into ``rows`` (a
    subset of the rows of the EmbeddingSet ``emb``, e.g. the hash-dedup survivors; None: all)."""
    read = source_reader(sources, emb)
    if rows is None:
        return PixelVerifier(read, size=size, threshold=threshold)
    rows = np.asarray(rows, np.int64)
    return PixelVerifier(lambda pos: read(rows[pos]), size=size, threshold=threshold)
