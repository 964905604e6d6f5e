"""The pools of bench/bench_curation_precision.py (and of tests/curation/test_decontam_verify.py): real photos
split by source photo, non-overlapping tiles, planted eval leaks and planted copies.

* **Sources.** ``dinopipe.data.samples.real_photos`` (the ~32 photos packages ship); names that come from one
  photograph (``retina_q0``..``q3``, ``china_left`` / ``_right``) are one source, except in the retina pool,
  where the four quadrants (disjoint pixels of one fundus photo) are the sources. Sources are dealt into thirds
  by a seeded permutation: the eval set is tiles of one third, the pool tiles of the other two, so nothing in
  the clean pool shares a pixel with the eval set.
* **Tiles.** Each source photo, resized by a per-pool factor, is cut into non-overlapping ``side``-px tiles
  written as JPEG (q90) at ``out`` px.
* **Pool kinds.** ``mixed``: every tile of every photo; ``retina``: one domain (fundus tiles, where every
  tile looks alike to a thumbnail descriptor); ``lowdetail``: the tiles with the least structure (sky,
  paper, scan background, the moon's and the deep field's dark sky): luma gradient energy in the lowest part of
  all tiles, but not constant (a constant tile is the same image whatever its source).
* **Leaks** (what decontamination must remove): an eval tile cropped to 50-100 % of each side (area >= 45 %),
  resized 0.6-1.6x, colour-changed (gain, contrast, saturation down to grey, hue), mirrored half the time,
  rotated up to 8 degrees, given a 4-12 % border half the time, re-encoded at JPEG q35-90 ('hard'); or one of
  those each, in turn ('single'); or issue 49's measured kinds ('mild').
* **Copies** (what dedup must group): a pool tile as the web copies it (``samples.make_copy``: resized to
  half, q30, cropped 5 %, all three) plus a brightness / contrast change.
"""

from __future__ import annotations

import io
import os
import re

import numpy as np
from PIL import Image, ImageOps

from dinopipe.data.samples import COPY_KINDS, make_copy, real_photos

_LUMA = np.array([0.299, 0.587, 0.114], np.float32)
POOL_KINDS = ("mixed", "retina", "lowdetail")


def source_of(name: str) -> str:
    """The photograph a real_photos name comes from."""
    return re.sub(r"(_q\d|_left|_right)$", "", name)


def tiles_of(arr: np.ndarray, side: int, factor: float) -> list[tuple[int, int, np.ndarray]]:
    """Non-overlapping ``side`` tiles of ``arr`` resized by ``factor``: (y, x, tile)."""
    if factor != 1.0:
        h, w = arr.shape[:2]
        arr = np.asarray(Image.fromarray(arr).resize((max(side, round(w * factor)), max(side, round(h * factor))),
                                                     Image.BICUBIC))
    return [(y, x, arr[y:y + side, x:x + side]) for y in range(0, arr.shape[0] - side + 1, side)
            for x in range(0, arr.shape[1] - side + 1, side)]


def detail(tile: np.ndarray) -> float:
    """Mean luma gradient magnitude (0-255 levels per px): how much structure a tile has."""
    y = tile.astype(np.float32) @ _LUMA
    return float(np.abs(np.diff(y, axis=0)).mean() + np.abs(np.diff(y, axis=1)).mean())


def jpeg(arr: np.ndarray, quality: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=int(quality))
    return buf.getvalue()


def leak(arr: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int, str]:
    """An eval image as it leaks into a pool: (pixels, JPEG quality, what was done)."""
    h, w = arr.shape[:2]
    while True:
        fy, fx = rng.uniform(0.5, 1.0, 2)
        if fy * fx >= 0.45:
            break
    ch, cw = max(8, round(h * fy)), max(8, round(w * fx))
    y0, x0 = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    img = Image.fromarray(arr[y0:y0 + ch, x0:x0 + cw])
    s = rng.uniform(0.6, 1.6)
    img = img.resize((max(16, round(cw * s)), max(16, round(ch * s))), Image.BICUBIC)
    x = np.asarray(img, np.float32)
    gray = x @ _LUMA
    sat = rng.uniform(0.0, 1.5)
    x = gray[..., None] + sat * (x - gray[..., None])
    x = (x - x.mean()) * rng.uniform(0.75, 1.3) + x.mean() * rng.uniform(0.75, 1.25)
    img = Image.fromarray(np.clip(x, 0, 255).astype(np.uint8))
    if rng.random() < 0.3:  # hue rotation
        hsv = np.asarray(img.convert("HSV")).copy()
        hsv[..., 0] = (hsv[..., 0].astype(np.int16) + int(rng.integers(20, 236))) % 256
        img = Image.fromarray(hsv, "HSV").convert("RGB")
    what = [f"crop{fy:.2f}x{fx:.2f}", f"scale{s:.2f}", f"sat{sat:.1f}"]
    if rng.random() < 0.5:
        img = ImageOps.mirror(img)
        what.append("flip")
    fill = tuple(int(v) for v in ((0, 0, 0), (255, 255, 255))[int(rng.integers(0, 2))])
    if rng.random() < 0.5:
        deg = float(rng.uniform(-8, 8))
        img = img.rotate(deg, Image.BICUBIC, expand=True, fillcolor=fill)
        what.append(f"rot{deg:.1f}")
    if rng.random() < 0.5:
        b = max(2, round(min(img.size) * rng.uniform(0.04, 0.12)))
        img = ImageOps.expand(img, border=b, fill=fill)
        what.append("border")
    q = int(rng.integers(35, 91))
    what.append(f"q{q}")
    return np.asarray(img), q, " ".join(what)


