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
from functools import lru_cache
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from curation.core.padding import padding_mask
from curation.verify.alignment import copy_score

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


@lru_cache(maxsize=16)
def _blur_matrix(n: int, sigma: float) -> torch.Tensor:
    """(n, n) matrix G with ``G @ x`` = the reflect-padded 1-D Gaussian blur of x (taps folded back at the
    edges as ``F.pad(mode='reflect')`` mirrors them), so a 2-D blur is two small matmuls."""
    k = _gauss_kernel(sigma).double()
    r = len(k) // 2
    i = torch.arange(n)[:, None] + torch.arange(-r, r + 1)[None, :]  # (n, taps) source index
    if n == 1:
        i = torch.zeros_like(i)
    else:  # reflected as often as needed: a side shorter than the kernel's radius (a letterboxed 128 x 25 view)
        i = torch.remainder(i, 2 * (n - 1))
        i = torch.where(i >= n, 2 * (n - 1) - i, i)
    g = torch.zeros(n, n, dtype=torch.float64)
    g.scatter_add_(1, i, k.expand(n, -1).contiguous())
    return g.float()


def gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of (..., H, W), reflect-padded."""
    gh = _blur_matrix(x.shape[-2], sigma).to(x.device)
    gw = _blur_matrix(x.shape[-1], sigma).to(x.device)
    return gh @ x @ gw.T


MIN_CONTENT = 0.05  # below this share of non-padding pixels an image counts as blank
FILL_SIGMA = 6.0  # px: the smooth fill of the padding (normalised convolution of the content)


class PixelVerifier:
    """``verifier(a, b) -> (P,) bool``: which candidate pairs (positions) are verified copies.

    ``read(position) -> PIL.Image | None`` gives pixels; features of recently read images are
    cached (``cache_size`` images of ``size``² float32), so pairs sorted by their first image
    decode each image about once. Per batch of ``batch_pairs`` pairs, every distinct image's FFT
    and template bank is computed once; per pair remain one inverse FFT per scale hypothesis
    (``len(scales)²``, at half resolution) and one at full resolution. ``device``: 'cpu', 'cuda' or
    'auto' (:func:`dinopipe.utils.device.pick_device`); decoding stays on the CPU.
    """

    def __init__(self, read: Callable[[int], Image.Image | None], size: int = 128,
                 threshold: float = DEFAULT_THRESHOLD, scales=(0.96, 1.0, 1.04),
                 max_shift: float = 0.08, sigmas=(1.0, 3.0), cache_size: int = 4096,
                 batch_pairs: int = 512, device: str | torch.device = "cpu", structure: bool = True):
        from dinopipe.utils.device import pick_device

        self.device = pick_device(device, "dedup.verify_device")
        self.read, self.size, self.threshold = read, size, threshold
        self.scales, self.max_shift, self.sigmas = tuple(scales), max_shift, tuple(sigmas)
        self.cache_size, self.batch_pairs = cache_size, batch_pairs
        self.structure = structure  # accepted pairs must also match with structure in many places, at one position
        self._cache: OrderedDict[int, tuple] = OrderedDict()
        self.n_pairs = 0
        self.n_reads = 0

    def digest_key(self) -> dict:
        """The settings that change a verdict (curation.verify.tasks.verifier_key: a part verified with other
        settings is not reused)."""
        return {"size": self.size, "threshold": float(self.threshold), "scales": list(self.scales),
                "max_shift": float(self.max_shift), "sigmas": list(self.sigmas)}

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
                fill = gaussian_blur(luma * v, FILL_SIGMA) / gaussian_blur(v, FILL_SIGMA).clamp_min(1e-6)
                luma = torch.where(v > 0, luma, fill)
        b0, b1, b2 = (gaussian_blur(luma, sg) for sg in (self.sigmas[0], self.sigmas[1], 3 * self.sigmas[1]))
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
        return torch.stack(grids).to(self.device), t

    @staticmethod
    def _templates(b: torch.Tensor, grids: torch.Tensor, s: int) -> torch.Tensor:
        """FFTs (B, K, S, S/2+1) of b's centre resampled at each of the K grids, zero-mean, unit norm."""
        nb, k = b.shape[0], grids.shape[0]
        src = b[:, None, None].expand(nb, k, 1, s, s).reshape(nb * k, 1, s, s)
        tpl = F.grid_sample(src, grids.repeat(nb, 1, 1, 1), mode="bilinear", align_corners=False)[:, 0]
        tpl = tpl - tpl.mean(dim=(-2, -1), keepdim=True)
        tpl = tpl / tpl.flatten(1).norm(dim=1).clamp_min(1e-8)[:, None, None]
        return torch.fft.rfft2(tpl, s=(s, s)).view(nb, k, s, -1)

    @staticmethod
    def _image_side(a: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(FFT (A, S, S/2+1), sqrt of a's energy under every template position (A, n, n)): box sums
        from a summed-area table; the template has zero mean, so a's local mean drops out."""
        def box(x):
            c = F.pad(x.cumsum(1).cumsum(2), (1, 0, 1, 0))
            return c[:, t:, t:] - c[:, :-t, t:] - c[:, t:, :-t] + c[:, :-t, :-t]

        tot = box(a)
        # floor: a window with no energy (masked padding) would divide FFT round-off by ~0 (scores of 2-150)
        var = (box(a * a) - tot * tot / (t * t)).clamp_min(FLAT_ENERGY ** 2 * t * t)
        return torch.fft.rfft2(a), var.sqrt()

    @staticmethod
    def _ncc(fa: torch.Tensor, sd: torch.Tensor, ft: torch.Tensor, s: int, t: int):
        """Best normalised correlation over shifts and hypotheses, per pair: ``fa`` (P, S, S/2+1) and
        ``sd`` (P, n, n) of the first images, ``ft`` (P, K, S, S/2+1) templates of the second.
        Returns (best (P,), best hypothesis (P,))."""
        n = s - t + 1  # shifts per axis
        corr = torch.fft.irfft2(fa[:, None] * ft.conj(), s=(s, s))[..., :n, :n]  # (P, K, n, n)
        ncc = (corr / sd[:, None]).flatten(2).max(dim=2).values  # (P, K)
        return ncc.max(dim=1)

    def _score_textured(self, fa_u: torch.Tensor, fb_u: torch.Tensor, ia: np.ndarray, ib: np.ndarray):
        """Coarse to fine: every scale hypothesis at half resolution, the best one at full. ``fa_u``/``fb_u``:
        bands of the distinct first / second images; ``ia``/``ib``: each pair's rows in them. Per distinct
        image its FFT and template bank are computed once (not once per pair)."""
        ia, ib = torch.from_numpy(ia).to(self.device), torch.from_numpy(ib).to(self.device)
        ca, cb = F.avg_pool2d(fa_u[:, None], 2)[:, 0], F.avg_pool2d(fb_u[:, None], 2)[:, 0]
        cs = ca.shape[-1]
        coarse_grid, ct = self._grid(cs)
        fca, sdc = self._image_side(ca, ct)
        _, arg = self._ncc(fca[ia], sdc[ia], self._templates(cb, coarse_grid, cs)[ib], cs, ct)
        fine_grid, t = self._grid(self.size)
        s = self.size
        fa, sd = self._image_side(fa_u, t)
        src = fb_u[ib][:, None]  # (P, 1, S, S): one template per pair, at its best hypothesis
        tpl = F.grid_sample(src, fine_grid[arg], mode="bilinear", align_corners=False)[:, 0]
        tpl = tpl - tpl.mean(dim=(-2, -1), keepdim=True)
        tpl = tpl / tpl.flatten(1).norm(dim=1).clamp_min(1e-8)[:, None, None]
        ft = torch.fft.rfft2(tpl, s=(s, s))[:, None]
        best, _ = self._ncc(fa[ia], sd[ia], ft, s, t)
        return best

    def scores(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """(P,) verification score of each pair (a[i], b[i]) in [-1, 1] (b's centre found in a).

        Callers pass pairs in a canonical order (``copy_dedup_from_pairs``: smaller id first, sorted),
        so the decision about a pair never depends on which side the kNN found it from, and pairs
        sharing an image come together: each image is decoded once (the feature cache) and its FFTs
        computed once per batch. Classification is vectorised; the correlations run on ``device``."""
        a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        out = np.zeros(len(a), np.float32)
        for start in range(0, len(a), self.batch_pairs):
            sa, sb = a[start:start + self.batch_pairs], b[start:start + self.batch_pairs]
            self.n_pairs += len(sa)
            u = np.unique(np.concatenate([sa, sb]))
            feats = [self._get(i) for i in u]
            ia, ib = np.searchsorted(u, sa), np.searchsorted(u, sb)
            ok = np.array([f is not None for f in feats])
            fstd = np.array([f[1] if f is not None else 0.0 for f in feats])
            cstd = np.array([f[3] if f is not None else 0.0 for f in feats])
            mean = np.stack([f[4] if f is not None else np.zeros(3, np.float32) for f in feats])
            both = ok[ia] & ok[ib]  # unreadable: never a verified copy
            fine = both & (np.minimum(fstd[ia], fstd[ib]) >= LOW_ENERGY)
            coarse = both & ~fine & (np.minimum(cstd[ia], cstd[ib]) >= FLAT_ENERGY)  # sky, blur: coarser
            blank = both & ~fine & ~coarse & (np.maximum(cstd[ia], cstd[ib]) < FLAT_ENERGY)
            out[start + np.flatnonzero(blank)] = (np.abs(mean[ia] - mean[ib]).max(axis=1) < 0.06)[blank]
            for band, job in ((0, fine), (2, coarse)):
                idx = np.flatnonzero(job)
                if not len(idx):
                    continue
                ua, ja = np.unique(ia[idx], return_inverse=True)
                ub, jb = np.unique(ib[idx], return_inverse=True)
                with torch.no_grad():
                    fa_u = torch.stack([feats[i][band] for i in ua]).to(self.device)
                    fb_u = torch.stack([feats[i][band] for i in ub]).to(self.device)
                    sc = self._score_textured(fa_u, fb_u, ja.ravel(), jb.ravel())
                out[start + idx] = sc.float().cpu().numpy()
                if self.structure:
                    self._structure_check(out, start, idx, feats, ia, ib, band)
        return out

    def _structure_check(self, out, start, idx, feats, ia, ib, band) -> None:
        """The structure check (curation.verify.alignment.copy_score) on the pairs with a positive global score:
        accepted pairs that match along one edge, on a smooth gradient or a periodic texture only (no local
        agreement, or no unique alignment) score 0 -- low-detail images of different sources pass the global
        correlation that way (docs/curation-scale.md measured 0.55-0.73) -- and a pair under the threshold that
        aligns everywhere it has structure scores its aligned correlation."""
        for j in idx[out[start + idx] > 0]:
            fa, fb = feats[ia[j]], feats[ib[j]]
            out[start + j] = copy_score(fa[2].to(self.device), fb[2].to(self.device),  # coarse: JPEG-proof
                                        float(out[start + j]), self.threshold)

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


class PartedVerifier:
    """``verifier(a, b)`` run as ``num_tasks`` tasks of the step runner, each owning the pairs whose first image
    falls in its range of positions (curation.core.runner.owned_pairs: the pairs split evenly at image
    boundaries, so an image's pairs and its decode stay in one task: the verifier's feature cache decodes it
    once). Each task writes ``<parts_dir>/callC-part-TTTTT-of-WWWWW.npz`` (its verdicts and a digest of its
    pairs; ``callC-`` per call) atomically; a rerun, or a killed task's rerun, skips parts already written
    for the same pairs.

    ``launcher='inline'`` (or one task): the tasks one after another in this process, with ``verifier`` (or
    one ``factory()``); ``'local'``: W fresh processes, each building its verifier with ``factory`` (a
    picklable callable, e.g. a functools.partial of :func:`curation.dedup.hash_step.pixel_verifier_of`), reading
    the call's pairs from ``<parts_dir>/callC-pairs.npz``."""

    def __init__(self, verifier: Callable | None, parts_dir: str, num_tasks: int = 1, launcher: str = "inline",
                 factory: Callable | None = None, scores: bool = False):
        if verifier is None and factory is None:
            raise ValueError("PartedVerifier needs a verifier or a factory")
        self.verifier, self.factory, self.parts_dir = verifier, factory, parts_dir
        self.num_tasks, self.launcher = max(1, int(num_tasks)), launcher
        self.computed = 0
        self.calls = 0  # copy_dedup_from_pairs verifies twice (candidates, then lone images): parts per call
        self.reports: list[dict] = []
        self.scores = scores  # True: each pair's verifier.scores (float32) in place of its verdict

    def _part(self, a: np.ndarray, task_index: int) -> np.ndarray:
        from curation.core.runner import owned_pairs

        return owned_pairs(a, task_index, self.num_tasks)

    def task(self, a: np.ndarray, b: np.ndarray, task_index: int, call: int = 0) -> np.ndarray:
        ok, computed = _verify_part(self._verifier, a, b, task_index, self.num_tasks, self.parts_dir, call,
                                    self.scores)
        self.computed += computed
        return ok

    def _verifier(self):
        if self.verifier is None:
            self.verifier = self.factory()
        return self.verifier

    def __call__(self, a, b) -> np.ndarray:
        a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        out = np.zeros(len(a), np.float32 if self.scores else bool)
        call, self.calls = self.calls, self.calls + 1
        if self.launcher != "inline" and self.factory is not None:  # W processes (W = 1: tasks.isolate)
            import os

            from dinopipe.utils.io import atomic_path

            from curation.core.runner import launch, run_step

            os.makedirs(self.parts_dir, exist_ok=True)
            pairs = os.path.join(self.parts_dir, f"call{call}-pairs.npz")
            with atomic_path(pairs, suffix=".npz") as tmp:
                np.savez(tmp, a=a, b=b)
            got = run_step(verify_pairs_task, self.num_tasks, **launch(self.launcher, self.num_tasks), pairs=pairs,
                           parts_dir=self.parts_dir, call=call, factory=self.factory, scores=self.scores)
            self.reports += got
            for t, g in enumerate(got):
                out[self._part(a, t)] = _read_ok(self.parts_dir, call, t, self.num_tasks)
                self.computed += g["result"]["computed"]
            os.remove(pairs)
            return out
        if self.factory is not None and self.verifier is None:  # the tasks inline, each its own verifier
            from curation.core.runner import run_step

            for t, g in enumerate(run_step(verify_arrays_task, self.num_tasks, "local", processes=0, a=a, b=b,
                                           parts_dir=self.parts_dir, call=call, factory=self.factory,
                                           scores=self.scores)):
                out[self._part(a, t)] = _read_ok(self.parts_dir, call, t, self.num_tasks)
                self.computed += g["result"]["computed"]
            return out
        for t in range(self.num_tasks):
            out[self._part(a, t)] = self.task(a, b, t, call)
        return out


def _part_file(parts_dir: str, call: int, task_index: int, num_tasks: int) -> str:
    import os

    return os.path.join(parts_dir, f"call{call}-part-{task_index:05d}-of-{num_tasks:05d}.npz")


def _read_ok(parts_dir: str, call: int, task_index: int, num_tasks: int) -> np.ndarray:
    with np.load(_part_file(parts_dir, call, task_index, num_tasks), allow_pickle=False) as z:
        return z["ok"]


def _verify_part(get_verifier: Callable, a: np.ndarray, b: np.ndarray, task_index: int, num_tasks: int,
                 parts_dir: str, call: int, scores: bool = False) -> tuple[np.ndarray, int]:
    """(verdicts of task ``task_index``'s pairs, 1 if computed here / 0 if read back from its part).
    ``scores``: the verifier's scores (float32) in place of its verdicts."""
    import hashlib
    import os

    from dinopipe.utils.io import atomic_path

    from curation.core.runner import owned_pairs

    sel = owned_pairs(a, task_index, num_tasks)
    digest = hashlib.sha1(np.ascontiguousarray(a[sel]).tobytes() + np.ascontiguousarray(b[sel]).tobytes()
                          ).hexdigest()[:16]
    path = _part_file(parts_dir, call, task_index, num_tasks)
    if os.path.exists(path):
        with np.load(path, allow_pickle=False) as z:
            if str(z["digest"]) == digest:
                return z["ok"], 0
    if scores:
        ok = np.asarray(get_verifier().scores(a[sel], b[sel]), np.float32) if len(sel) else np.zeros(0, np.float32)
    else:
        ok = np.asarray(get_verifier()(a[sel], b[sel]), bool) if len(sel) else np.zeros(0, bool)
    os.makedirs(parts_dir, exist_ok=True)
    with atomic_path(path, suffix=".npz") as tmp:
        np.savez(tmp, ok=ok, digest=np.array(digest))
    return ok, 1


def verify_arrays_task(t: int, w: int, a: np.ndarray, b: np.ndarray, parts_dir: str, call: int,
                       factory: Callable, scores: bool = False) -> dict:
    """Inline runner task ``t`` of ``w`` of one verification call (the pairs passed as arrays)."""
    ok, computed = _verify_part(factory, a, b, t, w, parts_dir, call, scores)
    return {"pairs": int(len(ok)), "computed": computed}


def verify_pairs_task(t: int, w: int, pairs: str, parts_dir: str, call: int, factory: Callable,
                      scores: bool = False) -> dict:
    """Runner task ``t`` of ``w`` of one verification call: its pairs of ``pairs`` (.npz: a, b), verified by
    ``factory()``'s verifier (built here: one feature cache per task), written as its part."""
    with np.load(pairs, allow_pickle=False) as z:
        a, b = z["a"], z["b"]
    ok, computed = _verify_part(factory, a, b, t, w, parts_dir, call, scores)
    return {"pairs": int(len(ok)), "computed": computed}
