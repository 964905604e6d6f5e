"""Pixel verification of decontamination candidates: is a pool image a view of an eval image?

Eval leakage is not a web copy: a pool image may be a crop of an eval image down to half of each side, or hold
it inside a border, mirrored, rotated a few degrees, re-coloured (grey, hue, gain, contrast) and re-encoded.
:class:`LeakVerifier` extends :class:`curation.verify.PixelVerifier` (same features: the band-passed luminance
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

import itertools

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .verify import FILL_SIGMA, MIN_CONTENT, PixelVerifier, _blur, padding_mask

DEFAULT_THRESHOLD = 0.5
"""Noise-aware normalised correlation above which a candidate is a view of its eval image (bench figures:
docs/curation.md, "Decontamination")."""
NOISE = 0.0007
"""Band-pass std (luma in [0, 1]) counted as noise: JPEG q35-90 and resampling measure ~0.001-0.002 on flat
regions of the bench's tiles."""
GRID, MIN_BLOCKS, AGREE, BLOCK_NCC = 3, 4, 0.75, 0.3
SCALES = (1.0, 0.9, 0.8, 0.71, 0.63, 0.56, 0.5)
REFINE_SCALE, REFINE_ANGLES = (0.95, 1.0, 1.05), (-6.0, -3.0, 0.0, 3.0, 6.0)
BAND = 2  # the coarse band (features' index): a leak is resampled, so its fine band is mostly noise
UNIQUE_RADIUS, UNIQUE_MARGIN = 0.08, 0.1
# A web copy (scale ~1, no rotation, searched over a few pixels only): structure in at least 2 blocks, >= 90 %
# of them agreeing, the peak 0.03 above any alignment 8 % away (bench/bench_curation_precision.py: planted
# copies pass; the low-detail distinct pairs the global correlation accepted fail one of the three).
COPY_BLOCKS, COPY_AGREE, COPY_MARGIN = 2, 0.9, 0.03
TOP = 2  # coarse hypotheses refined at full resolution
INNER = 0.9  # the template is the contained image's central 90 % (crop edges, rotation corners left out)


def _templates(d: torch.Tensor, ty: int, tx: int, sy: float, sx: float, flip: bool, c: int,
               angle: float = 0.0) -> torch.Tensor:
    """(B, c, c): the central INNER part of each (c, c) band in ``d`` resampled into a (ty, tx) template at the
    top-left of a zero canvas (zero-mean over the template, unit noise-aware norm)."""
    ly = torch.linspace(-INNER, INNER, ty, device=d.device)
    lx = torch.linspace(-INNER, INNER, tx, device=d.device) * (-1.0 if flip else 1.0)
    gy, gx = torch.meshgrid(ly, lx, indexing="ij")
    if angle:  # the contained image rotated by ``angle`` degrees relative to the container
        r = np.deg2rad(angle)
        gx, gy = np.cos(r) * gx - np.sin(r) * gy, np.sin(r) * gx + np.cos(r) * gy
    grid = torch.stack([gx, gy], dim=-1)[None].expand(len(d), ty, tx, 2)
    t = F.grid_sample(d[:, None], grid, mode="bilinear", align_corners=False)[:, 0]
    t = t - t.mean(dim=(-2, -1), keepdim=True)
    norm = (t.flatten(1).pow(2).sum(1) + NOISE ** 2 * ty * tx).sqrt()
    t = t / norm[:, None, None]
    return F.pad(t, (0, c - tx, 0, c - ty))


def _window_energy(a: torch.Tensor, ty: int, tx: int) -> torch.Tensor:
    """(B, ny, nx) noise-aware sqrt of the mean-removed energy of ``a`` under every (ty, tx) window."""
    def box(x):
        s = F.pad(x.cumsum(1).cumsum(2), (1, 0, 1, 0))
        return s[:, ty:, tx:] - s[:, :-ty, tx:] - s[:, ty:, :-tx] + s[:, :-ty, :-tx]

    tot = box(a)
    var = (box(a * a) - tot * tot / (ty * tx)).clamp_min(0)
    return (var + NOISE ** 2 * ty * tx).sqrt()


def alignment_scores(cont: torch.Tensor, held: torch.Tensor, hyps: list[tuple]) -> torch.Tensor:
    """(B, H): best noise-aware correlation of ``held``'s templates in ``cont`` (both (B, c, c)) under each of
    ``hyps`` ((sy, sx, flip) each), over every position."""
    c = cont.shape[-1]
    fc = torch.fft.rfft2(cont)
    out = []
    for sy, sx, flip in hyps:
        ty, tx = max(4, round(INNER * sy * c)), max(4, round(INNER * sx * c))
        ft = torch.fft.rfft2(_templates(held, ty, tx, sy, sx, flip, c))
        corr = torch.fft.irfft2(fc * ft.conj(), s=(c, c))[:, :c - ty + 1, :c - tx + 1]
        out.append((corr / _window_energy(cont, ty, tx)).flatten(1).max(dim=1).values)
    return torch.stack(out, dim=1)


