"""What the DINOv3 official-step test and its fixture generator share: the recipe, the start state and the batches.

As ``_official_step.py`` (DINOv2), everything comes from fixed numpy seeds, so the generator
(``tests/fixtures/make_dinov3_step.py``, run once against the official code) and the test start from
bit-identical tensors. The recipe is DINOv3's ViT-7B Gram-anchoring stage (``dinov3_vit7b16_gram_anchor.yaml``)
shrunk: SwiGLU aligned to 64, no qkv bias (masked key bias), 4 storage tokens, LayerScale, RoPE with the
coordinate rescale augmentation (2), a separate norm for the local crops' class tokens, linear prototype layers,
Sinkhorn–Knopp, KoLeo, the local-crop DINO weight on its cosine schedule, teacher momentum 0.999, AdamW beta2
0.99, layer decay 0.9, patch-embed lr x0.2, clip 3.0, last layer frozen in the first epoch, and Gram anchoring:
the Gram teacher copied from the EMA teacher before iteration 3 and refreshed from it after iteration 3, seeing
the global crops at 2x their size, its patch grid resampled (bicubic) to the student's.
"""

from __future__ import annotations

import numpy as np
import torch

from ._official_step import (  # noqa: F401  (shared rules)
    _rng, float32_resolution, permutation, permutations, pieces, relative_deviation)

DIM, DEPTH, HEADS, PATCH, GLOBAL, LOCAL, GRAM = 32, 2, 2, 4, 16, 8, 32
N_STORAGE, N_LOCAL, BATCH = 4, 2, 4
HEAD = dict(n_prototypes=96, hidden_dim=64, bottleneck_dim=24, nlayers=3)
IBOT_HEAD = dict(n_prototypes=80, hidden_dim=48, bottleneck_dim=24, nlayers=3)
ITERATIONS = (3, 4)
EPOCH_LENGTH, EPOCHS = 4, 10
LR_PEAK = 0.005
"""DINOv3's schedules.lr.peak; its sqrt_wrt_1024 rule multiplies by 4 * sqrt(batch / 1024) (dinopipe: base_lr 4x)."""
RECIPE = dict(lr_warmup_epochs=2, freeze_last_layer_epochs=1, weight_decay=0.04, momentum=0.999,
              warmup_teacher_temp=0.04, teacher_temp=0.07, warmup_teacher_temp_epochs=5, layerwise_decay=0.9,
              patch_embed_lr_mult=0.2, clip_grad=3.0, adamw_beta1=0.9, adamw_beta2=0.99, koleo_loss_weight=0.1,
              init_values=1e-5, rope_rescale=2.0, gram_loss_weight=1.5,
              local_weight=dict(start=1.0, peak=1.0, end=0.5, warmup_epochs=0, cosine_epochs=2))
GRAM_FIRST, GRAM_REFRESH = 3, 4
"""The Gram teacher is the EMA teacher before iteration 3 (``it_load_ema_teacher``) and again after iteration 3
(``it_first_update`` 4, ``update_frequency`` 1, ``max_updates`` 1): step 4 is anchored to the teacher after step 3."""


def seed(iteration: int) -> int:
    """torch seed set before each step in both codes: the student's RoPE rescale draws (per block and crop group)
    are the only random numbers a step takes, so both draw the same ones."""
    return 1000 + iteration


def initial_value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Start value of the official-layout student parameter ``name`` (backbone.*, dino_head.*, ibot_head.*)."""
    r = _rng("init-v3", name).standard_normal(shape)
    leaf = name.split(".")[-1]
    if "norm" in name and leaf == "weight":
        v = 1 + 0.1 * r
    elif leaf == "bias":
        v = 0.02 * r
    elif leaf == "gamma":
        v = 0.2 + 0.05 * r  # LayerScale large enough that every block shapes the output
    elif leaf in ("cls_token", "storage_tokens", "mask_token"):
        v = 0.1 * r
    else:  # linear / conv weights: unit-variance activations
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        v = r / np.sqrt(fan_in)
    return torch.from_numpy(v.astype(np.float32))


def batch(iteration: int, order: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """One collated batch (crop-major like both collators) with the Gram teacher's crops, optionally permuted."""
    r = _rng("batch-v3", iteration)
    g = r.standard_normal((2, BATCH, 3, GLOBAL, GLOBAL)).astype(np.float32)
    loc = r.standard_normal((N_LOCAL, BATCH, 3, LOCAL, LOCAL)).astype(np.float32)
    gram = r.standard_normal((2, BATCH, 3, GRAM, GRAM)).astype(np.float32)
    n = (GLOBAL // PATCH) ** 2
    masks = np.zeros((2, BATCH, n), dtype=bool)
    for c in range(2):
        for b in range(BATCH):
            if (c * BATCH + b) % 2 == 0:
                k = 2 + (c * BATCH + b) % 5
                masks[c, b, r.choice(n, size=k, replace=False)] = True
    if order is not None:
        g, loc, gram, masks = g[:, order], loc[:, order], gram[:, order], masks[:, order]
    masks_t = torch.from_numpy(masks.reshape(2 * BATCH, n))
    per_image = 1.0 / masks_t.sum(-1).clamp(min=1).float()
    return {
        "global_crops": torch.from_numpy(np.ascontiguousarray(g.reshape(2 * BATCH, 3, GLOBAL, GLOBAL))),
        "local_crops": torch.from_numpy(np.ascontiguousarray(loc.reshape(N_LOCAL * BATCH, 3, LOCAL, LOCAL))),
        "gram_crops": torch.from_numpy(np.ascontiguousarray(gram.reshape(2 * BATCH, 3, GRAM, GRAM))),
        "masks": masks_t,
        "mask_indices": masks_t.flatten().nonzero().flatten(),
        "masks_weight": per_image.unsqueeze(-1).expand_as(masks_t)[masks_t],
    }


def part(name: str) -> str:
    """backbone | dino_head | ibot_head: the parts clipped separately (no qkv bias, so no key-bias group)."""
    return name.split(".")[0]
