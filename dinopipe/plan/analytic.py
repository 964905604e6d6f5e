"""Memory / FLOP / time planner for SSL pretraining (``dinopipe plan``).

Answers, before a cluster is booked: how much of each GPU the model state takes under FSDP2, how much one
image's activations take (with and without activation checkpointing, fused vs. math attention), the largest
per-GPU batch that fits, the FLOPs of one step, and the time and GPU-hours of the whole run at a given MFU.

Everything is derived from the real layer shapes: the backbone and heads are built on the meta device (no
memory, no weights) from the same config the trainer reads. Activation bytes are the tensors autograd keeps
for backward, counted per operation of ``Block`` (norms, qkv, attention, proj, LayerScale, MLP / SwiGLU, drop
path); ``tests/test_plan.py`` checks them against the bytes actually saved by autograd on CPU, the parameter
and AdamW bytes against a built model, and the forward FLOPs against ``torch.utils.flop_counter``.

Conventions: ``--gpu-mem-gb`` is GiB (an "80 GB" card has ~80 GiB); FLOPs count a multiply-add as 2; MFU uses
model FLOPs (forward + 2x backward, no recomputation), so activation checkpointing costs time at a fixed MFU
only through the separately reported hardware FLOPs. One GPU means no FSDP and fp32 compute, as the trainer
runs it (``parallelize`` shards only when distributed).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
from timm.layers import GluMlp, LayerScale, Mlp
from torch import nn

from ..config import phase_steps, reduce_dtypes
from ..models import DINOHead, create_model
from ..models.block import EFFICIENT_DROP_PATH_MIN_RATE, subset_size
from .comm import DTYPE_BYTES, plan_comm, sharded_numel
from .report import format_report
from .gram import (describe_gram, gram_active_flops, gram_on, gram_state_bytes, gram_step_flops, gram_step_memory,
                        largest_variant, phase_variants)

GiB = 1024**3


@dataclass
class Arch:
    """The shapes the planner needs, read off a meta-device model."""

    dim: int
    depth: int
    num_heads: int
    patch_size: int
    num_register_tokens: int
    block_linear_flops: int  # 2 * sum(in * out) over the Linear layers of one block, per token
    fc1_out: int  # MLP hidden (fc1 output width; 2 * hidden for packed SwiGLU)
    layer_scale: bool
    drop_rates: list[float]
    efficient_drop_path: bool
    block_params: list[int]
    root_params: int  # backbone params outside the blocks (patch embed, tokens, final norm)
    backbone_numels: list[tuple[int, ...]]  # every parameter shape (for FSDP padding)
    rope: bool = False  # DINOv3: RoPE instead of a position embedding (registers = its storage tokens)


@dataclass
class HeadArch:
    name: str
    in_dim: int
    hidden: list[int]  # outputs of the MLP layers before the bottleneck
    bottleneck: int
    n_prototypes: int
    shapes: list[tuple[int, ...]]

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def token_flops(self) -> int:
        dims = [self.in_dim, *self.hidden, self.bottleneck]
        return 2 * (sum(a * b for a, b in zip(dims, dims[1:])) + self.bottleneck * self.n_prototypes)

    def saved_per_token(self, c: int, lsm: int = 4) -> int:
        """Linear inputs + GELU inputs + normalize input + prototype-layer input (compute dtype), and the
        log-softmax of the logits the loss keeps: fp32 for DINO (``lsm`` = 4), the compute dtype for iBOT
        (ssl/losses.py: ``lsm`` = c)."""
        return c * (self.in_dim + 2 * sum(self.hidden) + 2 * self.bottleneck) + lsm * self.n_prototypes


def _shapes(module: nn.Module) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in module.parameters()]


def describe(cfg) -> tuple[Arch, list[HeadArch]]:
    """Build the student backbone and heads of a PretrainConfig on the meta device and read their shapes.

    A ``model.pretrained`` file is not opened: the registry variant ``model.name`` stands for it.
    """
    with torch.device("meta"):
        bb = create_model(cfg.model.name, **cfg.model.create_kwargs())
        heads_cfg = [("dino_head", cfg.dino.head)]
        if cfg.ibot.separate_head:
            heads_cfg.append(("ibot_head", cfg.ibot.head))
        heads = [(n, DINOHead(bb.embed_dim, h.n_prototypes, h.hidden_dim, h.bottleneck_dim, h.nlayers))
                 for n, h in heads_cfg]
    arch = backbone_arch(bb)
    head_archs = []
    for name, h in heads:
        linears = [m for m in h.mlp if isinstance(m, nn.Linear)]
        head_archs.append(HeadArch(name, bb.embed_dim, [m.out_features for m in linears[:-1]],
                                   linears[-1].out_features, h.last_layer.out_features, _shapes(h)))
    return arch, head_archs


def backbone_arch(bb: nn.Module) -> Arch:
    """The planner's shapes of a built backbone (any device, meta included); the benches count FLOPs with it."""
    blk = bb.blocks[0]
    if not isinstance(blk.mlp, (Mlp, GluMlp)):
        raise ValueError(f"planner knows Mlp and GluMlp (SwiGLU) blocks, not {type(blk.mlp).__name__}")
    lin = sum(2 * m.in_features * m.out_features for m in blk.modules() if isinstance(m, nn.Linear))
    block_params = [sum(p.numel() for p in b.parameters()) for b in bb.blocks]
    return Arch(
        dim=bb.embed_dim, depth=len(bb.blocks), num_heads=bb.num_heads, patch_size=bb.patch_size,
        num_register_tokens=bb.num_register_tokens, block_linear_flops=lin, fc1_out=blk.mlp.fc1.out_features,
        layer_scale=isinstance(blk.ls1, LayerScale), drop_rates=[b.drop_path_rate for b in bb.blocks],
        efficient_drop_path=blk.efficient_drop_path, block_params=block_params,
        root_params=sum(p.numel() for p in bb.parameters()) - sum(block_params), backbone_numels=_shapes(bb),
        rope=hasattr(bb, "rope_embed"))


