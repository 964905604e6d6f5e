"""Real photographs that load offline, and planted copies of them, for curation/data tests.

Sources: scikit-image's bundled sample images (those that need a download are skipped),
scikit-learn's two sample photos and matplotlib's Grace Hopper portrait. Large photos also give
non-overlapping crops (different regions are different pictures). Copies are made the way the web
makes them: resized, JPEG-recompressed, slightly cropped.
"""

from __future__ import annotations

import io
import os
import struct
import zlib

import numpy as np
from PIL import Image

# the product's own loaders and copy makers (bench/ uses them too)
from dinopipe.data.samples import COPY_KINDS, encode, make_copy, real_photos  # noqa: F401


def write_pool(root: str, copies_of: list[str] | None = None, kinds=COPY_KINDS,
               photos: dict[str, np.ndarray] | None = None) -> dict[str, list[str]]:
    """Write every distinct photo as ``<root>/<name>.jpg`` plus planted copies.

    Copies of photo ``n`` are ``<root>/copies/<n>__<kind>.jpg``. Returns
    ``{photo name: [relative paths of the photo and its copies]}`` (the duplicate groups).
    """
    photos = photos if photos is not None else real_photos()
    copies_of = copies_of or []
    os.makedirs(os.path.join(root, "copies"), exist_ok=True)
    groups: dict[str, list[str]] = {}
    for name, arr in photos.items():
        rel = f"{name}.jpg"
        with open(os.path.join(root, rel), "wb") as f:
            f.write(encode(arr, quality=92))
        groups[name] = [rel]
    for name in copies_of:
        for kind in kinds:
            rel = f"copies/{name}__{kind}.jpg"
            with open(os.path.join(root, rel), "wb") as f:
                f.write(encode(make_copy(photos[name], kind), quality=90))
            groups[name].append(rel)
    return groups


# ----------------------------------------------------------------------------- byte helpers


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **kw)
    return buf.getvalue()


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A tiny valid-looking PNG whose header claims width x height pixels (a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def bad_file_kinds(photo: np.ndarray) -> dict[str, tuple[bytes, str]]:
    """file name -> (bytes, reason safe_decode must give) for every unreadable kind."""
    good = jpeg_bytes(Image.fromarray(photo), quality=90)
    return {
        "zero.jpg": (b"", "empty"),
        "truncated.jpg": (good[: len(good) // 2], "truncated"),
        "html.jpg": (b"<html><body>404 Not Found</body></html>", "not_an_image"),
        "bomb.png": (png_bomb(), "too_large"),
    }