def leak_mild(arr: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int, str]:
    """An eval image leaked as issue 49 measured it: resized, cropped, re-lit or shifted, then re-encoded."""
    h, w = arr.shape[:2]
    kind = ("resize", "crop", "relight", "shift")[int(rng.integers(0, 4))]
    img = Image.fromarray(arr)
    if kind == "resize":
        s = rng.uniform(0.5, 1.5)
        img = img.resize((max(16, round(w * s)), max(16, round(h * s))), Image.BICUBIC)
    elif kind == "crop":
        fy, fx = rng.uniform(0.75, 0.95, 2)
        ch, cw = round(h * fy), round(w * fx)
        y0, x0 = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        img = img.crop((x0, y0, x0 + cw, y0 + ch))
    elif kind == "relight":
        x = np.asarray(img, np.float32)
        x = (x - x.mean()) * rng.uniform(0.8, 1.2) + x.mean() * rng.uniform(0.7, 1.3)
        img = Image.fromarray(np.clip(x, 0, 255).astype(np.uint8))
    else:  # shifted: the frame moved by 5-10 % (a crop on one side, the same size)
        dy, dx = (round(d * rng.uniform(0.05, 0.1)) for d in (h, w))
        img = img.crop((dx, dy, w, h)).resize((w, h), Image.BICUBIC)
    q = int(rng.integers(50, 91))
    return np.asarray(img), q, f"{kind} q{q}"


SINGLE_KINDS = ("crop", "resize", "colour", "mirror", "rotate", "border")


def leak_single(arr: np.ndarray, rng: np.random.Generator, j: int = 0) -> tuple[np.ndarray, int, str]:
    """An eval image leaked with one of what issue 49 lists (in turn, by ``j``): cropped to 50-95 % a side,
    resized 0.5-1.6x, colour-changed (saturation 0-1.5, gain, contrast, a hue rotation half the time), mirrored,
    rotated 2-8 degrees (canvas expanded: black or white corners), or given a 4-12 % border; then JPEG q35-90."""
    h, w = arr.shape[:2]
    kind = SINGLE_KINDS[j % len(SINGLE_KINDS)]
    img = Image.fromarray(arr)
    if kind == "crop":
        fy, fx = rng.uniform(0.5, 0.95, 2)
        ch, cw = round(h * fy), round(w * fx)
        y0, x0 = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        img, what = img.crop((x0, y0, x0 + cw, y0 + ch)), f"crop{fy:.2f}x{fx:.2f}"
    elif kind == "resize":
        f = rng.uniform(0.5, 1.6)
        img, what = img.resize((max(16, round(w * f)), max(16, round(h * f))), Image.BICUBIC), f"resize{f:.2f}"
    elif kind == "colour":
        x = np.asarray(img, np.float32)
        gray = x @ _LUMA
        sat = rng.uniform(0.0, 1.5)
        x = gray[..., None] + sat * (x - gray[..., None])
        x = (x - x.mean()) * rng.uniform(0.75, 1.3) + x.mean() * rng.uniform(0.75, 1.25)
        img, what = Image.fromarray(np.clip(x, 0, 255).astype(np.uint8)), f"sat{sat:.1f}"
        if rng.random() < 0.5:
            hsv = np.asarray(img.convert("HSV")).copy()
            hsv[..., 0] = (hsv[..., 0].astype(np.int16) + int(rng.integers(20, 236))) % 256
            img, what = Image.fromarray(hsv, "HSV").convert("RGB"), what + " hue"
    elif kind == "mirror":
        img, what = ImageOps.mirror(img), "mirror"
    else:
        fill = tuple(int(v) for v in ((0, 0, 0), (255, 255, 255))[int(rng.integers(0, 2))])
        if kind == "rotate":
            deg = float(rng.uniform(2, 8)) * (1 if rng.random() < 0.5 else -1)
            img, what = img.rotate(deg, Image.BICUBIC, expand=True, fillcolor=fill), f"rot{deg:.1f}"
        else:
            b = max(2, round(min(h, w) * rng.uniform(0.04, 0.12)))
            img, what = ImageOps.expand(img, border=b, fill=fill), f"border{b}"
    q = int(rng.integers(35, 91))
    return np.asarray(img), q, f"{what} q{q}"


