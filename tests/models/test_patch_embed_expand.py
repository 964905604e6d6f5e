"""RGB weights into N channels: the patch-embedding expansions keep what the released model computes on the
inputs they are meant to be equivalent on (grey images for ``mean``, the named bands for ``rgb_map``)."""

import pytest
import torch

from dinopipe.models import create_model
from dinopipe.models.channels import expand_kernel, expand_patch_embed, in_chans_of
from tests._photos import real_photos


def _rgb_model():
    torch.manual_seed(0)
    m = create_model("vit_test", img_size=56).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def _photo_batch():
    photos = real_photos()
    x = torch.stack([torch.from_numpy(photos[n][:224:4, :224:4]).permute(2, 0, 1).float() / 255
                     for n in ("astronaut", "coffee")])  # (2, 3, 56, 56)
    return (x - 0.45) / 0.226


@pytest.mark.parametrize("n", [1, 2, 4, 16])
def test_mean_expansion_sees_grey_as_the_rgb_model_did(n):
    rgb = _rgb_model()
    grey = _photo_batch().mean(1, keepdim=True)  # (2, 1, 56, 56)
    with torch.no_grad():
        want = rgb(grey.expand(-1, 3, -1, -1))
        wide = expand_patch_embed(_rgb_model(), n, "mean")
        got = wide(grey.expand(-1, n, -1, -1))
    assert in_chans_of(wide) == n and wide.arch_config()["in_chans"] == n
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rgb_map_puts_the_colour_kernels_on_the_named_bands():
    x = _photo_batch()
    with torch.no_grad():
        want = _rgb_model()(x)
        same = expand_patch_embed(_rgb_model(), 3, "rgb_map", [0, 1, 2])  # 3 -> 3: unchanged
        torch.testing.assert_close(same(x), want)
        bgrn = expand_patch_embed(_rgb_model(), 4, "rgb_map", [2, 1, 0])  # B, G, R, NIR-like 4th band
        w = bgrn.patch_embed.proj.weight
        w0 = _rgb_model().patch_embed.proj.weight
        torch.testing.assert_close(w[:, 2], w0[:, 0] * 0.75)
        torch.testing.assert_close(w[:, 0], w0[:, 2] * 0.75)
        torch.testing.assert_close(w[:, 3], w0.mean(1) * 0.75)
        # the 4th band zeroed out: the RGB response scaled by 3/4 before the bias
        conv = bgrn.patch_embed.proj
        z = torch.cat([x.flip(1), torch.zeros_like(x[:, :1])], 1)
        ref = _rgb_model().patch_embed.proj
        torch.testing.assert_close(conv(z) - conv.bias[:, None, None], 0.75 * (ref(x) - ref.bias[:, None, None]),
                                   atol=1e-5, rtol=1e-5)


def test_bad_expansions_are_refused():
    w = torch.randn(8, 3, 4, 4)
    with pytest.raises(ValueError, match="rgb_map"):
        expand_kernel(w, 4, "rgb_map", [0, 1])
    with pytest.raises(ValueError, match="rgb_map"):
        expand_kernel(w, 4, "rgb_map", [0, 1, 4])
    with pytest.raises(ValueError, match="mode"):
        expand_kernel(w, 4, "copy")
    with pytest.raises(ValueError, match="RGB"):
        expand_kernel(torch.randn(8, 4, 4, 4), 5)
    four = expand_patch_embed(_rgb_model(), 4)
    with pytest.raises(ValueError, match="RGB"):
        expand_patch_embed(four, 6)
