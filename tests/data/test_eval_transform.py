"""The one eval transform (dinopipe.data.transforms.eval_transform) that the evals and curation's embedder share."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from dinopipe.data.transforms import eval_crop_size, eval_transform
from tests._photos import real_photos


def _dinov2_v1(size: int) -> T.Compose:
    """DINOv2's eval preprocessing as curation wrote it before (torchvision transforms v1, PIL resize)."""
    return T.Compose([T.Resize(int(round(size * 256 / 224)), interpolation=T.InterpolationMode.BICUBIC),
                      T.CenterCrop(size), T.ToTensor(),
                      T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))])


@pytest.mark.parametrize("size", [224, 98])
def test_matches_dinov2_v1_preprocessing_on_real_photos(size):
    photos = real_photos()
    for name in ("astronaut", "chelsea", "coffee", "rocket"):
        img = Image.fromarray(photos[name])
        new, ref = eval_transform(size)(img), _dinov2_v1(size)(img)
        assert new.shape == (3, size, size) and new.dtype == torch.float32
        torch.testing.assert_close(new, ref, atol=1e-5, rtol=0)  # curation embeddings stay as they were


def test_a_uint8_tensor_gives_the_pil_result_within_one_grey_level():
    arr = real_photos()["chelsea"]
    from_pil = eval_transform(112)(Image.fromarray(arr))
    from_tensor = eval_transform(112)(torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1))))
    one_level = 1 / 255 / min(0.229, 0.224, 0.225)  # tensor bicubic vs PIL bicubic: rounding differs
    assert (from_pil - from_tensor).abs().max() <= 2.5 * one_level


def test_crop_size_is_a_multiple_of_the_patch():
    assert eval_crop_size(224, 14) == 224 and eval_crop_size(230, 14) == 224 and eval_crop_size(10, 14) == 14
