"""N-channel images: 16-bit / float TIFF and .npy tiles made from real photos (per-band renderings), read with
their channels, rendered to RGB for curation, their statistics, and the per-channel augmentation."""

import io
import json
import tarfile

import numpy as np
import pytest
import torch

from dinopipe.data.channels import WRONG_CHANNELS, channel_stats, decode_channels, render_rgb
from dinopipe.data.decode import TOO_LARGE, TRUNCATED, safe_decode
from dinopipe.data.loader import list_pool
from dinopipe.data.samples_nch import bands, encode_tile
from dinopipe.data.transforms import ChannelBrightnessContrast, MultiCropAugmentation, eval_transform
from tests._photos import real_photos


@pytest.fixture(scope="module")
def photo():
    return real_photos()["astronaut"][::4, ::4][:96, :112]  # (96, 112, 3) uint8


@pytest.mark.parametrize("fmt,tol", [("tiff16", 1 / 65535), ("npy", 0.0)])
@pytest.mark.parametrize("n", [1, 4, 16])
def test_tiles_read_back_with_their_bands(photo, fmt, tol, n):
    want = bands(photo, n)  # (H, W, n) in [0, 1]
    x, reason = decode_channels(encode_tile(want, fmt), n)
    assert reason is None and x.dtype == torch.float32 and tuple(x.shape) == (n, 96, 112)
    assert np.abs(x.numpy().transpose(1, 2, 0) - want).max() <= tol + 1e-7


def test_band_major_tiff_and_eight_bit_photos(photo):
    import tifffile

    stack = (bands(photo, 5) * 65535).astype(np.uint16).transpose(2, 0, 1)  # (5, H, W): one page per band
    buf = io.BytesIO()
    tifffile.imwrite(buf, stack, photometric="minisblack")
    x, _ = decode_channels(buf.getvalue(), 5)
    assert tuple(x.shape) == (5, 96, 112) and np.allclose(x.numpy(), stack / 65535.0, atol=1e-6)
    from dinopipe.data.samples import encode

    png = encode(photo, "PNG")  # an ordinary photo: RGB for 3 channels, grey for 1, wrong for 4
    assert torch.equal((decode_channels(png, 3)[0] * 255).round().byte().permute(1, 2, 0), torch.from_numpy(photo))
    assert decode_channels(png, 1)[0].shape == (1, 96, 112)
    assert decode_channels(png, 4) == (None, WRONG_CHANNELS)