def copy_of(arr: np.ndarray, rng: np.random.Generator, j: int) -> tuple[np.ndarray, int, str]:
    """A pool image as the web copies it: (pixels, JPEG quality, kind)."""
    kind = COPY_KINDS[j % len(COPY_KINDS)]
    x = make_copy(arr, kind).astype(np.float32)
    x = (x - x.mean()) * rng.uniform(0.85, 1.15) + x.mean() * rng.uniform(0.85, 1.15)
    return np.clip(x, 0, 255).astype(np.uint8), int(rng.integers(60, 91)), kind


def _sources(kind: str, photos: dict) -> dict[str, list[str]]:
    if kind == "retina":
        return {n: [n] for n in photos if n.startswith("retina_q")}
    out: dict[str, list[str]] = {}
    for n in sorted(photos):
        out.setdefault(source_of(n), []).append(n)
    return out


POOL_SETTINGS = {  # side (source px), resize factor of the photos, written side
    "mixed": (96, 1.0, 128),
    "retina": (64, 1.0, 128),
    "lowdetail": (96, 1.0, 128),
}


def build_pool(root: str, kind: str, seed: int = 0, n_leaks: int = 30, n_copies: int = 30,
               max_pool: int | None = None, max_eval: int | None = None, eval_third: int = 0,
               leaks: str = "hard") -> dict:
    """Write ``root/eval``, ``root/pool`` (``clean/``, ``leaks/``, ``copies/``) for one pool kind; return the
    truth: {"clean": [rel], "leaks": [[pool rel, eval rel, what]], "copies": [[original rel, copy rel, what]],
    "eval": [rel], "sources": {"eval": [...], "pool": [...]}}. Paths relative to root/pool and root/eval.
    ``leaks``: 'hard' (:func:`leak`: all of them at once), 'single' (:func:`leak_single`: one of them each) or
    'mild' (:func:`leak_mild`, issue 49's measured setup)."""
    photos = real_photos()
    rng = np.random.default_rng(seed)
    srcs = _sources(kind, photos)
    names = sorted(srcs)
    order = [names[i] for i in rng.permutation(len(names))]
    thirds = [order[i::3] for i in range(3)]
    eval_src = sorted(thirds, key=len)[eval_third % 3]  # the smallest third: the eval set
    pool_src = [s for s in order if s not in eval_src]
    side, factor, out = POOL_SETTINGS[kind]

    def cut(src_names):
        got = []
        for s in sorted(src_names):
            for n in srcs[s]:
                for y, x, t in tiles_of(photos[n], side, factor):
                    got.append((f"{n}_{y:04d}_{x:04d}.jpg", t))
        if kind == "lowdetail":
            got = [(r, t) for r, t in got if _low_detail(t)]
        return got

    ev, pool = cut(eval_src), cut(pool_src)
    ev = [ev[i] for i in sorted(rng.permutation(len(ev))[:max_eval or len(ev)])]
    pool = [pool[i] for i in sorted(rng.permutation(len(pool))[:max_pool or len(pool)])]
    resize = (lambda t: np.asarray(Image.fromarray(t).resize((out, out), Image.BICUBIC))) if out != side else \
        (lambda t: t)
    truth = {"kind": kind, "seed": seed, "clean": [], "leaks": [], "copies": [], "eval": [],
             "sources": {"eval": eval_src, "pool": pool_src}}
    for rel, t in ev:
        _write(os.path.join(root, "eval", rel), jpeg(resize(t), 90))
        truth["eval"].append(rel)
    for rel, t in pool:
        _write(os.path.join(root, "pool", "clean", rel), jpeg(resize(t), 90))
        truth["clean"].append("clean/" + rel)
    for j, i in enumerate(rng.permutation(len(ev))[:n_leaks]):
        rel, t = ev[i]
        px, q, what = (leak(resize(t), rng) if leaks == "hard" else leak_single(resize(t), rng, j)
                       if leaks == "single" else leak_mild(resize(t), rng))
        p = f"leaks/{j:03d}_{rel}"
        _write(os.path.join(root, "pool", p), jpeg(px, q))
        truth["leaks"].append([p, rel, what])
    for j, i in enumerate(rng.permutation(len(pool))[:n_copies]):
        rel, t = pool[i]
        px, q, what = copy_of(resize(t), rng, j)
        p = f"copies/{j:03d}_{rel}"
        _write(os.path.join(root, "pool", p), jpeg(px, q))
        truth["copies"].append(["clean/" + rel, p, what])
    return truth


def _low_detail(t: np.ndarray) -> bool:
    """Little structure, but not constant: gradient energy 0.4-3 levels per px, luma std >= 1.5."""
    y = t.astype(np.float32) @ _LUMA
    return 0.4 <= detail(t) <= 3.0 and y.std() >= 1.5


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
