"""safe_decode: every awkward file either decodes correctly or gets its reason; it never raises."""

from __future__ import annotations

import io

import numpy as np
import pytest
from tests._photos import jpeg_bytes, png_bytes
from PIL import Image

from dinopipe.data.decode import REASONS, safe_decode


def test_each_bad_kind_gets_its_reason(bad_files):
    for name, (data, reason) in bad_files.items():
        img, got = safe_decode(data)
        assert img is None and got == reason, name
        assert got in REASONS


def test_missing_bytes_is_read_error():
    assert safe_decode(None) == (None, "read_error")


def test_pixel_limit_is_configurable(photo):
    data = png_bytes(Image.fromarray(photo))
    assert safe_decode(data, max_pixels=photo.shape[0] * photo.shape[1] - 1)[1] == "too_large"
    assert safe_decode(data, max_pixels=photo.shape[0] * photo.shape[1])[1] is None


def test_every_truncation_of_a_real_jpeg_is_handled(photo):
    data = jpeg_bytes(Image.fromarray(photo), quality=80)
    for cut in (1, 10, 100, 600, len(data) // 3, len(data) - 10):
        img, reason = safe_decode(data[:cut])
        assert img is None and reason in ("truncated", "not_an_image"), cut


def test_garbage_never_raises():
    rng = np.random.default_rng(0)
    for n in (1, 7, 512):
        for prefix in (b"", b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF89a", b"BM"):
            img, reason = safe_decode(prefix + rng.bytes(n))
            assert img is None and reason in REASONS


def test_plain_rgb_is_exact(photo):
    img, reason = safe_decode(png_bytes(Image.fromarray(photo)))
    assert reason is None and img.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(img), photo)


def test_cmyk_jpeg_becomes_rgb_with_right_colours(photo):
    cmyk = Image.fromarray(photo).convert("CMYK")
    img, reason = safe_decode(jpeg_bytes(cmyk, quality=95))
    assert reason is None and img.mode == "RGB" and img.size == (photo.shape[1], photo.shape[0])
    err = np.abs(np.asarray(img, np.float32) - photo.astype(np.float32)).mean()
    assert err < 8, err


def test_16_bit_grey_is_scaled_not_clipped():
    ramp = (np.linspace(0, 65535, 256)[None, :].repeat(16, 0)).astype(np.uint16)
    src = Image.fromarray(ramp)  # mode I;16
    data = png_bytes(src)
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    img, reason = safe_decode(data)
    assert reason is None and img.mode == "RGB"
    row = np.asarray(img)[0, :, 0].astype(int)
    # clipping would make everything above 255/65535 white; scaling keeps the ramp
    assert row[0] == 0 and row[-1] == 255 and 120 < row[128] < 135
    assert np.all(np.diff(row) >= 0)


def test_palette_with_transparency_is_composited_on_white():
    p = Image.new("P", (8, 8), 0)
    p.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    p.putpixel((0, 0), 1)
    buf = io.BytesIO()
    p.save(buf, format="PNG", transparency=0)  # palette index 0 (red) is transparent
    img, reason = safe_decode(buf.getvalue())
    assert reason is None
    arr = np.asarray(img)
    assert tuple(arr[0, 0]) == (0, 0, 255)  # opaque blue stays
    assert tuple(arr[4, 4]) == (255, 255, 255)  # transparent red becomes white, not red


@pytest.mark.parametrize("mode", ["RGBA", "LA"])
def test_alpha_is_composited_on_white(photo, mode):
    base = Image.fromarray(photo).convert(mode[:-1] if mode == "LA" else "RGB")
    alpha = Image.new("L", base.size, 255)
    alpha.paste(0, (0, 0, 50, 50))
    img_a = base.copy()
    img_a.putalpha(alpha)
    img, reason = safe_decode(png_bytes(img_a))
    assert reason is None and img.mode == "RGB"
    arr = np.asarray(img)
    assert (arr[:50, :50] == 255).all()  # fully transparent corner -> white
    assert np.abs(arr[100:, 100:].astype(int) - np.asarray(base.convert("RGB"))[100:, 100:]).max() <= 1


def test_exif_orientation_is_applied(photo):
    src = Image.fromarray(photo)  # 451 wide x 300 high
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    img, reason = safe_decode(jpeg_bytes(src, quality=95, exif=exif.tobytes()))
    assert reason is None
    assert img.size == (300, 451)  # displayed upright: portrait
    expected = np.asarray(src.transpose(Image.Transpose.ROTATE_270), np.float32)
    assert np.abs(np.asarray(img, np.float32) - expected).mean() < 5


@pytest.mark.parametrize("orientation", range(1, 9))
def test_tiff_orientation_is_applied_like_exif(photo, orientation):
    """A camera's 8-bit RGB TIFF (tifffile reads every TIFF) comes out upright, pixel for pixel what Pillow's
    exif_transpose makes of the same file; the N-channel reader agrees."""
    from PIL import ImageOps

    from dinopipe.data.channels import decode_channels

    buf = io.BytesIO()
    Image.fromarray(photo).save(buf, format="TIFF", tiffinfo={0x0112: orientation})
    data = buf.getvalue()
    want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    img, reason = safe_decode(data)
    assert reason is None
    np.testing.assert_array_equal(np.asarray(img), want)
    x, reason = decode_channels(data, 3)
    assert reason is None
    np.testing.assert_array_equal(np.rint(x.numpy().transpose(1, 2, 0) * 255).astype(np.uint8), want)
    if orientation in (6, 8):
        assert img.size == (photo.shape[0], photo.shape[1])  # portrait: 300 wide


def test_tiff_orientation_turns_every_band_of_a_band_major_tiff(photo):
    import tifffile

    from dinopipe.data.channels import decode_channels

    stack = np.stack([photo[..., c] for c in range(3)] + [photo.mean(-1).astype(np.uint8)])  # (4, H, W)
    buf = io.BytesIO()
    tifffile.imwrite(buf, stack, photometric="minisblack", extratags=[(0x0112, "H", 1, 8, True)])
    x, reason = decode_channels(buf.getvalue(), 4)
    assert reason is None and tuple(x.shape) == (4, photo.shape[1], photo.shape[0])
    want = np.rot90(stack, 1, axes=(1, 2)).astype(np.float32) / 255  # 8: rotate 90 degrees counter-clockwise
    np.testing.assert_array_equal(x.numpy(), want)


def test_one_bit_and_grey_become_rgb():
    for mode in ("1", "L"):
        img, reason = safe_decode(png_bytes(Image.new(mode, (5, 4), 1 if mode == "1" else 77)))
        assert reason is None and img.mode == "RGB" and img.size == (5, 4)
