"""Reading N-channel arrays (npy, TIFF) and their 3-channel rendering: the leaf under both ``channels.py``
(decoding a file of any format to N channels, statistics) and ``decode.py`` (Pillow, which renders an array
file for curation's RGB checks). The formats, the value scale and the rendering are described in
``channels.py``, which re-exports everything here."""

from __future__ import annotations

import io
from typing import Optional

import numpy as np

MAX_CHANNELS = 16
NPY_MAGIC = b"\x93NUMPY"
TIFF_MAGICS = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # classic and BigTIFF, both byte orders
WRONG_CHANNELS = "wrong_channels"  # decoded, but not the configured number of channels (a decode reason)


class ArrayTooLarge(ValueError):
    """More pixels than the decoder's limit (checked from the header, before the data is read)."""


def is_npy(data: bytes) -> bool:
    return data[:6] == NPY_MAGIC


def is_tiff(data: bytes) -> bool:
    return data[:4] in TIFF_MAGICS


def read_npy(data: bytes, max_pixels: int) -> np.ndarray:
    """An ``.npy`` file's array; never unpickles (object arrays raise ValueError)."""
    f = io.BytesIO(data)
    version = np.lib.format.read_magic(f)
    read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in read_header:
        raise ValueError(f".npy format version {version} is not supported (1.0 and 2.0 are)")
    shape, _, dtype = read_header[version](f)  # the header only: size checked before the data is read
    _check_size(shape, max_pixels)
    if dtype.hasobject:
        raise ValueError("object arrays are not images (and would need unpickling)")
    return np.load(io.BytesIO(data), allow_pickle=False)


def read_tiff(data: bytes, max_pixels: int) -> np.ndarray:
    """The first image series of a TIFF (all its bands) as an array, via tifffile."""
    import tifffile

    with tifffile.TiffFile(io.BytesIO(data)) as tif:
        if not tif.series:
            raise ValueError("the TIFF holds no image")
        series = tif.series[0]
        if int(tif.pages[0].photometric) == 3:  # a palette image: indices, not intensities (Pillow's job)
            raise ValueError("palette TIFF")
        _check_size(series.shape, max_pixels)
        tag = tif.pages[0].tags.get("Orientation")
        return upright(series.asarray(), series.axes, int(tag.value) if tag is not None else 1)


def upright(arr: np.ndarray, axes: str, orientation: int) -> np.ndarray:
    """Apply a TIFF / EXIF orientation (tag 274, values 1-8) to the image axes Y and X of ``arr`` (tifffile's
    ``axes`` string, e.g. ``YXS`` for interleaved RGB, ``CYX`` / ``SYX`` for one page per band), as Pillow's
    ``ImageOps.exif_transpose`` does for a photo: camera TIFFs store the sensor's rows and name the rotation."""
    if orientation not in range(2, 9) or "Y" not in axes or "X" not in axes or len(axes) != arr.ndim:
        return arr
    y, x = axes.index("Y"), axes.index("X")
    if orientation in (3, 4, 7):  # flip rows
        arr = np.flip(arr, y)
    if orientation in (2, 3, 7):  # flip columns
        arr = np.flip(arr, x)
    if orientation in (5, 7):  # transpose (5: about the main diagonal; 7: with both flips, the other one)
        arr = np.swapaxes(arr, y, x)
    elif orientation == 6:  # rotate 90 degrees clockwise
        arr = np.rot90(arr, -1, axes=(y, x))
    elif orientation == 8:  # rotate 90 degrees counter-clockwise
        arr = np.rot90(arr, 1, axes=(y, x))
    return np.ascontiguousarray(arr)


def _check_size(shape: tuple, max_pixels: int) -> None:
    dims = sorted(int(d) for d in shape)
    if len(dims) < 2 or len(dims) > 3 or min(dims) < 1:
        raise ValueError(f"array of shape {tuple(shape)} is not an image (need H x W [x C])")
    h, w = dims[-2:]  # the two largest axes are the image's (channels come last in the sort)
    if h * w > max_pixels:
        raise ArrayTooLarge(f"{h * w} pixels > {max_pixels}")


def to_hwc(arr: np.ndarray, channels: Optional[int] = None) -> np.ndarray:
    """(H, W), (H, W, C) or (C, H, W) -> (H, W, C). The channel axis: the one of length ``channels`` (last
    preferred), else the shorter of the first and last axes when it is at most MAX_CHANNELS."""
    arr = np.asarray(arr)
    if arr.ndim == 2:
        return arr[..., None]
    if arr.ndim != 3:
        raise ValueError(f"array of shape {arr.shape} is not an image (need H x W [x C])")
    if channels is not None:
        if arr.shape[-1] == channels:
            return arr
        if arr.shape[0] == channels:
            return np.moveaxis(arr, 0, -1)
        raise ValueError(f"no axis of length {channels} in an array of shape {arr.shape}")
    first, last = arr.shape[0], arr.shape[-1]
    if last <= MAX_CHANNELS and last <= first:
        return arr
    if first <= MAX_CHANNELS:
        return np.moveaxis(arr, 0, -1)
    raise ValueError(f"array of shape {arr.shape}: no channel axis of at most {MAX_CHANNELS}")


def to_float(arr: np.ndarray) -> np.ndarray:
    """float32 on the value scale (unsigned integers / their maximum, floats as stored); nan/inf -> 0."""
    if arr.dtype == bool:
        return arr.astype(np.float32)
    if np.issubdtype(arr.dtype, np.unsignedinteger):
        return arr.astype(np.float32) / float(np.iinfo(arr.dtype).max)
    if np.issubdtype(arr.dtype, np.signedinteger):  # e.g. int16 sensors: the positive range
        return arr.astype(np.float32) / float(np.iinfo(arr.dtype).max)
    if np.issubdtype(arr.dtype, np.floating):
        return np.nan_to_num(arr.astype(np.float32), nan=0.0, posinf=0.0, neginf=0.0)
    raise ValueError(f"pixel type {arr.dtype} is not numeric")


def read_array(data: bytes, max_pixels: int) -> np.ndarray:
    """npy / TIFF bytes -> the stored array (any dtype, layout as stored)."""
    if is_npy(data):
        return read_npy(data, max_pixels)
    if is_tiff(data):
        return read_tiff(data, max_pixels)
    raise ValueError("not an .npy or TIFF file")


def render_rgb(arr: np.ndarray):
    """The documented 3-channel rendering of any image array (module docstring) as a PIL RGB image."""
    from PIL import Image

    hwc = to_float(to_hwc(arr))
    rgb = hwc[..., :3] if hwc.shape[-1] >= 3 else np.repeat(hwc.mean(-1, keepdims=True), 3, axis=-1)
    lo, hi = float(rgb.min(initial=0.0)), float(rgb.max(initial=0.0))
    if lo < 0.0 or hi > 1.0:  # floats in physical units: this image's own range
        rgb = (rgb - lo) / max(hi - lo, 1e-12)
    return Image.fromarray(np.clip(np.rint(rgb * 255.0), 0, 255).astype(np.uint8), "RGB")


__all__ = ["MAX_CHANNELS", "NPY_MAGIC", "TIFF_MAGICS", "WRONG_CHANNELS", "ArrayTooLarge", "is_npy", "is_tiff",
           "read_npy", "read_tiff", "upright", "to_hwc", "to_float", "read_array", "render_rgb"]
