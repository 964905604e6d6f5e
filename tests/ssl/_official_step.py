"""What the official-step test and its fixture generator share: the recipe, the start state and the batches.

Everything here is generated from fixed numpy seeds (no torch RNG, no file), so the generator
(``tests/fixtures/make_dinov2_step.py``, run once against the official code) and the test (run in CI against
dinopipe) start from bit-identical tensors; the fixture only holds what the official code produced.

The recipe is DINOv2's ViT-g/14 one shrunk: SwiGLU, 4 registers, LayerScale, separate DINO and iBOT heads with
weight-normed prototypes, Sinkhorn–Knopp, KoLeo, layer decay 0.9, patch-embed lr x0.2, clip 3.0, last layer frozen
in the first epoch, teacher temperature still warming up. Two optimizer steps (iterations 3 and 4): the first
starts AdamW from nothing with the last layer frozen, the second has real moments and the last layer free.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

DIM, DEPTH, HEADS, PATCH, GLOBAL, LOCAL = 32, 2, 2, 4, 16, 8
N_REG, N_LOCAL, BATCH = 4, 2, 4
HEAD = dict(n_prototypes=96, hidden_dim=64, bottleneck_dim=24, nlayers=3)
IBOT_HEAD = dict(n_prototypes=80, hidden_dim=48, bottleneck_dim=24, nlayers=3)
ITERATIONS = (3, 4)
EPOCH_LENGTH, EPOCHS = 4, 10
RECIPE = dict(base_lr=0.02, min_lr=1e-6, warmup_epochs=2, weight_decay=0.04, weight_decay_end=0.2,
              layerwise_decay=0.9, patch_embed_lr_mult=0.2, clip_grad=3.0, freeze_last_layer_epochs=1,
              momentum_teacher=0.994, final_momentum_teacher=1.0, warmup_teacher_temp=0.04, teacher_temp=0.07,
              warmup_teacher_temp_epochs=5, koleo_loss_weight=0.1, init_values=1e-5)
"""base_lr is large so that both steps move every tensor well above float32 rounding."""


def _rng(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32("/".join(map(str, key)).encode()))


def initial_value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The start value of the official-layout student parameter ``name`` (teacher = student at the start, as
    DINOv2's ``prepare_for_distributed_training`` makes it)."""
    r = _rng("init", name).standard_normal(shape)
    leaf = name.split(".")[-1]
    if "norm" in name and leaf == "weight":
        v = 1 + 0.1 * r
    elif leaf == "bias":
        v = 0.02 * r
    elif leaf == "gamma":
        v = 0.2 + 0.05 * r  # LayerScale large enough that every block shapes the output
    elif leaf == "weight_g":
        v = 1 + 0.1 * r
    elif leaf in ("cls_token", "pos_embed", "register_tokens", "mask_token"):
        v = 0.1 * r
    else:  # linear / conv weights: unit-variance activations
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        v = r / np.sqrt(fan_in)
    return torch.from_numpy(v.astype(np.float32))


def batch(iteration: int, order: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """One collated batch (crop-major like both collators), images optionally permuted by ``order``."""
    r = _rng("batch", iteration)
    g = r.standard_normal((2, BATCH, 3, GLOBAL, GLOBAL)).astype(np.float32)
    loc = r.standard_normal((N_LOCAL, BATCH, 3, LOCAL, LOCAL)).astype(np.float32)
    n = (GLOBAL // PATCH) ** 2
    masks = np.zeros((2, BATCH, n), dtype=bool)
    for c in range(2):
        for b in range(BATCH):
            if (c * BATCH + b) % 2 == 0:  # half the global crops masked (mask_sample_probability 0.5)
                k = 2 + (c * BATCH + b) % 5
                masks[c, b, r.choice(n, size=k, replace=False)] = True
    if order is not None:
        g, loc, masks = g[:, order], loc[:, order], masks[:, order]
    masks_t = torch.from_numpy(masks.reshape(2 * BATCH, n))
    per_image = 1.0 / masks_t.sum(-1).clamp(min=1).float()
    return {
        "global_crops": torch.from_numpy(np.ascontiguousarray(g.reshape(2 * BATCH, 3, GLOBAL, GLOBAL))),
        "local_crops": torch.from_numpy(np.ascontiguousarray(loc.reshape(N_LOCAL * BATCH, 3, LOCAL, LOCAL))),
        "masks": masks_t,
        "mask_indices": masks_t.flatten().nonzero().flatten(),
        "masks_weight": per_image.unsqueeze(-1).expand_as(masks_t)[masks_t],
    }


def permutation() -> np.ndarray:
    return np.array([2, 0, 3, 1])


def permutations() -> list[np.ndarray]:
    """The image orders whose runs measure the official run-to-run noise (the max over them: one order alone
    under-estimates it, and dinopipe's own rounding then sits at its edge)."""
    return [np.array([2, 0, 3, 1]), np.array([3, 2, 1, 0]), np.array([1, 3, 0, 2])]


def part(name: str) -> str:
    """The group a parameter piece is held in: backbone | dino_head | ibot_head (the parts clipped separately),
    and apart from them the attention key biases: their gradient is zero in exact arithmetic (softmax ignores a
    constant added to every key's score), so their AdamW update is amplified rounding noise in both codes."""
    return "key_bias" if name.endswith("qkv.bias[k]") else name.split(".")[0]


def pieces(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A parameter cut where its rows play different roles: a qkv bias into its q, k and v thirds."""
    if name.endswith("attn.qkv.bias"):
        return [(f"{name}[{k}]", c) for k, c in zip("qkv", t.chunk(3))]
    return [(name, t)]


def float32_resolution(b: torch.Tensor, start: torch.Tensor) -> float:
    """One float32 rounding of the piece's largest value, as a fraction of its update: no float32 computation
    of the same step can be held closer (it decides the teacher, whose EMA update is ~1e-4 of its values)."""
    return torch.finfo(torch.float32).eps * b.abs().max().item() / max((b - start).abs().max().item(), 1e-30)


def relative_deviation(a: torch.Tensor, b: torch.Tensor, start: torch.Tensor) -> float:
    """max |a - b| as a fraction of the largest element of the official update ``b - start``."""
    update = (b - start).abs().max().item()
    return (a - b).abs().max().item() / max(update, 1e-30)
