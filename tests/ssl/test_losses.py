"""DINO, iBOT and KoLeo losses against hand-written references on tiny tensors, plus the behaviour that
matters in training: DINO is minimal when the student matches the teacher, iBOT weighs every masked image
equally, KoLeo is finite at batch 1 and falls as points spread."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dinopipe.ssl.losses import DINOLoss, IBOTPatchLoss, KoLeoLoss, koleo_loss
from dinopipe.utils.masks import mask_token_weights


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference_dino(student_global, student_local, teacher_probs, b, temp=0.1):
    """Loop form: every (student crop, teacher global crop) pair but same-view ones, mean over samples,
    averaged over the number of pairs."""
    s_crops = list(student_global.split(b)) + (list(student_local.split(b)) if len(student_local) else [])
    t_crops = list(teacher_probs.split(b))
    total, terms = 0.0, 0
    for i, s in enumerate(s_crops):
        for j, t in enumerate(t_crops):
            if i == j:  # global crop i against itself (locals have indices >= n_global)
                continue
            ce = [-(t[n] * torch.log_softmax(s[n] / temp, dim=-1)).sum() for n in range(b)]
            total += sum(ce) / b
            terms += 1
    return total / terms


def test_dino_loss_matches_reference_and_parts_add_up():
    b, k = 4, 7
    sg, sl = rand(2 * b, k, seed=1), rand(3 * b, k, seed=2)
    tp = torch.softmax(rand(2 * b, k, seed=3) / 0.5, dim=-1)
    loss_fn = DINOLoss(k)
    loss, parts = loss_fn(sg, tp, sl, return_parts=True)
    torch.testing.assert_close(loss, reference_dino(sg, sl, tp, b))
    torch.testing.assert_close(parts["dino_global"] + parts["dino_local"], loss)
    # Globals only: 2 terms (A<-B, B<-A).
    torch.testing.assert_close(loss_fn(sg, tp), reference_dino(sg, sl[:0], tp, b))


def test_dino_loss_is_minimal_when_student_matches_teacher():
    b, k, temp = 3, 6, 0.1
    t_one = torch.softmax(rand(b, k, seed=4), dim=-1)
    tp = t_one.repeat(2, 1)  # both global views agree, so every pair compares the same distributions
    entropy = -(t_one * t_one.log()).sum(-1).mean()
    matched = (temp * t_one.log()).repeat(2, 1).requires_grad_()  # softmax(matched / T) == teacher
    loss_fn = DINOLoss(k, student_temp=temp)
    loss = loss_fn(matched, tp, matched.detach()[:b].repeat(4, 1))
    torch.testing.assert_close(loss, entropy)  # cross-entropy == entropy: the minimum (KL = 0)
    loss.backward()
    assert matched.grad.abs().max() < 1e-6
    for seed in range(5):
        other = matched.detach() + 0.3 * rand(2 * b, k, seed=10 + seed)
        assert loss_fn(other, tp) > entropy
    assert entropy > 0


def test_dino_loss_centring_and_sk_targets_are_distributions():
    for mode in ("centering", "sinkhorn_knopp"):
        loss_fn = DINOLoss(5, centering=mode)
        tp = loss_fn.teacher_probs(rand(8, 5), teacher_temp=0.04)
        torch.testing.assert_close(tp.sum(-1), torch.ones(8))
    with pytest.raises(ValueError, match="global"):
        DINOLoss(5)(rand(6, 5), torch.softmax(rand(8, 5), -1))


def test_ibot_loss_matches_reference_and_weights_images_equally():
    k = 5
    masks = torch.zeros(4, 6, dtype=torch.bool)
    masks[0, :1] = True  # 1 masked patch
    masks[1, :4] = True  # 4 masked patches; images 2, 3 unmasked
    m = int(masks.sum())
    s, t = rand(m, k, seed=5), torch.softmax(rand(m, k, seed=6), dim=-1)
    loss_fn = IBOTPatchLoss(k, student_temp=0.1)
    loss = loss_fn(s, t, n_images=4, masks=masks)
    ce = -(t * torch.log_softmax(s / 0.1, dim=-1)).sum(-1)
    want = (ce[0] / 1 + ce[1:].sum() / 4) / 4  # per-image mean over its masked patches, / all images
    torch.testing.assert_close(loss, want)
    w = mask_token_weights(masks)
    torch.testing.assert_close(w, torch.tensor([1.0, 0.25, 0.25, 0.25, 0.25]))
    torch.testing.assert_close(loss_fn(s, t, n_images=4, masks_weight=w), loss)
    with pytest.raises(ValueError, match="mask"):
        loss_fn(s, t, n_images=4)


def test_ibot_loss_with_no_masked_patch_is_zero():
    loss_fn = IBOTPatchLoss(5)
    s = torch.zeros(0, 5, requires_grad=True)
    t = loss_fn.teacher_probs(torch.zeros(0, 5), 0.07)
    loss = loss_fn(s, t, n_images=4, masks=torch.zeros(4, 6, dtype=torch.bool))
    assert loss.item() == 0.0
    loss.backward()


def reference_koleo(x, eps=1e-8):
    """DINOv2's KoLeoLoss (diagonal filled with -1, nn.PairwiseDistance)."""
    x = F.normalize(x, eps=eps, p=2, dim=-1)
    dots = x @ x.t()
    dots.view(-1)[:: x.shape[0] + 1].fill_(-1)
    idx = dots.argmax(dim=1)
    return -torch.log(torch.nn.PairwiseDistance(2, eps=eps)(x, x[idx]) + eps).mean()


def test_koleo_matches_reference_and_handles_tiny_batches():
    x = rand(8, 16, seed=7)
    torch.testing.assert_close(koleo_loss(x), reference_koleo(x))
    # Batch 2: each point's neighbour is the other one.
    two = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    torch.testing.assert_close(koleo_loss(two), -torch.log(torch.tensor(math.sqrt(2.0))), atol=1e-5, rtol=0)
    # Batch 1: no neighbour; 0, finite, and differentiable.
    one = rand(1, 16).requires_grad_()
    loss = KoLeoLoss()(one)
    assert loss.item() == 0.0 and torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(one.grad).all()
    assert koleo_loss(rand(0, 16)).item() == 0.0


def test_koleo_decreases_as_points_spread():
    centre = rand(1, 8, seed=8)
    noise = rand(16, 8, seed=9)
    losses = [koleo_loss(centre + s * noise).item() for s in (0.01, 0.1, 1.0, 10.0)]
    assert all(a > b for a, b in zip(losses, losses[1:])), losses
    # Gradient descent on KoLeo spreads the points.
    x = (centre + 0.05 * noise).requires_grad_()
    opt = torch.optim.SGD([x], lr=0.05)
    start = koleo_loss(x).item()
    for _ in range(20):
        opt.zero_grad()
        koleo_loss(x).backward()
        opt.step()
    assert koleo_loss(x).item() < start


def test_koleo_runs_in_float32_under_bf16_autocast():
    x = rand(6, 8, seed=11).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = koleo_loss(x)
    assert out.dtype == torch.float32 and torch.isfinite(out)
