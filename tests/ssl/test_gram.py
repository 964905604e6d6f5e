"""Gram anchoring pieces: the loss against a formula written here, the resampled teacher grid, the refresh
schedule and weights, the Gram teacher's copy, Gram-teacher crops and multi-size batches."""

import numpy as np
import pytest
import torch

from dinopipe.config import ConfigError, load_config
from dinopipe.data.multires import GramCropAugmentation, GramCropCollator, SizedBatchSampler, choose_size
from dinopipe.data.loader import DataPosition
from dinopipe.models import create_model
from dinopipe.ssl.config import GramConfig, PretrainConfig
from dinopipe.ssl.config_checks import validate
from dinopipe.ssl.gram import GramTeacher, gram_loss, gram_schedules, refresh_steps, resample_patch_grid


def test_gram_loss_equals_the_formula():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 5, 7, generator=g), torch.randn(3, 5, 7, generator=g)
    # Reference, element by element: mean over images b and patch pairs (i, j) of
    # (<s_bi, s_bj> / |s_bi||s_bj| - <t_bi, t_bj> / |t_bi||t_bj|)^2.
    total = 0.0
    for b in range(3):
        for i in range(5):
            for j in range(5):
                cs = float(s[b, i] @ s[b, j]) / float(s[b, i].norm() * s[b, j].norm())
                ct = float(t[b, i] @ t[b, j]) / float(t[b, i].norm() * t[b, j].norm())
                total += (cs - ct) ** 2
    assert float(gram_loss(s, t)) == pytest.approx(total / (3 * 5 * 5), rel=1e-5)
    assert float(gram_loss(s, 2.5 * s)) == pytest.approx(0.0, abs=1e-6)  # scale-free: only structure counts
    with pytest.raises(ValueError, match="one shape"):
        gram_loss(s, t[:, :4])


def _cos_pairs_mse(s, t):
    """Element-by-element reference over (T, D) rows: mean over all pairs (i, j) of the cosine differences."""
    total = 0.0
    for i in range(s.shape[0]):
        for j in range(s.shape[0]):
            cs = float(s[i] @ s[j]) / float(s[i].norm() * s[j].norm())
            ct = float(t[i] @ t[j]) / float(t[i].norm() * t[j].norm())
            total += (cs - ct) ** 2
    return total / s.shape[0] ** 2


@pytest.mark.parametrize("used", ["all", "masked", "unmasked"])
def test_batch_level_gram_and_tokens_used_follow_dinov3(used):
    """DINOv3's ``img_level: false`` (one Gram matrix over every selected patch of the batch) and ``tokens_used``
    (the student's iBOT-masked / visible patches, the same positions of the targets): dinov3
    ``ssl_meta_arch.py:get_gram_teacher_output`` and ``loss/gram_loss.py``."""
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 4, 6, generator=g), torch.randn(2, 4, 6, generator=g)
    masks = torch.tensor([[1, 0, 0, 1], [0, 1, 0, 0]], dtype=torch.bool)
    keep = {"all": torch.ones_like(masks), "masked": masks, "unmasked": ~masks}[used]
    want = _cos_pairs_mse(s[keep], t[keep])
    teacher = GramTeacher(create_model("vit_test"), GramConfig(enabled=True, tokens_used=used, image_level=False))
    got = teacher.loss(s, torch.zeros(2, 3, 16, 16), (2, 2), targets=t, masks=masks)
    assert float(got) == pytest.approx(want, rel=1e-5)
    if used == "all":
        assert float(gram_loss(s, t)) != pytest.approx(want, rel=1e-3)  # per image is another quantity


def test_gram_loss_gradient_reaches_the_student_only():
    s = torch.randn(2, 4, 8, requires_grad=True)
    t = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    loss = gram_loss(s.bfloat16(), t)
    assert loss.dtype == torch.float32
    loss.backward()
    assert s.grad is not None and s.grad.abs().sum() > 0