def _refined(cont: torch.Tensor, held: torch.Tensor, hyp: tuple, angles=None):
    """The coarse hypothesis refined at full resolution: scale x REFINE_SCALE, rotation ``angles`` (default
    REFINE_ANGLES). Returns (score, template (ty, tx), container window (ty, tx), runner-up score)."""
    c = cont.shape[-1]
    sy0, sx0, flip = hyp
    fc = torch.fft.rfft2(cont[None])
    best = None
    for k, ang in itertools.product(REFINE_SCALE, REFINE_ANGLES if angles is None else angles):
        sy, sx = min(1.0, sy0 * k), min(1.0, sx0 * k)
        ty, tx = max(4, round(INNER * sy * c)), max(4, round(INNER * sx * c))
        tpl = _templates(held[None], ty, tx, sy, sx, flip, c, ang)
        corr = torch.fft.irfft2(fc * torch.fft.rfft2(tpl).conj(), s=(c, c))
        corr = corr[0, :c - ty + 1, :c - tx + 1] / _window_energy(cont[None], ty, tx)[0]
        flat = int(corr.flatten().argmax())
        score = float(corr.flatten()[flat])
        if best is None or score > best[0]:
            y, x = divmod(flat, corr.shape[-1])
            best = (score, tpl[0, :ty, :tx], cont[y:y + ty, x:x + tx], _runner_up(corr, y, x, c))
    return best


def _runner_up(corr: torch.Tensor, y: int, x: int, c: int) -> float:
    """The best correlation at positions at least UNIQUE_RADIUS x c away from (y, x): a match along one edge
    (a ridge of the correlation) or on a periodic texture has a runner-up as good as its peak."""
    r = max(2, round(UNIQUE_RADIUS * c))
    yy = torch.arange(corr.shape[0], device=corr.device)[:, None] - y
    xx = torch.arange(corr.shape[1], device=corr.device)[None, :] - x
    far = (yy * yy + xx * xx) >= r * r
    return float(corr[far].max()) if bool(far.any()) else -1.0


def agreement(cont: torch.Tensor, held: torch.Tensor, hyp: tuple, angles=None) -> tuple[float, int, float, float]:
    """At ``hyp`` refined at full resolution (``cont``, ``held``: (c, c) bands): (score, informative blocks,
    share of them agreeing, margin of the peak over the best alignment UNIQUE_RADIUS away)."""
    score, t, win, second = _refined(cont, held, hyp, angles)
    ty, tx = t.shape
    n_inf, n_ok = 0, 0
    for i, j in itertools.product(range(GRID), range(GRID)):
        ys, xs = slice(i * ty // GRID, (i + 1) * ty // GRID), slice(j * tx // GRID, (j + 1) * tx // GRID)
        u, v = win[ys, xs], t[ys, xs]
        u, v = u - u.mean(), v - v.mean()
        if float(u.std()) < 2 * NOISE:  # no structure on the container's side
            continue
        # the template is normalised: compare shapes only, each block's own noise floor
        nu = (u.pow(2).sum() + NOISE ** 2 * u.numel()).sqrt()
        nv = v.pow(2).sum().sqrt()
        rel = float(v.std() / (t.std() + 1e-12))  # template block energy relative to the template's
        if rel < 0.25:  # (almost) nothing in this block of the eval side
            continue
        n_inf += 1
        n_ok += float((u * v).sum() / (nu * nv + 1e-12)) >= BLOCK_NCC
    return score, n_inf, (n_ok / n_inf if n_inf else 0.0), score - second


def structured_match(band_a: torch.Tensor, band_b: torch.Tensor) -> bool:
    """Whether ``band_b``'s centre aligns with ``band_a`` (scale about 1, no rotation: a web copy) in enough
    places with structure on both sides (MIN_BLOCKS, AGREE) and at one position only (UNIQUE_MARGIN): what a
    copy has and a chance match of two low-detail images -- one edge, a smooth gradient, a periodic texture --
    has not. curation.verify.PixelVerifier asks it of the pairs it accepts."""
    with torch.no_grad():
        _, n_inf, agree, margin = agreement(band_a, band_b, (1.0, 1.0, False), angles=(0.0,))
    return n_inf >= COPY_BLOCKS and agree >= COPY_AGREE and margin >= COPY_MARGIN


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
        fill = _blur(luma * v, FILL_SIGMA) / _blur(v, FILL_SIGMA).clamp_min(1e-6)
        luma, keep = torch.where(v > 0, luma, fill), v[0, 0]
    b0, b1, b2 = (_blur(luma, sg) for sg in (sigmas[0], sigmas[1], 3 * sigmas[1]))
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
        self.last_detail = np.zeros((len(a), 3), np.float32)
        for i, (pa, pb) in enumerate(zip(a, b)):
            self.n_pairs += 1
            fa, fb = self._get(pa), self._get(pb)
            if fa is None or fb is None:
                continue
            ba, bb = (x.to(self.device) for x in self._pair_bands(fa, fb))
            out[i], inf, agree, margin = self._score_pair(ba, bb)
            self.last_detail[i] = (inf, agree, margin)
            if inf < MIN_BLOCKS or agree < AGREE or margin < UNIQUE_MARGIN:
                out[i] = min(out[i], 0.0)  # structure in too few places, or a match in one place only
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
                if best is None or got[0] > best[0]:
                    best = got
            return best


def leak_verifier_of(eval_sources, eval_dir: str, pool_sources, pool_dir: str, rows_path: str | None,
                     size: int, threshold: float, min_scale: float):
    """A picklable verifier factory's body (curation.knn_steps): pairs (eval position, pool position) where pool
    positions index ``rows_path``'s rows (None: all) of the pool embeddings, read through each set's path table.
    Eval positions are encoded as ``-1 - position`` so one cache holds both."""
    from .embstore import open_embeddings
    from .verify import source_reader

    read_e = source_reader(eval_sources, open_embeddings(eval_dir))
    read_p = source_reader(pool_sources, open_embeddings(pool_dir))
    rows = None if rows_path is None else np.load(rows_path, mmap_mode="r")

    def read(pos: int):
        return read_e(-1 - pos) if pos < 0 else read_p(int(rows[pos]) if rows is not None else pos)

    return LeakVerifier(read, size=size, threshold=threshold, min_scale=min_scale)
