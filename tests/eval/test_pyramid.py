"""The ViTDet simple pyramid: exact strides 4/8/16/32 for patch-14 and patch-16 backbones (registers, RoPE), and
the scales torchvision's RoIAlign and anchor generator infer from it are the true ones (the patch-14 traps)."""

import pytest
import torch
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.image_list import ImageList
from torchvision.ops import MultiScaleRoIAlign

from dinopipe.eval.pyramid import PyramidBackbone, SimplePyramid, level_strides, pad_to, patch_grid
from dinopipe.models import create_model


@pytest.mark.parametrize("name", ["vit_test", "vit_test_reg4", "vit_test_dinov3"])
def test_levels_have_exact_strides_for_every_backbone(name):
    torch.manual_seed(0)
    m = create_model(name).eval()
    pb = PyramidBackbone(m, out_channels=16, extra_pool=True)
    x = torch.randn(2, 3, 64, 96)  # not square, not a multiple of 14
    maps = pb(x)
    assert list(maps) == ["0", "1", "2", "3", "pool"]
    assert level_strides(maps, (64, 96)) == [4.0, 8.0, 16.0, 32.0, 64.0]
    assert [m.shape[-1] for m in maps.values()] == [24, 12, 6, 3, 2]
    assert all(v.shape[:2] == (2, 16) for v in maps.values())


def test_grid_is_the_patch_tokens_without_registers():
    torch.manual_seed(0)
    m = create_model("vit_test_reg4").eval()
    x = torch.randn(1, 3, 64, 64)
    g = patch_grid(m, x)  # patch 14: the image is resampled to 4x4 patches of 14 px
    small = torch.nn.functional.interpolate(x, size=(56, 56), mode="bilinear", align_corners=False, antialias=True)
    tok = m.forward_features(small)["x_norm_patchtokens"]
    assert g.shape == (1, 64, 4, 4)
    torch.testing.assert_close(g.flatten(2).transpose(1, 2), tok)


def test_odd_grid_and_bad_sizes_are_refused():
    m = create_model("vit_test")
    with pytest.raises(ValueError, match="multiples of 16"):
        patch_grid(m, torch.randn(1, 3, 56, 56))
    with pytest.raises(ValueError, match="even grid"):
        SimplePyramid(64, 8)(torch.randn(1, 64, 3, 3))
    assert pad_to(torch.zeros(1, 3, 50, 64)).shape[-2:] == (64, 64)


def test_torchvision_infers_the_true_scales_and_anchor_strides_for_patch_14():
    torch.manual_seed(0)
    pb = PyramidBackbone(create_model("vit_test").eval(), out_channels=8)
    x = torch.randn(1, 3, 96, 128)
    maps = pb(x)
    pool = MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)
    pool(maps, [torch.tensor([[8.0, 8.0, 60.0, 40.0]])], [(96, 128)])
    assert pool.scales == [1 / 4, 1 / 8, 1 / 16, 1 / 32]
    anchors = AnchorGenerator(((16,),) * 4, ((1.0,),) * 4)
    a = anchors(ImageList(x, [(96, 128)]), list(maps.values()))[0]
    # the last level's anchors are centred on a 32-px lattice: (0, 32, 64, 96) across
    last = a[-(3 * 4):, 0] + 8
    assert sorted(set(last.tolist())) == [0.0, 32.0, 64.0, 96.0]
    # The trap closed: a raw patch-14 grid (true stride 14) is pooled as if at stride 16.
    raw = {"0": torch.zeros(1, 8, 96 // 14, 126 // 14)}
    trap = MultiScaleRoIAlign(["0"], 7, 2)
    trap(raw, [torch.tensor([[8.0, 8.0, 60.0, 40.0]])], [(96, 126)])
    assert trap.scales == [1 / 16]
