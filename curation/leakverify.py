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

from .verify import PixelVerifier

DEFAULT_THRESHOLD = 0.5
"""Noise-aware normalised correlation above which a candidate is a view of its eval image (bench figures:
docs/curation.md, "Decontamination")."""
NOISE = 0.0007
"""Band-pass std (luma in [0, 1]) counted as noise: JPEG q35-90 and resampling measure ~0.001-0.002 on flat
regions of the bench's tiles."""
GRID, MIN_BLOCKS, AGREE, BLOCK_NCC = 3, 4, 0.75, 0.3
SCALES = (1.0, 0.82, 0.67, 0.55)
INNER = 0.9  # the template is the contained image's central 90 % (crop edges, rotation corners left out)


def _templates(d: torch.Tensor, ty: int, tx: int, sy: float, sx: float, flip: bool, c: int) -> torch.Tensor:
    """(B, c, c): the central INNER part of each (c, c) band in ``d`` resampled into a (ty, tx) template at the
    top-left of a zero canvas (zero-mean over the template, unit noise-aware norm)."""
    ly = torch.linspace(-INNER, INNER, ty, device=d.device)
    lx = torch.linspace(-INNER, INNER, tx, device=d.device) * (-1.0 if flip else 1.0)
    gy, gx = torch.meshgrid(ly, lx, indexing="ij")
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


def best_alignment(cont: torch.Tensor, held: torch.Tensor, hyps: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    """Best noise-aware correlation of ``held``'s templates in ``cont`` (both (B, c, c)) over ``hyps``
    ((sy, sx, flip) each) and every position: (score (B,), hypothesis index (B,))."""
    b, c = cont.shape[0], cont.shape[-1]
    fc = torch.fft.rfft2(cont)
    best = torch.full((b,), -2.0, device=cont.device)
    arg = torch.zeros(b, dtype=torch.long, device=cont.device)
    for h, (sy, sx, flip) in enumerate(hyps):
        ty, tx = max(4, round(INNER * sy * c)), max(4, round(INNER * sx * c))
        ft = torch.fft.rfft2(_templates(held, ty, tx, sy, sx, flip, c))
        corr = torch.fft.irfft2(fc * ft.conj(), s=(c, c))[:, :c - ty + 1, :c - tx + 1]
        score = (corr / _window_energy(cont, ty, tx)).flatten(1).max(dim=1).values
        better = score > best
        best, arg = torch.where(better, score, best), torch.where(better, torch.full_like(arg, h), arg)
    return best, arg


def agreement(cont: torch.Tensor, held: torch.Tensor, hyp: tuple) -> tuple[float, int, float]:
    """At ``hyp``'s best position at full resolution (``cont``, ``held``: (c, c) bands): (score, informative
    blocks, share of them agreeing)."""
    c = cont.shape[-1]
    sy, sx, flip = hyp
    ty, tx = max(4, round(INNER * sy * c)), max(4, round(INNER * sx * c))
    tpl = _templates(held[None], ty, tx, sy, sx, flip, c)
    corr = torch.fft.irfft2(torch.fft.rfft2(cont[None]) * torch.fft.rfft2(tpl).conj(), s=(c, c))
    corr = corr[:, :c - ty + 1, :c - tx + 1] / _window_energy(cont[None], ty, tx)
    flat = int(corr.flatten().argmax())
    y, x = divmod(flat, corr.shape[-1])
    win, t = cont[y:y + ty, x:x + tx], tpl[0, :ty, :tx]
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
    return float(corr.flatten()[flat]), n_inf, (n_ok / n_inf if n_inf else 0.0)


def hypotheses(min_scale: float = 0.5, flips: bool = True) -> list[tuple]:
    scales = [s for s in SCALES if s >= min_scale - 1e-9]
    return [(sy, sx, f) for sy in scales for sx in scales for f in ((False, True) if flips else (False,))]


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

    def _pair_bands(self, fa, fb):
        """The band both images are compared on: fine when both have fine detail, else coarse."""
        fine = min(fa[1], fb[1]) >= 2.5 * NOISE
        k = 0 if fine else 2
        return fa[k], fb[k]

    def scores(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        out = np.full(len(a), -1.0, np.float32)
        self.last_detail = np.zeros((len(a), 2), np.float32)
        for i, (pa, pb) in enumerate(zip(a, b)):
            self.n_pairs += 1
            fa, fb = self._get(pa), self._get(pb)
            if fa is None or fb is None:
                continue
            ba, bb = (x.to(self.device) for x in self._pair_bands(fa, fb))
            out[i], inf, agree = self._score_pair(ba, bb)
            self.last_detail[i] = (inf, agree)
            if inf < MIN_BLOCKS or agree < AGREE:
                out[i] = min(out[i], 0.0)  # structure in too few places, or a match in one place only
        return out

    def _score_pair(self, ea: torch.Tensor, pb: torch.Tensor) -> tuple[float, int, float]:
        with torch.no_grad():
            ca, cb = (F.avg_pool2d(x[None, None], 2)[0] for x in (ea, pb))
            conts, helds = torch.cat([ca, cb]), torch.cat([cb, ca])  # pool in eval, eval in pool
            best, arg = best_alignment(conts, helds, self.hyps)
            d = int(best.argmax())
            hyp = self.hyps[int(arg[d])]
            cont, held = (ea, pb) if d == 0 else (pb, ea)
            return agreement(cont, held, hyp)


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
