"""Robust image decoding: every input either becomes an RGB image or gets a short reason.

Web-scale pools contain empty files, cut-off downloads, HTML error pages saved as ``.jpg``,
decompression bombs, CMYK JPEGs, 16-bit PNGs, palette GIFs, transparent PNGs and phone photos
whose orientation lives in EXIF. ``.npy`` arrays and TIFFs of any band count or bit depth come back as
their documented 3-channel rendering (:mod:`.channels`). :func:`safe_decode` never raises; the curation manifest and the
training loader count the reasons instead of crashing or silently dropping files.
"""

from __future__ import annotations

import io
import struct
import warnings
from typing import Callable, Optional

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from .arrays import ArrayTooLarge, is_npy, is_tiff, read_array, render_rgb

# Stable reason strings (they appear in manifest.json; keep them short and unchanged).
EMPTY = "empty"  # zero bytes
READ_ERROR = "read_error"  # the bytes could not be read (missing file, damaged tar shard)
NOT_AN_IMAGE = "not_an_image"  # no image format recognises the bytes
TRUNCATED = "truncated"  # recognised, but the data stops early or is corrupt
TOO_LARGE = "too_large"  # more pixels than max_pixels (decompression-bomb guard)
BAD_MODE = "bad_mode"  # decoded, but a pixel format we cannot turn into RGB
MISSING = "missing"  # an object listed, then deleted from its bucket (dinopipe.utils.storage)
CHANGED = "changed"  # an object replaced since the listing (its ETag or size differs)
REASONS = (EMPTY, READ_ERROR, NOT_AN_IMAGE, TRUNCATED, TOO_LARGE, BAD_MODE, MISSING, CHANGED)

# 8192 x 12288 ~ 100 MP: above any camera most pools contain, far below what exhausts RAM
# (an RGB image of this size is 300 MB once decoded).
DEFAULT_MAX_PIXELS = 100_000_000

# Never decode partial files as if they were whole (Pillow's global switch must stay off).
ImageFile.LOAD_TRUNCATED_IMAGES = False


def safe_decode(data: bytes | None, max_pixels: int = DEFAULT_MAX_PIXELS,
                background: tuple[int, int, int] = (255, 255, 255),
                draft: Optional[Callable[[tuple[int, int]], Optional[tuple[int, int]]]] = None
                ) -> tuple[Image.Image | None, str | None]:
    """Decode ``data`` to an upright RGB image: ``(image, None)`` or ``(None, reason)``.

    ``draft``: upright full size (w, h) -> the smallest size (w, h) the caller needs, or None; a JPEG is then
    decoded at the largest DCT reduction (1/2, 1/4, 1/8) that keeps it at least that large (Pillow's
    ``draft``), and the image carries its full upright size in ``info["full_size"]``.

    Transparent images are composited on ``background`` (white by default, like a browser page)
    rather than having their alpha dropped, which would expose arbitrary hidden colours.
    """
    if data is None:
        return None, READ_ERROR
    if len(data) == 0:
        return None, EMPTY
    if is_npy(data) or is_tiff(data):  # any band count and bit depth: the 3-channel rendering (channels.py)
        rendered = _render_array(data, max_pixels)
        if rendered is not None:
            return rendered
    try:
        with warnings.catch_warnings():
            # Our own pixel limit below replaces Pillow's bomb warning.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size  # from the header: cheap, before any pixel is decoded
            if w <= 0 or h <= 0:
                return None, TRUNCATED
            if w * h > max_pixels:
                return None, TOO_LARGE
            full = _apply_draft(img, draft) if draft is not None else None
            img.load()
    except UnidentifiedImageError:
        return None, NOT_AN_IMAGE
    except Image.DecompressionBombError:
        return None, TOO_LARGE
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error):
        return None, TRUNCATED
    except MemoryError:
        return None, TOO_LARGE
    except Exception:  # a decoder bug must not stop a billion-image run
        return None, TRUNCATED
    try:
        img = _upright(img)
        rgb = to_rgb(img, background)
    except Exception:
        return None, BAD_MODE
    if full is not None:
        rgb.info["full_size"] = full
    return rgb, None


def _apply_draft(img: Image.Image, draft: Callable) -> Optional[tuple[int, int]]:
    """Ask a JPEG for a reduced-scale decode; returns the full upright size (w, h) when it took effect."""
    if img.format != "JPEG":
        return None
    w, h = img.size
    turned = img.getexif().get(0x0112, 1) in (5, 6, 7, 8)  # EXIF orientations that swap width and height
    up = (h, w) if turned else (w, h)
    want = draft(up)
    if want is None:
        return None
    img.draft(None, tuple(want[::-1]) if turned else tuple(want))
    return up if img.size != (w, h) else None


def _render_array(data: bytes, max_pixels: int) -> tuple[Image.Image | None, str | None] | None:
    """npy / TIFF through their own readers, as channels.render_rgb draws them; None hands a TIFF tifffile
    cannot read (e.g. palette, or a compression it lacks) to Pillow."""
    try:
        return render_rgb(read_array(data, max_pixels)), None
    except ArrayTooLarge:
        return None, TOO_LARGE
    except MemoryError:
        return None, TOO_LARGE
    except Exception:
        return None if is_tiff(data) else (None, TRUNCATED)


def _upright(img: Image.Image) -> Image.Image:
    """Apply the EXIF orientation; a damaged EXIF block keeps the image as stored."""
    try:
        return ImageOps.exif_transpose(img)
    except Exception:
        return img


def to_rgb(img: Image.Image, background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB, scaling high-bit-depth data instead of clipping it."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode == "P":
        # Palette images may carry transparency in info; go through RGBA to honour it.
        img = img.convert("RGBA") if "transparency" in img.info else img.convert("RGB")
        mode = img.mode
    if mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = img.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, background + (255,))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    if mode.startswith("I") or mode == "F":
        return _high_bit_depth_to_rgb(img)
    if mode == "1":
        return img.convert("L").convert("RGB")
    # L, CMYK, YCbCr, LAB, HSV: Pillow's converters handle these correctly.
    return img.convert("RGB")


def _high_bit_depth_to_rgb(img: Image.Image) -> Image.Image:
    """16/32-bit integer or float grey images: ``convert('RGB')`` would clip at 255 (all white)."""
    arr = np.asarray(img).astype(np.float64)
    if img.mode.startswith("I;16") or (img.mode == "I" and arr.max(initial=0) > 255):
        arr = arr / 257.0  # 16-bit range 0..65535 -> 0..255
    elif img.mode == "F":
        lo, hi = float(arr.min(initial=0)), float(arr.max(initial=0))
        if 0.0 <= lo and hi <= 1.0:
            arr = arr * 255.0  # float images in [0, 1]
        elif hi > 255.0:
            arr = (arr - lo) / max(hi - lo, 1e-12) * 255.0
    grey = np.clip(np.rint(arr), 0, 255).astype(np.uint8)
    return Image.fromarray(grey).convert("RGB")


def decode_or_raise(data: bytes | None, where: str = "", **kwargs) -> Image.Image:
    """Like :func:`safe_decode` but raises ``ValueError`` naming the file (for interactive use)."""
    img, reason = safe_decode(data, **kwargs)
    if img is None:
        raise ValueError(f"cannot decode image {where or '<bytes>'}: {reason}")
    return img