def test_resample_patch_grid_matches_interpolate_and_keeps_same_size():
    x = torch.randn(2, 4 * 6, 3)
    assert resample_patch_grid(x, (4, 6), (4, 6)) is x
    out = resample_patch_grid(x, (4, 6), (2, 3), mode="bilinear")
    ref = torch.nn.functional.interpolate(x.transpose(1, 2).reshape(2, 3, 4, 6), size=(2, 3), mode="bilinear",
                                          align_corners=False)
    torch.testing.assert_close(out, ref.flatten(2).transpose(1, 2))
    # A constant field stays constant whatever the resampling.
    c = torch.ones(1, 16, 2)
    torch.testing.assert_close(resample_patch_grid(c, (4, 4), (2, 2)), torch.ones(1, 4, 2))


@pytest.mark.parametrize("first,every,maxr,total,expected", [
    (0, 0, None, 10, [0]),  # anchored to the initial (e.g. released) backbone for the whole run
    (2, 3, None, 12, [2, 5, 8, 11]),
    (2, 3, 2, 100, [2, 5, 8]),  # first copy + at most 2 refreshes
    (2, 3, 0, 100, [2]),
    (10, 5, None, 10, []),  # starts after the run ends
])
def test_refresh_steps(first, every, maxr, total, expected):
    cfg = GramConfig(enabled=True, first_step=first, refresh_every=every, max_refreshes=maxr)
    assert refresh_steps(cfg, total) == expected
    sched = gram_schedules(cfg, total)
    assert list(np.flatnonzero(sched["gram_refresh"])) == expected
    assert refresh_steps(GramConfig(enabled=False), total) == []


def test_weight_schedule_off_before_first_copy_then_warms_up():
    """DINOv3's loss_weight_schedule shape: half a cosine from the start weight up to loss_weight, sampled as its
    linear_warmup_cosine_decay samples it (``np.linspace(0, pi, n)``: the last ramp step is already loss_weight)."""
    cfg = GramConfig(enabled=True, first_step=3, loss_weight=2.0, loss_weight_start=0.0, warmup_steps=4)
    w = gram_schedules(cfg, 10)["gram_weight"]
    ramp = [2.0 - 2.0 * (1 + np.cos(np.pi * i / 3)) / 2 for i in range(4)]
    np.testing.assert_allclose(w, [0, 0, 0, *ramp, 2.0, 2.0, 2.0], atol=1e-12)


def test_gram_teacher_copies_the_teacher_at_refresh_and_stays_frozen():
    torch.manual_seed(0)
    teacher = create_model("vit_test_dinov3", drop_path_rate=0.1)
    gram = GramTeacher(teacher, GramConfig(enabled=True))
    before = {k: v.clone() for k, v in gram.backbone.state_dict().items()}
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.01)
    assert all(torch.equal(before[k], v) for k, v in gram.backbone.state_dict().items())  # a copy, not a view
    gram.refresh_(teacher)
    for k, v in teacher.state_dict().items():
        assert torch.equal(gram.backbone.state_dict()[k], v), k
    assert not any(p.requires_grad for p in gram.parameters())
    gram.train()
    assert not gram.backbone.training  # never trains: no RoPE augmentation, no stochastic depth


def test_gram_teacher_at_twice_the_resolution_gives_the_students_grid():
    torch.manual_seed(0)
    teacher = create_model("vit_test_dinov3")
    gram = GramTeacher(teacher, GramConfig(enabled=True))
    t = gram.targets(torch.randn(2, 3, 64, 64), (2, 2))
    assert t.shape == (2, 4, 64)
    assert float(gram.loss(t.clone(), None, (2, 2), targets=t)) == pytest.approx(0.0, abs=1e-6)