# -- parameters, gradients, optimizer ---------------------------------------------------------------------


def state_memory(arch: Arch, heads: list[HeadArch], n_gpus: int, param_dtype: str, reduce_dtype: str,
                 head_reduce_dtype: Optional[str] = None) -> dict:
    """Per-GPU bytes of model state. Sharded state stays fp32 (FSDP2 keeps the original dtype and all-gathers
    ``param_dtype`` copies per unit); one unit (a block or a head) is unsharded at a time plus one prefetched,
    and in backward its unsharded gradient (+ a ``reduce_dtype`` copy for the reduce-scatter; a head's in
    ``head_reduce_dtype``, None: the same)."""
    shapes = arch.backbone_numels + [s for h in heads for s in h.shapes]
    local = sum(sharded_numel(s, n_gpus) for s in shapes)
    params = local * 4
    out = {
        "student_params": params,
        "student_grads": params,
        "optimizer": 2 * params,  # AdamW exp_avg + exp_avg_sq (fp32; `step` lives on the host)
        "teacher_params": params,  # EMA copy, no gradients, no optimizer state
        "unsharded_units": 0,
    }
    if n_gpus > 1:
        cp = DTYPE_BYTES[param_dtype]

        def need(n: int, reduce: str) -> int:
            cr = DTYPE_BYTES[reduce]
            return n * (3 * cp + (cr if cr != cp else 0))

        head_reduce = head_reduce_dtype or reduce_dtype
        out["unsharded_units"] = max([need(n, reduce_dtype) for n in arch.block_params + [arch.root_params]]
                                     + [need(h.params, head_reduce) for h in heads])
    out["total"] = sum(out.values())
    return out


def counted_peak(state: dict, act_peak: int) -> int:
    """Per-GPU peak of state + activations. The activation peak falls at the loss, where backward is about to
    start: no gradient exists yet (``zero_grad(set_to_none=True)``; FSDP2 writes each unit's sharded gradient
    when its backward ends) and no unit is gathered (heads and blocks reshard after forward; a peak inside a
    no-grad teacher forward carries its gathered unit in ``act_peak``, :func:`step_memory`). Gradients and
    gathered units peak later, at the last blocks' backward and the optimizer step, when the activations are
    gone. Checked against the traced real step (``plan --trace``, tests/test_plan_trace.py)."""
    late = state["student_grads"] + state["unsharded_units"]
    return state["total"] - late + max(act_peak, late)


