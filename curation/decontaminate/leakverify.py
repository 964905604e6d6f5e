"""Pixel verification of decontamination candidates: is a pool image a view of an eval image?

Eval leakage is not a web copy: a pool image may be a crop of an eval image down to half of each side, or hold
it inside a border, mirrored, rotated a few degrees, re-coloured (grey, hue, gain, contrast) and re-encoded.
:class:`LeakVerifier` extends :class:`curation.verify.pixels.PixelVerifier` (same features: the band-passed luminance
at ``size`` px, padding masked; same reader, cache and W-task shape) with the search such a view needs:

* **Hypotheses.** Both directions (the pool image inside the eval image, the eval image inside the pool image),
  per-axis scales from 1 down to ``min_scale`` (a crop changes the aspect; both images are squashed to a square),
  mirrored or not. The contained image's central part is resampled at each hypothesis into a template and
  found in the container at every position (FFT correlation), at half resolution on the coarse band.
* **Noise-aware correlation.** The normalised correlation gets a noise floor ``NOISE`` per pixel in both
  energies: a window or template whose band-pass energy is at the level of JPEG noise cannot correlate highly
  by chance (without it, the max over thousands of positions of two near-flat images reaches 0.6-0.7).
* **Local agreement.** At the best alignment, found again at full resolution, the template is cut into
  ``GRID``x``GRID`` blocks: a view agrees in most blocks that carry structure on both sides; a chance match
  agrees along one edge. Verified: score >= ``threshold``, at least ``MIN_BLOCKS`` informative blocks, and at
  least ``AGREE`` of them correlating >= ``BLOCK_NCC``.

Positions are (eval position, pool position) pairs; the verdicts of a pair never depend on the other pairs.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from curation.verify.alignment import (AGREE, BAND, FINE_MIN, MIN_BLOCKS, SCALES, TOP, UNIQUE_MARGIN, agreement, alignment_scores,
                                       refined_score)
from curation.core.padding import padding_mask
from curation.verify.pixels import FILL_SIGMA, MIN_CONTENT, PixelVerifier, gaussian_blur

DEFAULT_THRESHOLD = 0.5
"""Noise-aware normalised correlation above which a candidate is a view of its eval image (bench figures:
docs/curation.md, "Decontamination")."""
DETAIL_SCORE, DETAIL_FINE, DETAIL_MARGIN = 0.8, 0.9, 0.05
"""A view whose structure sits in one to three blocks (a rocket on sky, a logo on paper, a vessel in a dark fundus
corner) is accepted when its fine band agrees too (>= 0.9) at a peak 0.05 above any other alignment."""
BROAD_BLOCKS, BROAD_MARGIN = 6, 0.3
"""A view of a smooth colour image (a colour wheel, a petal) whose fine band is JPEG noise is accepted when >= 6
blocks carry structure, all agreeing, at a peak 0.3 above any other alignment. Both routes chosen on the precision
bench's seeds 1-2 (bench/bench_curation_precision.py; top-4 eval candidates of every clean tile: distinct pairs
accepted unchanged); on seeds 0 and 3 held out, verifier recall of mild leaks 0.87 / 0.87 / 0.67 -> 0.92 / 0.89 /
0.75 (mixed / retina / low-detail), distinct pairs accepted unchanged."""


def leak_evidence(score: float, inf: int, agree: float, margin: float, fine: float) -> bool:
    """Whether an alignment scoring ``score`` (coarse band) is a view, from its evidence (curation.verify.alignment
    .agreement: informative blocks, the share agreeing, the peak's margin; ``fine``: the fine band's correlation at
    that alignment): structure in many places at one position with detail, or one of the routes above."""
    many = inf >= MIN_BLOCKS and agree >= AGREE and margin >= UNIQUE_MARGIN and fine >= FINE_MIN
    detail = inf >= 1 and agree >= 1.0 and score >= DETAIL_SCORE and fine >= DETAIL_FINE and margin >= DETAIL_MARGIN
    broad = inf >= BROAD_BLOCKS and agree >= 1.0 and margin >= BROAD_MARGIN
    return many or detail or broad


def hypotheses(min_scale: float = 0.5, flips: bool = True) -> list[tuple]:
    """(scale, scale, mirrored) of each coarse hypothesis: the images are letterboxed (aspect kept), so one
    scale relates them (a crop, a resize or a border changes the scale, not the aspect of the content)."""
    scales = [s for s in SCALES if s >= min_scale - 1e-9]
    return [(sc, sc, f) for sc in scales for f in ((False, True) if flips else (False,))]


def letterboxed_bands(img: Image.Image, size: int, sigmas=(1.0, 3.0)):
    """PixelVerifier.features with the aspect kept: the content resized to fit ``size`` (its constant padding --
    rotation corners, borders -- masked and filled smoothly as there), band-passed, and placed at the centre of a
    zero (size, size) canvas. Returns (fine, its std, coarse, its std, mean RGB)."""
    img = img.convert("RGB")
    w, h = img.size
    f = size / max(w, h)
    nw, nh = max(8, round(w * f)), max(8, round(h * f))
    factor = max(1, min(w, h) // (max(nw, nh) * 2))
    if factor > 1:
        img = img.reduce(factor)
    rgb = np.asarray(img.resize((nw, nh), Image.BOX), dtype=np.float32) / 255.0
    luma = torch.from_numpy(rgb @ np.array([0.299, 0.587, 0.114], np.float32))[None, None]
    pad = padding_mask(rgb)
    keep = None
    if pad is not None and (~pad).mean() >= MIN_CONTENT:
        v = torch.from_numpy((~pad).astype(np.float32))[None, None]
        fill = gaussian_blur(luma * v, FILL_SIGMA) / gaussian_blur(v, FILL_SIGMA).clamp_min(1e-6)
        luma, keep = torch.where(v > 0, luma, fill), v[0, 0]
    b0, b1, b2 = (gaussian_blur(luma, sg) for sg in (sigmas[0], sigmas[1], 3 * sigmas[1]))
    bands = []
    for band in ((b0 - b1)[0, 0], (b1 - b2)[0, 0]):
        if keep is not None:
            band = band * keep
        canvas = torch.zeros(size, size)
        y0, x0 = (size - nh) // 2, (size - nw) // 2
        canvas[y0:y0 + nh, x0:x0 + nw] = band
        bands += [canvas, float(band.std())]
    return (*bands, rgb.reshape(-1, 3).mean(axis=0))


class LeakVerifier(PixelVerifier):
    """``verifier(e, p) -> (P,) bool``: which (eval, pool) candidate pairs are views of one another.

    ``read(position)``: the pixels of a position (eval and pool positions are told apart by the caller's
    reader, e.g. :func:`leak_reader`). ``min_scale``: the smallest per-axis scale between the two (0.5: crops
    down to half of each side, borders up to a quarter of the side)."""

    def __init__(self, read, size: int = 128, threshold: float = DEFAULT_THRESHOLD, min_scale: float = 0.5,
                 flips: bool = True, **kw):
        super().__init__(read, size=size, threshold=threshold, **kw)
        self.hyps = hypotheses(min_scale, flips)
        self.last_detail: np.ndarray | None = None

    def features(self, img):
        return None if img is None else letterboxed_bands(img, self.size, self.sigmas)

    def _pair_bands(self, fa, fb):
        """The band both images are compared on: fine when both have fine detail, else coarse."""
        k = BAND
        return fa[k], fb[k]

    def scores(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        out = np.full(len(a), -1.0, np.float32)
        self.last_detail = np.zeros((len(a), 4), np.float32)
        for i, (pa, pb) in enumerate(zip(a, b)):
            self.n_pairs += 1
            fa, fb = self._get(pa), self._get(pb)
            if fa is None or fb is None:
                continue
            ba, bb = (x.to(self.device) for x in self._pair_bands(fa, fb))
            (out[i], inf, agree, margin), d, hyp = self._score_pair(ba, bb)
            fine = -1.0
            if out[i] > self.threshold:  # the fine band at the same alignment: detail, not only a smooth surface
                fe, fp = (x.to(self.device) for x in (fa[0], fb[0]))
                with torch.no_grad():
                    fine = refined_score(*((fe, fp) if d == 0 else (fp, fe)), hyp)
            self.last_detail[i] = (inf, agree, margin, fine)
            if not leak_evidence(float(out[i]), inf, agree, margin, fine):
                out[i] = min(out[i], 0.0)  # structure in too few places, in one place only, or no detail
        return out

    def _score_pair(self, ea: torch.Tensor, pb: torch.Tensor) -> tuple[float, int, float]:
        with torch.no_grad():
            ca, cb = (F.avg_pool2d(x[None, None], 2)[0] for x in (ea, pb))
            conts, helds = torch.cat([ca, cb]), torch.cat([cb, ca])  # pool in eval, eval in pool
            sc = alignment_scores(conts, helds, self.hyps).flatten()  # (2 H,): direction-major
            best = None
            for j in sc.topk(min(TOP, len(sc))).indices.tolist():  # the best few, refined (rotation, scale)
                d, h = divmod(j, len(self.hyps))
                cont, held = (ea, pb) if d == 0 else (pb, ea)
                got = agreement(cont, held, self.hyps[h])
                if best is None or got[0] > best[0][0]:
                    best = (got, d, self.hyps[h])
            return best


def leak_verifier_of(eval_sources, eval_dir: str, pool_sources, pool_dir: str, rows_path: str | None,
                     size: int, threshold: float, min_scale: float):
    """A picklable verifier factory's body (curation.decontaminate.nearest): pairs (eval position, pool position) where pool
    positions index ``rows_path``'s rows (None: all) of the pool embeddings, read through each set's path table.
    Eval positions are encoded as ``-1 - position`` so one cache holds both."""
    from curation.core.embstore import open_embeddings
    from curation.verify.pixels import source_reader

    read_e = source_reader(eval_sources, open_embeddings(eval_dir))
    read_p = source_reader(pool_sources, open_embeddings(pool_dir))
    rows = None if rows_path is None else np.load(rows_path, mmap_mode="r")

    def read(pos: int):
        return read_e(-1 - pos) if pos < 0 else read_p(int(rows[pos]) if rows is not None else pos)

    return LeakVerifier(read, size=size, threshold=threshold, min_scale=min_scale)
