"""Constant padding of an image: rotation corners, borders, letterbox bars (black or white, flat, connected to the
image's border, shaped as a rotation or a frame gives it). The copy descriptor (curation.embed.descriptor) cuts a
frame of it away before the thumbnail; pixel verification (curation.verify.pixels, curation.decontaminate
.leakverify) masks it. A leaf: numpy and PIL only."""

from __future__ import annotations

import numpy as np
from PIL import Image

# Constant padding: pixels within PAD_TOL (RGB, [0, 1]) of the border's dominant colour, connected to the
# border, covering at least PAD_MIN of the image; grown by PAD_GROW px over the anti-aliased edge. The
# colour must be a fill colour (near black or near white: channels within PAD_EXTREME of 0 or 1) and the
# region flat (luma std < PAD_FLAT), so a smooth background of the content (sky, the mid-grey mortar of a
# brick wall) is never taken for one.
PAD_TOL, PAD_MIN, PAD_GROW, PAD_EXTREME, PAD_FLAT = 0.05, 0.01, 2, 0.1, 0.012


def _grow(m: np.ndarray) -> np.ndarray:
    g = m.copy()
    g[1:] |= m[:-1]
    g[:-1] |= m[1:]
    g[:, 1:] |= m[:, :-1]
    g[:, :-1] |= m[:, 1:]
    return g


def _flood(rgb: np.ndarray, colour: np.ndarray, tol: float) -> np.ndarray | None:
    """The pixels within ``tol`` of ``colour`` connected to the image border, if flat and shaped as padding."""
    cand = np.abs(rgb - colour).max(axis=-1) < tol
    m = np.zeros_like(cand)
    m[0], m[-1], m[:, 0], m[:, -1] = cand[0], cand[-1], cand[:, 0], cand[:, -1]
    for _ in range(2 * len(rgb)):  # flood fill from the border through padding-coloured pixels
        g = _grow(m) & cand
        if (g == m).all():
            break
        m = g
    if m.mean() < PAD_MIN or (rgb[m] @ np.array([0.299, 0.587, 0.114], np.float32)).std() > PAD_FLAT:
        return None
    # Padding has the shape a rotation, a crop or a letterbox gives: each of its pixels reaches a side of
    # the image along its row and the top or bottom along its column (corner triangles, bars). A dark or
    # white background around the content (a silhouette, a portrait) does not, and stays content.
    rows = np.cumprod(m, axis=1).astype(bool) | np.cumprod(m[:, ::-1], axis=1)[:, ::-1].astype(bool)
    cols = np.cumprod(m, axis=0).astype(bool) | np.cumprod(m[::-1], axis=0)[::-1].astype(bool)
    if (m & ~(rows & cols)).sum() > 0.05 * m.sum():
        return None
    return m


def padding_mask(rgb: np.ndarray) -> np.ndarray | None:
    """(S, S) bool: constant padding connected to the image border (rotation corners, flat margins),
    or None when there is none. ``rgb``: (S, S, 3) in [0, 1]."""
    frame = np.concatenate([rgb[0], rgb[-1], rgb[:, 0], rgb[:, -1]])  # (4S, 3) border pixels
    q = np.round(frame * 15).astype(np.int64) @ np.array([256, 16, 1])
    vals, cnt = np.unique(q, return_counts=True)
    if cnt.max() < 0.1 * len(q):  # no dominant border colour: no padding
        return None
    colour = np.median(frame[q == vals[cnt.argmax()]], axis=0)
    if not (colour.max() < PAD_EXTREME or colour.min() > 1 - PAD_EXTREME):
        return None
    m = _flood(rgb, colour, PAD_TOL)
    if m is None:  # the fill ran into content of nearly the fill colour: a frame of it may still be padding
        return _frame(rgb, colour)
    for _ in range(PAD_GROW):
        m = _grow(m)
    return m


FRAME_ROW = 0.98  # share of a row's (column's) pixels within PAD_TOL of the fill colour that makes it frame


def _frame(rgb: np.ndarray, colour: np.ndarray) -> np.ndarray | None:
    """The constant frame of an image whose content touches the fill colour (a white border around a bright
    micrograph: the fill runs into the content, so padding_mask's flood cannot bound it): the edge rows and columns
    that are the fill colour across, on two opposite sides at least (a border, letterbox bars), grown by PAD_GROW;
    None without one."""
    near = np.abs(rgb - colour).max(axis=-1) < PAD_TOL
    s = len(near)

    def run(ok: np.ndarray) -> int:  # leading rows of the frame
        return int(np.argmin(ok)) if not ok.all() else len(ok)

    rows, cols = near.mean(axis=1) >= FRAME_ROW, near.mean(axis=0) >= FRAME_ROW
    top, bottom, left, right = run(rows), run(rows[::-1]), run(cols), run(cols[::-1])
    if top + bottom >= s or left + right >= s or not ((top and bottom) or (left and right)):
        return None  # all fill, or flat on one side only (a dark sky, a page margin: content, not a frame)
    m = np.zeros_like(near)
    m[:top], m[s - bottom:], m[:, :left], m[:, s - right:] = True, True, True, True
    if m.mean() < PAD_MIN:
        return None
    for _ in range(PAD_GROW):
        m = _grow(m)
    return m


PROBE = 128  # side (px) at which padding is looked for
MIN_KEEP = 0.2  # an image whose content is less than this share of it is left as it is
CORNERS = 3  # corners of the content's box in padding from which the padding is a rotation's (filled)


def strip_padding(img: Image.Image) -> Image.Image:
    """``img`` (RGB) cut to the bounding box of its content -- a border or letterbox bars left out -- and, when padding
    sits in at least three corners of that box (a rotation's corners), that padding filled with the content's mean
    colour; ``img`` itself when it has no padding or hardly any content. Padding in one or two corners stays: the
    black surround of a fundus quadrant (one corner) is what tells the four quadrants of a photo apart. A border or
    a rotation then moves an image's thumbnail little more than a resize does (the precision bench's mixed /
    retina eval tiles: the descriptor's nearest eval view is the right tile for 0.13 / 0.07 -> 0.99 / 0.99 of
    those given a 4-12 % white border, 0.44 / 0.24 -> 0.96 / 0.80 of those rotated 2-8 degrees on black corners)."""
    small = np.asarray(img.resize((PROBE, PROBE), Image.BOX), dtype=np.float32) / 255.0
    m = padding_mask(small)
    if m is None or (~m).mean() < MIN_KEEP:
        return img
    ys, xs = np.nonzero(~m)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    inner = m[y0:y1, x0:x1]
    corners = int(inner[0, 0]) + int(inner[0, -1]) + int(inner[-1, 0]) + int(inner[-1, -1])
    if (y0, x0, y1, x1) == (0, 0, PROBE, PROBE) and corners < CORNERS:
        return img
    w, h = img.size
    out = img.crop((x0 * w // PROBE, y0 * h // PROBE, -(-x1 * w // PROBE), -(-y1 * h // PROBE)))
    if corners < CORNERS:
        return out
    x = np.asarray(out, dtype=np.float32).copy()
    pad = np.asarray(Image.fromarray(inner.astype(np.uint8) * 255).resize(out.size, Image.NEAREST)) > 127
    if pad.any() and (~pad).any():
        x[pad] = x[~pad].mean(axis=0)
    return Image.fromarray(np.clip(x + 0.5, 0, 255).astype(np.uint8))