def param_counts(arch: Arch, heads: list[HeadArch]) -> dict:
    backbone = sum(arch.block_params) + arch.root_params
    out = {"backbone": backbone, **{h.name: h.params for h in heads}}
    out["student"] = backbone + sum(h.params for h in heads)
    out["teacher"] = out["student"]
    return out


# -- activations ----------------------------------------------------------------------------------------


def tokens(arch: Arch, img: int) -> int:
    return 1 + arch.num_register_tokens + (img // arch.patch_size) ** 2


def _kept(groups: list[tuple[int, int]], rate: float, efficient: bool) -> list[tuple[int, int]]:
    """Groups as the residual branches see them: efficient drop path runs them on a subset of each group."""
    if efficient and rate > EFFICIENT_DROP_PATH_MIN_RATE:
        return [(subset_size(b, rate), n) for b, n in groups]
    return list(groups)


def block_saved_bytes(arch: Arch, groups: list[tuple[int, int]], c: int, attn: str, rate: float = 0.0,
                      stat_bytes: int = 4) -> int:
    """Bytes autograd keeps for one Block's backward over crop groups [(batch, tokens)].

    Per branch token: LayerNorm input (+ mean/rstd), qkv input and output (q, k, v are views of it for a fused
    kernel), the attention output (+ logsumexp), the proj input when packed groups are concatenated, the
    LayerScale input; MLP: fc1 input, 2 x fc1 output width (GELU in/out; SwiGLU fc1 out + act + product), the
    fc2 output LayerScale keeps. Math attention keeps q·scale and copies of k, v instead of the qkv output,
    plus per head the N x N softmax in fp32 (and its compute-dtype cast).
    """
    D, H = arch.dim, arch.num_heads
    kept = _kept(groups, rate, arch.efficient_drop_path)
    t = sum(b * n for b, n in kept)
    ls = int(arch.layer_scale)
    if attn == "math":
        attn_bytes = 4 * t * D * c + sum(H * b * n * n for b, n in kept) * (4 + (c if c != 4 else 0))
    else:
        attn_bytes = (4 + (len(kept) > 1)) * t * D * c + H * t * 4
    mlp_bytes = (1 + ls) * t * D * c + 2 * t * arch.fc1_out * c  # fc1 input, LayerScale input, hidden
    norms = 2 * (t * D * c + 2 * t * stat_bytes)
    # Drop path, per branch: the subset version keeps the branch output (index_add's source) and the sample
    # indices; the masked fallback keeps only its (B, 1, 1) keep mask.
    extra = 0
    if arch.efficient_drop_path and rate > EFFICIENT_DROP_PATH_MIN_RATE:
        extra = 2 * (t * D * c + 8 * sum(b for b, _ in groups))
    elif rate > 0:
        extra = 2 * c * sum(b for b, _ in groups)
    return norms + attn_bytes + (1 + ls) * t * D * c + mlp_bytes + extra


def rope_table_bytes(arch: Arch, groups: list[tuple[int, int]]) -> int:
    """RoPE's fp32 (sin, cos) tables, (patches, head_dim) per crop group: built once per forward and kept
    for backward by every block's rotation (the same tensors, so counted once). The rotated q/k replace the
    qkv output in what attention keeps, so RoPE adds nothing else."""
    if not arch.rope:
        return 0
    hd = arch.dim // arch.num_heads
    return sum(2 * (n - 1 - arch.num_register_tokens) * hd * 4 for _, n in groups)


def nograd_block_bytes(arch: Arch, n_tokens: int, c: int) -> int:
    """Most bytes alive inside one block of a no-grad forward (EMA / Gram teacher) over ``n_tokens`` tokens.

    Attention: the block input, the norm's output, qkv, then the attention output and its contiguous copy, or for
    RoPE the rotated q/k temporaries (q·cos, rotate_half, ·sin, their sum: ~6 D). MLP: the block input, the
    residual after attention, the norm's output (the caller holds it during the call) and 2 x fc1 width (GELU in /
    out; SwiGLU fc1 out + act + product). A DINOv3 forward also keeps its patch-embedding tokens for the whole
    forward (``forward_features_list``'s ``prepared``). Checked per op against the traced 7B and ViT-L blocks
    (docs/training-scale.md)."""
    D, F = arch.dim, arch.fc1_out
    kept = (1 + int(arch.rope)) * D
    attention = kept + 4 * D + (6 * D if arch.rope else 2 * D)
    mlp = kept + 2 * D + 2 * F
    return n_tokens * max(attention, mlp) * c


def forward_gathered_bytes(arch: Arch, heads: list[HeadArch], c: int, n_gpus: int) -> int:
    """Bytes of gathered parameters during a forward under FSDP2 (0 on one GPU): the running unit's unsharded
    parameters and its all-gather output, whose free FSDP2 defers in forward until the next unit's copy-out
    (``FSDPParamGroup.wait_for_unshard``: "defer free to allow for overlap")."""
    if n_gpus <= 1:
        return 0
    return 2 * c * max(arch.block_params + [h.params for h in heads])


def backbone_saved_bytes(arch: Arch, groups: list[tuple[int, int]], sizes: list[int], c: int, attn: str,
                         checkpointing: bool, stat_bytes: int = 4) -> int:
    """Bytes kept over the whole student backbone forward (images, blocks, final norm).

    With activation checkpointing a block keeps only its input; its own activations exist again only while
    its backward runs (counted by :func:`step_memory` as the one recomputed block)."""
    t = sum(b * n for b, n in groups)
    images = sum(b * 3 * s * s * c for (b, _), s in zip(groups, sizes))  # the patch conv keeps its input
    final_norm = t * arch.dim * c + 2 * t * stat_bytes
    if checkpointing:
        blocks = arch.depth * t * arch.dim * c
    else:
        rates = Counter(arch.drop_rates)  # uniform schedules: one evaluation for all blocks
        blocks = sum(k * block_saved_bytes(arch, groups, c, attn, r, stat_bytes) for r, k in rates.items())
    return images + blocks + final_norm + rope_table_bytes(arch, groups)


def masked_patches(cfg, n_global: int, n_patches: int, upper: bool) -> float:
    """iBOT masked patches in a batch of ``n_global`` global crops (DINOv2's stratified ratios)."""
    n_masked = int(n_global * cfg.ibot.mask_sample_probability)
    lo, hi = cfg.ibot.mask_ratio_min_max
    if upper:
        edges = [lo + (hi - lo) * (i + 1) / n_masked for i in range(n_masked)]
        return sum(int(n_patches * e) for e in edges)
    return n_masked * n_patches * (lo + hi) / 2


def _groups(cfg, phase, b: int, arch: Arch) -> tuple[list[tuple[int, int]], list[int]]:
    groups = [(2 * b, tokens(arch, phase.global_crops_size))]
    sizes = [phase.global_crops_size]
    if cfg.crops.local_crops_number > 0:
        groups.append((cfg.crops.local_crops_number * b, tokens(arch, phase.local_crops_size)))
        sizes.append(phase.local_crops_size)
    return groups, sizes


def batch_bytes(cfg, phase, b: int, n_patches: int, m: float) -> int:
    """The collated batch on the device for the whole step: fp32 global, local (and Gram) crops, the iBOT masks
    (bool), mask indices (int64) and weights (fp32); one copy per micro-batch of ``train.accumulate``."""
    crops = 2 * b * phase.global_crops_size ** 2 + cfg.crops.local_crops_number * b * phase.local_crops_size ** 2
    if gram_on(cfg) and getattr(phase, "gram_crops_size", None):
        crops += 2 * b * phase.gram_crops_size ** 2
    acc = max(1, int(getattr(getattr(cfg, "train", None), "accumulate", 1) or 1))
    return int(acc * (3 * crops * 4 + 2 * b * n_patches + m * 12))


def _head_tokens(cfg, heads: list[HeadArch], groups, n_masked: float) -> list[tuple[HeadArch, float]]:
    """(head, tokens it sees in the student): DINO on every crop's CLS, iBOT on the masked patches."""
    cls = sum(b for b, _ in groups)
    if len(heads) == 1:
        return [(heads[0], cls + n_masked)]
    return [(heads[0], cls), (heads[1], n_masked)]


def step_memory(cfg, arch: Arch, heads: list[HeadArch], phase, b: int, c: int, attn: str,
                checkpointing: bool, n_masked: Optional[int] = None, stat_bytes: int = 4, n_gpus: int = 1) -> dict:
    """Activation-side bytes of one step at per-GPU batch b (peak over teacher forward and student fwd/bwd).

    iBOT buffers are sized for the most patches the masking can draw unless ``n_masked`` is given. ``n_gpus`` > 1:
    the no-grad teacher forwards hold one gathered FSDP2 unit (:func:`forward_gathered_bytes`)."""
    groups, sizes = _groups(cfg, phase, b, arch)
    n_patches = (phase.global_crops_size // arch.patch_size) ** 2
    m = masked_patches(cfg, 2 * b, n_patches, upper=True) if n_masked is None else n_masked
    D, F = arch.dim, arch.fc1_out
    K = [h.n_prototypes for h in heads]
    t = sum(bb * n for bb, n in groups)
    # Teacher: no_grad forward of the global crops; what outlives it are fp32 targets for the student losses.
    # train.accumulate=K (b is one micro-batch): the targets of all K micro-batches are computed first (centring /
    # Sinkhorn-Knopp over their union) and held through the K forward/backward passes; their logits are
    # concatenated (a second compute-dtype copy) before the softmax work.
    acc = max(1, int(getattr(getattr(cfg, "train", None), "accumulate", 1) or 1))
    targets = acc * (2 * b * K[0] + m * K[-1]) * 4
    tg = groups[0][0] * groups[0][1]
    attn_nn = sum(arch.num_heads * bb * n * n for bb, n in groups) * (4 + c) if attn == "math" else 0
    teacher_nn = arch.num_heads * groups[0][0] * groups[0][1] ** 2 * (8 + c) if attn == "math" else 0
    # no_grad working set of one teacher block (with its gathered unit under FSDP2) and its logits.
    teacher_block = nograd_block_bytes(arch, tg, c) + teacher_nn + forward_gathered_bytes(arch, heads, c, n_gpus)
    scores = (2 * b + m) * max(K)  # prototype scores of one micro-batch
    if acc == 1:
        teacher_total = teacher_block + scores * (c + 8) + targets
    else:  # K logits kept, their concatenation, and the fp32 softmax / Sinkhorn-Knopp work over all of them
        teacher_total = max(teacher_block + (acc - 1) * scores * c, acc * scores * (2 * c + 8))
    # Student.
    backbone = backbone_saved_bytes(arch, groups, sizes, c, attn, checkpointing, stat_bytes)
    head_tok = _head_tokens(cfg, heads, groups, m)
    # the DINO loss keeps an fp32 log-softmax of its CLS logits, the iBOT loss one in the compute dtype of its
    # masked-patch logits (ssl/losses.py), and so does the gradient that starts the backward
    n_ibot = {id(h): (m if i == len(head_tok) - 1 else 0) for i, (h, _) in enumerate(head_tok)}
    head_saved = sum(h.saved_per_token(c) * (n - n_ibot[id(h)]) + h.saved_per_token(c, c) * n_ibot[id(h)]
                     + h.n_prototypes * h.bottleneck * c for h, n in head_tok)
    logits_grad = sum(((n - n_ibot[id(h)]) * (4 + c) + n_ibot[id(h)] * 2 * c) * h.n_prototypes
                      for h, n in head_tok)  # start of backward
    workspace = t * (2 * F + 3 * D) * c + attn_nn  # gradients alive inside one block's backward
    if checkpointing:
        workspace += max(block_saved_bytes(arch, groups, c, attn, r, stat_bytes) for r in set(arch.drop_rates))
    inputs = batch_bytes(cfg, phase, b, n_patches, m)
    teacher_total += inputs
    student_peak = inputs + targets + backbone + head_saved + max(logits_grad, workspace)
    # Gram anchoring (gram.py; zeros without it): its kept tensors exist from the loss on; its teacher's forward
    # runs after the student's, with the student's activations, heads and targets alive and one Gram block gathered.
    gram = gram_step_memory(cfg, arch, phase, b, c, tokens, nograd_block_bytes)
    student_peak += gram["gram_kept"]
    gram_forward = gram["gram_forward_peak"] + (forward_gathered_bytes(arch, [], c, n_gpus) if gram["gram_forward_peak"] else 0)
    gram_peak = inputs + targets + backbone + head_saved + gram_forward
    return {
        **gram,
        "inputs": inputs,
        "backbone_activations": backbone,
        "head_activations": head_saved,
        "teacher_targets": targets,
        "backward_transient": max(logits_grad, workspace),
        "teacher_forward_peak": teacher_total,
        "peak": max(student_peak, teacher_total, gram_peak),
    }


# -- FLOPs --------------------------------------------------------------------------------------------


def crop_forward_flops(arch: Arch, img: int, rates: Optional[list[float]] = None, batch: int = 1) -> float:
    """Forward FLOPs of ``batch`` crops of size ``img``: patch embedding + blocks (linear layers and
    4·N²·d attention), with the compute efficient drop path skips at the given per-block rates."""
    n = tokens(arch, img)
    patches = (img // arch.patch_size) ** 2
    flops = 2 * 3 * arch.patch_size**2 * arch.dim * patches * batch
    for r in rates if rates is not None else [0.0] * arch.depth:
        (k, _), = _kept([(batch, n)], r, arch.efficient_drop_path)
        flops += k * (n * arch.block_linear_flops + 4 * n * n * arch.dim)
    return flops


def step_flops(cfg, arch: Arch, heads: list[HeadArch], phase, b: int) -> dict:
    """FLOPs of one step on one GPU: student fwd + bwd (= 3x fwd; the patch conv 2x, its input needs no
    gradient) over all crops, teacher forward on the global crops, heads on CLS tokens and masked patches."""
    groups, sizes = _groups(cfg, phase, b, arch)
    n_patches = (phase.global_crops_size // arch.patch_size) ** 2
    m = masked_patches(cfg, 2 * b, n_patches, upper=False)
    embed = sum(2 * 3 * arch.patch_size**2 * arch.dim * (s // arch.patch_size) ** 2 * bb
                for (bb, _), s in zip(groups, sizes))
    student_blocks = sum(crop_forward_flops(arch, s, arch.drop_rates, bb) for (bb, _), s in zip(groups, sizes)) - embed
    head_fwd = sum(h.token_flops() * n for h, n in _head_tokens(cfg, heads, groups, m))
    teacher_groups = groups[:1]
    teacher = crop_forward_flops(arch, sizes[0], None, teacher_groups[0][0])
    teacher += sum(h.token_flops() * n for h, n in _head_tokens(cfg, heads, teacher_groups, m))
    student = 3 * (student_blocks + head_fwd) + 2 * embed
    gram = gram_step_flops(cfg, arch, phase, b, crop_forward_flops)
    out = {"student": student, "teacher": teacher, "gram": gram, "model": student + teacher + gram}
    out["hardware_ac"] = out["model"] + student_blocks  # recompute of the checkpointed blocks
    return out


# -- the plan -----------------------------------------------------------------------------------------


def _fits(total: float, gpu_mem_gb: float) -> bool:
    return total <= gpu_mem_gb * GiB


def largest_batch(need, gpu_mem_gb: float, limit: int = 1 << 16) -> int:
    """Largest b with need(b) <= G GiB (need is increasing in b); 0 when not even one image fits."""
    if not _fits(need(1), gpu_mem_gb):
        return 0
    lo, hi = 1, 2
    while hi <= limit and _fits(need(hi), gpu_mem_gb):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(need(mid), gpu_mem_gb) else (lo, mid)
    return lo


def plan(cfg, gpus: int, gpu_mem_gb: float, gpu_tflops: Optional[float] = None, mfu: float = 0.4,
         margin: float = 0.10, overhead_gb: float = 1.0) -> dict:
    """Plan a PretrainConfig on ``gpus`` GPUs of ``gpu_mem_gb`` GiB. Returns a nested dict (bytes, FLOPs,
    seconds); :func:`format_report` prints it. ``margin`` is the allocator's fragmentation / safety share
    added on top of the counted bytes, ``overhead_gb`` the CUDA context and NCCL buffers."""
    if gpus < 1 or gpu_mem_gb <= 0 or not 0 < mfu <= 1:
        raise ValueError("need gpus >= 1, gpu_mem_gb > 0 and 0 < mfu <= 1")
    arch, heads = describe(cfg)
    p = cfg.parallel
    # compute dtype: FSDP2's MixedPrecisionPolicy with several GPUs, autocast with one (train/parallel.py);
    # under autocast norms and softmax stay fp32, so one GPU's bf16 figure is a slight underestimate
    c = DTYPE_BYTES[p.param_dtype]
    state = state_memory(arch, heads, gpus, p.param_dtype, *reduce_dtypes(p))
    if gram_state_bytes(cfg, arch, gpus, sharded_numel):  # the frozen Gram teacher: a third backbone copy
        g = gram_state_bytes(cfg, arch, gpus, sharded_numel)
        state = {**state, "gram_teacher_params": g, "total": state["total"] + g}
    fused = cfg.model.attn_backend if cfg.model.attn_backend != "math" else "sdpa"
    configured = "math" if cfg.model.attn_backend == "math" else "fused"

    def need(b, phase, ac, attn):
        act = step_memory(cfg, arch, heads, phase, b, c, attn, ac, n_gpus=gpus)["peak"]
        return counted_peak(state, act) * (1 + margin) + overhead_gb * GiB

    phases = []
    for full_phase, (start, end) in zip(cfg.phases, phase_steps(cfg)):
        steps = end - start
        # A high-res adaptation phase draws a size triple per batch: memory for the largest, FLOPs for the mix.
        phase, variants = largest_variant(full_phase), phase_variants(full_phase)
        b = phase.batch_size_per_gpu
        mem = {}
        for attn_name, attn in (("fused", fused), ("math", "math")):
            for ac in (False, True):
                sm = step_memory(cfg, arch, heads, phase, b, c, attn, ac, n_gpus=gpus)
                key = f"{attn_name}_{'ac' if ac else 'noac'}"
                mem[key] = {**sm, "per_image": (sm["backbone_activations"] + sm["head_activations"]) / b,
                            "total": need(b, phase, ac, attn),
                            "max_batch": largest_batch(lambda x: need(x, phase, ac, attn), gpu_mem_gb)}
        per = [(step_flops(cfg, arch, heads, v, b), w) for v, w in variants]
        fl = {k: sum(f[k] * w for f, w in per) for k in per[0][0]}
        fl = gram_active_flops(cfg, fl, start, end)  # no Gram teacher forward before gram.first_step
        ph = {"name": phase.name, "steps": steps, "batch_per_gpu": b, "global_batch": b * gpus,
              "global_crops_size": phase.global_crops_size, "local_crops_size": phase.local_crops_size,
              "tokens": [n for _, n in _groups(cfg, phase, 1, arch)[0]],
              "memory": mem, "flops": fl,
              "crop_forward_flops": {"global": crop_forward_flops(arch, phase.global_crops_size),
                                     "local": crop_forward_flops(arch, phase.local_crops_size)}}
        if gpu_tflops:
            step_s = fl["model"] / (gpu_tflops * 1e12 * mfu)
            ph.update(step_seconds=step_s, gpu_hours=steps * step_s * gpus / 3600, hours=steps * step_s / 3600)
        phases.append(ph)
    out = {"model": cfg.model.name, "gpus": gpus, "gpu_mem_gb": gpu_mem_gb, "gpu_tflops": gpu_tflops, "mfu": mfu,
           "margin": margin, "overhead_gb": overhead_gb, "compute_dtype": "fp32" if c == 4 else p.param_dtype,
           "activation_checkpointing": p.activation_checkpointing, "attention": configured,
           "params": param_counts(arch, heads), "state": state, "phases": phases,
           "total_steps": sum(ph["steps"] for ph in phases), "gram": describe_gram(cfg),
           "total_flops": sum(ph["steps"] * ph["flops"]["model"] * gpus for ph in phases)}
    if gpus > 1:
        out.update(comm=plan_comm(cfg, arch, heads, gpus), reduce_dtypes=list(reduce_dtypes(p)))
    if gpu_tflops:
        out["gpu_hours"] = sum(ph["gpu_hours"] for ph in phases)
        out["hours"] = sum(ph["hours"] for ph in phases)
    return out


def implied_mfu(total_flops: float, gpu_hours: float, gpu_tflops: float) -> float:
    """MFU a run of ``total_flops`` model FLOPs must have sustained to take ``gpu_hours`` at that peak."""
    return total_flops / (gpu_hours * 3600 * gpu_tflops * 1e12)


__all__ = ["plan", "format_report", "describe", "backbone_arch", "block_saved_bytes", "nograd_block_bytes",
           "forward_gathered_bytes", "crop_forward_flops",
           "step_flops", "step_memory", "state_memory", "counted_peak", "largest_batch", "implied_mfu"]