def test_gram_crops_share_the_global_crops_boxes():
    from PIL import Image
    from skimage import data

    img = Image.fromarray(data.astronaut()).resize((160, 160))
    aug = GramCropAugmentation(gram_size=64, global_size=32, local_size=16, n_local=2, color_jitter_p=0.0,
                               grayscale_p=0.0, global1_blur_p=0.0, global2_blur_p=0.0, solarize_p=0.0)
    s = aug(img, seed=5)
    assert [tuple(t.shape) for t in s["gram_crops"]] == [(3, 64, 64)] * 2
    # Without photometric distortions, the Gram crop downsampled is the global crop (same box, same flip).
    down = [torch.nn.functional.interpolate(r[None], size=(32, 32), mode="area")[0] for r in s["gram_crops"]]
    g1, g2 = s["global_crops"]
    assert (down[0] - g1).abs().mean() < 0.1 and (down[1] - g2).abs().mean() < 0.1
    assert (down[0] - g2).abs().mean() > 0.3 and (down[1] - g1).abs().mean() > 0.3  # the other box differs
    batch = GramCropCollator(16)([aug(img, seed=i) for i in range(3)])
    assert batch["gram_crops"].shape == (6, 3, 64, 64) and batch["global_crops"].shape == (6, 3, 32, 32)


def test_size_draws_follow_probabilities_and_the_data_position():
    probs = [0.3, 0.3, 0.3, 0.05, 0.05]  # DINOv3's high-res adaptation mix
    draws = [choose_size(probs, 0, 0, off) for off in range(4000)]
    freq = np.bincount(draws, minlength=5) / 4000
    np.testing.assert_allclose(freq, probs, atol=0.03)
    assert draws == [choose_size(probs, 0, 0, off) for off in range(4000)]
    # Every rank's share of a global batch carries the same size; a resumed sampler continues the sequence.
    def sizes(rank, start, n):
        it = iter(SizedBatchSampler(100, 4, rank, 2, 7, start, probabilities=probs))
        return [next(it)[0][2] for _ in range(n)]
    assert sizes(0, DataPosition(), 30) == sizes(1, DataPosition(), 30)
    assert sizes(0, DataPosition(), 30)[10:] == sizes(0, DataPosition(0, 80), 20)


def test_config_errors_name_the_key():
    base = ["data.paths=[x]"]
    with pytest.raises(ConfigError, match="gram.resize_mode"):
        validate(load_config(PretrainConfig, None, base + ["gram.resize_mode=cubic"]))
    with pytest.raises(ConfigError, match=r"phases.0.sizes"):
        validate(load_config(PretrainConfig, None, base + [
            "phases=[{name: hr, sizes: [{global_crops_size: 64, probability: 0.5}]}]"]))
    with pytest.raises(ConfigError, match="gram.image_level"):
        validate(load_config(PretrainConfig, None, base + ["gram.tokens_used=masked"]))
    with pytest.raises(ConfigError, match="gram.tokens_used"):
        validate(load_config(PretrainConfig, None, base + ["gram.tokens_used=some"]))
    with pytest.raises(ConfigError, match="dino.koleo_distributed"):
        validate(load_config(PretrainConfig, None, base + ["dino.koleo_group_size=16"]))
    with pytest.raises(ConfigError, match="optim.lr_schedule"):
        validate(load_config(PretrainConfig, None, base + ["optim.lr_schedule=linear"]))


def test_dinov3_model_keys_on_a_dinov2_model_name_the_key():
    base = ["data.paths=[x]", "model.name=vit_test"]
    with pytest.raises(ConfigError, match="model.rope_rescale: only DINOv3"):
        validate(load_config(PretrainConfig, None, base + ["model.rope_rescale=2.0"]))
    cfg = load_config(PretrainConfig, None, ["data.paths=[x]", "model.name=vit_test_dinov3",
                                             "model.untie_cls_and_patch_norms=true", "model.rope_rescale=0"])
    validate(cfg)
    m = create_model(cfg.model.name, **cfg.model.create_kwargs())
    assert m.cls_norm is not None and not m.rope_embed.rescale
