"""Alignment of two band-passed images and its evidence (curation.decontaminate.leakverify for eval leaks,
curation.verify.pixels's structure check for copies): a template of one image's centre at a scale / mirror /
rotation, found at every position of the other by FFT correlation with a noise floor; at the best alignment, how many
blocks of the template carry structure and agree, and how unique the peak is (its margin over any alignment some
pixels away). A leaf: it imports neither verifier."""

from __future__ import annotations

import itertools

import numpy as np
import torch
import torch.nn.functional as F

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
FINE_MIN = 0.3  # the fine band's correlation at the coarse alignment a leak needs: a smooth surface (a colour
# gradient, an out-of-focus fundus) matches on the coarse band but not in detail (bench: 0.16-0.26 for those, 0.4-0.9
# for the leaks the coarse rules pass)
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


ONE_BLOCK_SCORE, ONE_BLOCK_MARGIN = 0.95, 0.05
# A copy whose structure sits in one block (a vessel in a dark fundus corner, a mark on paper): the aligned coarse
# correlation >= 0.95 and its peak 0.05 above any alignment 8 % away (bench: copies 0.96-0.999; the distinct pairs
# with one informative block reach 0.93, with margins <= 0.06)
ALIGNED_SCORE, ALIGNED_MARGIN = 0.8, 0.1
# A copy whose global score falls under the threshold (a smooth fundus tile or a sky re-encoded at low quality:
# 0.12-0.48 on the bench) while it aligns at scale 1 in >= MIN_BLOCKS blocks, every one agreeing, at one position:
# its aligned score is its verdict (bench, seeds 0 and 3 held out: copies grouped 0.939 / 0.898 / 0.900 -> 0.965 /
# 0.926 / 0.917 on mixed / retina / low-detail pools with this and the one-block rule, distinct pairs accepted unchanged)


def copy_score(band_a: torch.Tensor, band_b: torch.Tensor, score: float, threshold: float) -> float:
    """A copy pair's score after the structure check (``band_a``, ``band_b``: coarse bands; ``score``: the global
    correlation; scale about 1, no rotation: a web copy). Accepted above ``threshold`` only with structure that
    agrees in many places (COPY_BLOCKS, COPY_AGREE) or very closely in one (ONE_BLOCK_*), at one position
    (COPY_MARGIN): what a copy has and a chance match of two low-detail images -- one edge, a smooth gradient, a
    periodic texture -- has not; else 0. A pair under ``threshold`` that aligns in >= MIN_BLOCKS blocks, all
    agreeing, at one position (ALIGNED_*) scores its aligned correlation. curation.verify.pixels.PixelVerifier asks
    it of every pair with a positive global score."""
    with torch.no_grad():
        aligned, n_inf, agree, margin = agreement(band_a, band_b, (1.0, 1.0, False), angles=(0.0,))
    if score > threshold:
        many = n_inf >= COPY_BLOCKS and agree >= COPY_AGREE and margin >= COPY_MARGIN
        one = n_inf >= 1 and agree >= 1.0 and aligned >= ONE_BLOCK_SCORE and margin >= ONE_BLOCK_MARGIN
        return score if many or one else min(score, 0.0)
    if n_inf >= MIN_BLOCKS and agree >= 1.0 and aligned >= ALIGNED_SCORE and margin >= ALIGNED_MARGIN:
        return max(score, aligned)
    return score


def refined_score(cont: torch.Tensor, held: torch.Tensor, hyp: tuple) -> float:
    """The best correlation of ``held`` in ``cont`` at ``hyp`` refined (scale, rotation), every position."""
    return _refined(cont, held, hyp)[0]