def test_bad_tiles_are_counted_not_fatal(photo):
    tile = encode_tile(bands(photo, 4), "npy")
    assert decode_channels(tile, 3) == (None, WRONG_CHANNELS)
    assert decode_channels(tile[: len(tile) // 2], 4)[1] == TRUNCATED
    assert decode_channels(encode_tile(bands(photo, 4), "tiff16"), 4, max_pixels=1000)[1] == TOO_LARGE
    assert decode_channels(tile, 4, max_pixels=1000)[1] == TOO_LARGE
    obj = io.BytesIO()
    np.save(obj, np.array([{"x": 1}], dtype=object), allow_pickle=True)  # a pickle inside: never loaded
    assert decode_channels(obj.getvalue(), 4)[0] is None and safe_decode(obj.getvalue())[0] is None


@pytest.mark.parametrize("fmt", ["tiff16", "npy"])
def test_rendering_for_curation_is_the_first_three_bands_or_grey(photo, fmt):
    img, reason = safe_decode(encode_tile(bands(photo, 6), fmt))
    assert reason is None and img.mode == "RGB" and img.size == (112, 96)
    assert np.abs(np.asarray(img).astype(int) - photo.astype(int)).max() <= 1  # R, G, B bands = the photo
    grey, _ = safe_decode(encode_tile(bands(photo, 1), fmt))
    g = np.asarray(grey)
    assert (g[..., 0] == g[..., 1]).all() and (g[..., 1] == g[..., 2]).all()
    luma = 0.299 * photo[..., 0] + 0.587 * photo[..., 1] + 0.114 * photo[..., 2]
    assert np.abs(g[..., 0] - luma).max() <= 1.5
    # float bands in physical units (reflectance x 1000): the image's own range
    wide = render_rgb(bands(photo, 4) * 1000.0 - 50.0)
    assert np.corrcoef(np.asarray(wide)[..., 1].ravel(), photo[..., 1].ravel())[0, 1] > 0.999


def test_channel_stats_are_numpy_per_channel_moments(photo):
    tiles = [bands(photo[i * 8:], 4) for i in range(3)]
    mean, std, used, skipped = channel_stats([encode_tile(t, "npy") for t in tiles] + [b"junk"], 4)
    allpix = np.concatenate([t.reshape(-1, 4) for t in tiles]).astype(np.float64)
    assert used == 3 and skipped == 1
    assert np.allclose(mean, allpix.mean(0), atol=1e-5) and np.allclose(std, allpix.std(0), atol=1e-5)


def test_npy_and_tiff_members_of_webdataset_shards_are_images(tmp_path, photo):
    shard = tmp_path / "pool-000.tar"
    with tarfile.open(shard, "w") as tar:
        for i, fmt in enumerate(["npy", "tiff16", "npy"]):
            data = encode_tile(bands(photo[i * 4:], 4), fmt)
            info = tarfile.TarInfo(f"{i:06d}.{'npy' if fmt == 'npy' else 'tif'}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            meta = b'{"source": "astronaut"}'
            info = tarfile.TarInfo(f"{i:06d}.json")
            info.size = len(meta)
            tar.addfile(info, io.BytesIO(meta))
    refs, read = list_pool([str(shard)])
    assert [r.id.rsplit("/", 1)[-1] for r in refs] == ["000000.npy", "000001.tif", "000002.npy"]
    for r in refs:
        x, reason = decode_channels(read(r), 4)
        assert reason is None and x.shape[0] == 4


def _aug(n, **kw):
    return MultiCropAugmentation(global_size=48, local_size=24, n_local=2, channels=n, float_input=True,
                                 mean=[0.4] * n, std=[0.25] * n, **kw)


@pytest.mark.parametrize("n", [1, 4, 16])
def test_augmentation_crops_every_channel_reproducibly(photo, n):
    x = decode_channels(encode_tile(bands(photo, n), "npy"), n)[0]
    aug = _aug(n)
    a, b = aug(x, seed=7), aug(x, seed=7)
    assert [t.shape for t in a["global_crops"]] == [(n, 48, 48)] * 2
    assert [t.shape for t in a["local_crops"]] == [(n, 24, 24)] * 2
    assert all(torch.equal(s, t) for s, t in zip(a["global_crops"] + a["local_crops"], b["global_crops"] + b["local_crops"]))
    assert not torch.equal(a["global_crops"][0], aug(x, seed=8)["global_crops"][0])


def test_colour_operations_only_for_three_channels():
    from torchvision.transforms import v2

    def kinds(aug):
        return {type(t).__name__ for p in (aug.global1, aug.global2, aug.local) for t in p.transforms} | {
            type(u).__name__ for p in (aug.global1, aug.global2, aug.local) for t in p.transforms
            if isinstance(t, v2.RandomApply) for u in t.transforms}

    four, three = kinds(_aug(4)), kinds(_aug(3))
    assert {"ChannelBrightnessContrast", "GaussianBlur", "RandomResizedCrop", "RandomHorizontalFlip"} <= four
    assert not four & {"ColorJitter", "RandomGrayscale", "RandomSolarize"}
    assert {"ColorJitter", "RandomGrayscale", "RandomSolarize"} <= three
    with pytest.raises(ValueError, match="float_input"):
        MultiCropAugmentation(channels=4, mean=[0.4] * 4, std=[0.2] * 4)
    with pytest.raises(ValueError, match="mean and std"):
        MultiCropAugmentation(channels=4, float_input=True)


def test_brightness_contrast_acts_on_each_channel_alone(photo):
    x = decode_channels(encode_tile(bands(photo, 4), "npy"), 4)[0]
    torch.manual_seed(0)
    y = ChannelBrightnessContrast(0.4, 0.4)(x)
    # each output channel is an affine function of its own input channel, with its own factors
    slopes = []
    for c in range(4):
        A = torch.stack([x[c].flatten(), torch.ones(x[c].numel())], 1)
        sol = torch.linalg.lstsq(A, y[c].flatten()[:, None]).solution
        assert torch.allclose(A @ sol, y[c].flatten()[:, None], atol=1e-4)
        slopes.append(float(sol[0]))
    assert len({round(s, 3) for s in slopes}) == 4


def test_normalisation_uses_the_configured_statistics(photo):
    n = 4
    x = decode_channels(encode_tile(bands(photo, n), "npy"), n)[0]
    mean, std = x.mean((1, 2)).tolist(), x.std((1, 2)).tolist()
    y = eval_transform(96, resize_ratio=1.0, mean=mean, std=std)(x)  # the whole (96-px short side) centre
    assert y.shape == (n, 96, 96)
    centre = x[:, :, 8:104]
    want = (centre - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    assert torch.allclose(y, want, atol=1e-4)


def test_float_tiff_in_physical_units(photo):
    import tifffile

    refl = bands(photo, 4) * 800.0 + 20.0  # float32 'reflectance' bands, far outside [0, 1]
    buf = io.BytesIO()
    tifffile.imwrite(buf, refl.astype(np.float32), photometric="minisblack", planarconfig="contig")
    x, reason = decode_channels(buf.getvalue(), 4)
    assert reason is None and np.allclose(x.numpy().transpose(1, 2, 0), refl, rtol=1e-6)  # floats as stored
    img, _ = safe_decode(buf.getvalue())
    assert np.corrcoef(np.asarray(img)[..., 0].ravel(), photo[..., 0].ravel())[0, 1] > 0.999


def test_channel_stats_command_prints_config_keys(tmp_path, photo, capsys):
    from dinopipe.app.cli import main

    for i in range(3):
        (tmp_path / f"{i}.tif").write_bytes(encode_tile(bands(photo[i * 8:], 4), "tiff16"))
    assert main(["channel-stats", str(tmp_path), "--channels", "4", "--sample", "2"]) == 0
    keys = dict(kv.split("=", 1) for kv in capsys.readouterr().out.split())
    assert keys["data.channels"] == "4" and len(json.loads(keys["data.mean"])) == 4 and len(json.loads(keys["data.std"])) == 4
    assert main(["channel-stats", str(tmp_path), "--channels", "5"]) == 2
    assert "--channels" in capsys.readouterr().err
    assert main(["channel-stats", str(tmp_path / "nowhere"), "--channels", "4"]) == 2
