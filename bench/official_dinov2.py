"""The official DINOv2 training step (facebookresearch/dinov2 ``SSLMetaArch``), built and stepped as its
``dinov2/train/train.py`` does, for ``bench/gpu_bench.py``. The source is never vendored: ``make official-src``
(bench/tools/fetch_official.sh) extracts it into ``.official/dinov2``.

The official code as published does not run unchanged on today's torch without xFormers; the smallest
shims that make it run are applied here, each recorded in ``SHIMS`` (the bench writes them into its JSON):

- ``xformers``: when it is not importable, ``ssl_meta_arch`` asserts at import. A stand-in ``xformers.ops.fmha``
  with only ``BlockDiagonalMask.from_tensor_list`` / ``split`` (concatenate the head inputs, split the output:
  what the real one does for that call) is put in ``sys.modules`` for that one import and removed afterwards,
  so dinov2's layers (and dinopipe) still see no xFormers. The layers then take dinov2's own non-xFormers path
  (``Attention`` = ``F.scaled_dot_product_attention``), and the student's nested [global, local] call, which
  asserts without xFormers, runs each crop group through ``Block.forward`` in turn (the same math: xFormers'
  block-diagonal attention keeps the groups apart too; it only saves launches).
- ``fsdp_streams``: ``SSLMetaArch.fsdp_synchronize_streams`` reads FSDP1's private ``_streams``, gone from
  torch's FSDP1; it keeps its ``torch.cuda.synchronize()`` (first step only) and drops the stream sharing.
- ``dinov2.distributed``: local rank 0 of 1 set as its ``enable()`` would for one process (the bench initialises
  the 1-rank process group itself, as for dinopipe).
- ``fvcore``: when it is not installed (the CPU estimate, bench/gpu_proxy.py), ``fvcore.common.checkpoint``'s
  ``Checkpointer`` / ``PeriodicCheckpointer`` (imported at module level, never called by the step) are empty
  stand-ins for the import; the GPU bench carries the real wheel (``make gpu-bench-wheels``).
- CPU smoke only (``cpu=True``): ``Tensor.cuda`` is the identity and ``torch.cuda.synchronize`` a no-op inside
  the step, FSDP1 is given the CPU device (no state sync: W = 1), and a ``vit_test`` arch (dinopipe's dims) is registered.
"""

from __future__ import annotations

import contextlib
import math
import sys
import types
from functools import partial
from pathlib import Path

import torch

SHIMS: dict[str, str] = {}
DINOPIPE_TO_ARCH = {"vit_s14": "vit_small", "vit_b14": "vit_base", "vit_l14": "vit_large", "vit_test": "vit_test"}


class _BlockDiagonalMask:
    """Stand-in for ``xformers.ops.fmha.BlockDiagonalMask`` as ssl_meta_arch uses it (head inputs only)."""

    def __init__(self, sizes):
        self.sizes = sizes

    @classmethod
    def from_tensor_list(cls, tensors):
        sizes = [t.shape[1] for t in tensors]
        return cls(sizes), torch.cat([t.reshape(1, -1, t.shape[-1]) for t in tensors], dim=1)

    def split(self, x):
        return list(x.split(self.sizes, dim=1))


def import_official(src: Path, cpu: bool = False):
    """Import ``dinov2.train.train`` (and so ``ssl_meta_arch``) from ``src`` with the shims above."""
    src = Path(src).resolve()
    if not (src / "dinov2" / "train" / "ssl_meta_arch.py").is_file():
        raise FileNotFoundError(f"no official dinov2 source at {src}: run `make official-src` first")
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    _stub_fvcore()
    try:
        from xformers.ops import fmha  # noqa: F401
        SHIMS["xformers"] = "real xformers"
        import dinov2.train.train as train_mod
    except ImportError:
        SHIMS["xformers"] = ("absent: stand-in fmha.BlockDiagonalMask for the head concat; dinov2's own SDPA "
                             "attention; nested [global, local] blocks run per crop group")
        xf, ops, fm = (types.ModuleType(n) for n in ("xformers", "xformers.ops", "xformers.ops.fmha"))
        fm.BlockDiagonalMask = _BlockDiagonalMask
        ops.fmha, xf.ops = fm, ops
        saved = {n: sys.modules.get(n) for n in ("xformers", "xformers.ops", "xformers.ops.fmha")}
        sys.modules.update({"xformers": xf, "xformers.ops": ops, "xformers.ops.fmha": fm})
        try:
            import dinov2.train.train as train_mod
        finally:
            for n, m in saved.items():
                if m is None:
                    sys.modules.pop(n, None)
                else:
                    sys.modules[n] = m
        from dinov2.layers import block as blk

        if not blk.XFORMERS_AVAILABLE:
            base_forward = blk.Block.forward

            def forward(self, x_or_list):
                if isinstance(x_or_list, list):
                    return [base_forward(self, x) for x in x_or_list]
                return base_forward(self, x_or_list)

            blk.NestedTensorBlock.forward = forward
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32  # train.py sets it at import; the bench sets it for both
    from dinov2 import distributed as ddist
    from dinov2.train import ssl_meta_arch

    # what dinov2.distributed.enable() sets for one process (its enable() wants torchrun's env and inits NCCL
    # itself; the bench's 1-rank group is already up): FSDP's device_id = local rank 0
    ddist._LOCAL_RANK, ddist._LOCAL_WORLD_SIZE = 0, 1
    if not hasattr(torch.distributed.fsdp.FullyShardedDataParallel, "_streams"):
        def sync_once(self):
            if self.need_to_synchronize_fsdp_streams:
                torch.cuda.synchronize()
                self.need_to_synchronize_fsdp_streams = False

        ssl_meta_arch.SSLMetaArch.fsdp_synchronize_streams = sync_once
        SHIMS["fsdp_streams"] = "FSDP1 has no _streams: fsdp_synchronize_streams keeps only its cuda.synchronize()"
    if cpu:
        _cpu_shims()
    return train_mod


def _stub_fvcore() -> None:
    try:
        import fvcore.common.checkpoint  # noqa: F401
        return
    except ImportError:
        pass
    mods = {n: types.ModuleType(n) for n in ("fvcore", "fvcore.common", "fvcore.common.checkpoint")}
    ck = mods["fvcore.common.checkpoint"]
    ck.Checkpointer = type("Checkpointer", (), {})
    ck.PeriodicCheckpointer = type("PeriodicCheckpointer", (), {})
    mods["fvcore"].common, mods["fvcore.common"].checkpoint = mods["fvcore.common"], ck
    sys.modules.update(mods)
    SHIMS["fvcore"] = "absent: empty Checkpointer / PeriodicCheckpointer stand-ins (not used by the step)"


def _cpu_shims() -> None:
    import dinov2.fsdp as dfsdp
    from dinov2.layers import MemEffAttention
    from dinov2.layers import NestedTensorBlock as Block
    from dinov2.models import vision_transformer as vits

    if not getattr(dfsdp.get_fsdp_wrapper, "_cpu", False):
        orig = dfsdp.get_fsdp_wrapper

        def get_fsdp_wrapper(model_cfg, modules_to_wrap=set()):
            return partial(orig(model_cfg, modules_to_wrap), device_id=torch.device("cpu"), sync_module_states=False)

        get_fsdp_wrapper._cpu = True
        dfsdp.get_fsdp_wrapper = get_fsdp_wrapper
        sys.modules["dinov2.train.ssl_meta_arch"].get_fsdp_wrapper = get_fsdp_wrapper

    def vit_test(patch_size=14, num_register_tokens=0, **kw):
        return vits.DinoVisionTransformer(patch_size=patch_size, embed_dim=64, depth=4, num_heads=2, mlp_ratio=4,
                                          block_fn=partial(Block, attn_class=MemEffAttention),
                                          num_register_tokens=num_register_tokens, **kw)

    vits.vit_test = vit_test
    SHIMS["cpu"] = "CPU smoke: Tensor.cuda = identity, cuda.synchronize no-op, FSDP1 on CPU, vit_test arch added"


@contextlib.contextmanager
def cpu_step_shims(active: bool):
    if not active:
        yield
        return
    saved = torch.Tensor.cuda, torch.cuda.synchronize
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.cuda.synchronize = saved


def official_config(dcfg, model: str, b: int, precision: str):
    """ssl_default_config.yaml + the overrides that make it the model and recipe dinopipe's ``dcfg`` runs
    (dinov2 has no vits14/vitb14 train configs; vitl14.yaml's swiglu, 131k separate heads and Sinkhorn are
    not dinopipe's defaults, so only the arch-level keys are set here, identically for every size)."""
    from dinov2.configs import dinov2_default_config
    from omegaconf import OmegaConf

    ph = dcfg.phases[0]
    dh, ih = dcfg.dino.head, dcfg.ibot.head
    over = {
        "student": {"arch": DINOPIPE_TO_ARCH[model], "patch_size": 14, "ffn_layer": "mlp",
                    "drop_path_rate": dcfg.model.drop_path_rate, "drop_path_uniform": dcfg.model.drop_path_uniform,
                    "layerscale": dcfg.model.init_values},
        "crops": {"global_crops_size": ph.global_crops_size, "local_crops_size": ph.local_crops_size,
                  "local_crops_number": dcfg.crops.local_crops_number},
        "train": {"batch_size_per_gpu": b, "centering": getattr(dcfg.teacher.centering, "value",
                                                                 str(dcfg.teacher.centering))},
        "dino": {"head_n_prototypes": dh.n_prototypes, "head_hidden_dim": dh.hidden_dim,
                 "head_bottleneck_dim": dh.bottleneck_dim, "head_nlayers": dh.nlayers},
        "ibot": {"separate_head": dcfg.ibot.separate_head, "head_n_prototypes": ih.n_prototypes,
                 "head_hidden_dim": ih.hidden_dim, "head_bottleneck_dim": ih.bottleneck_dim,
                 "head_nlayers": ih.nlayers},
    }
    cfg = OmegaConf.merge(OmegaConf.create(dinov2_default_config), OmegaConf.create(over))
    if precision == "bf16":  # the recipe's fp16 everywhere it says fp16, and no grad scaler (bf16 needs none)
        cfg.compute_precision.grad_scaler = False
        for who in ("student", "teacher"):
            for part in cfg.compute_precision[who].values():
                mp = part.mixed_precision
                mp.param_dtype = "bf16"
                if mp.reduce_dtype == "fp16":
                    mp.reduce_dtype = "bf16"
    cfg.optim.lr = cfg.optim.base_lr * math.sqrt(b / 1024.0)  # apply_scaling_rules_to_cfg at world size 1
    return cfg


class OfficialStep:
    """SSLMetaArch built as train.main does; ``step()`` is one iteration of do_train's loop body."""

    def __init__(self, train_mod, cfg, dev: torch.device, batch: dict):
        from dinov2.train.ssl_meta_arch import SSLMetaArch

        self.t, self.cfg, self.batch = train_mod, cfg, batch
        torch.manual_seed(0)
        self.model = SSLMetaArch(cfg).to(dev)
        self.model.prepare_for_distributed_training()
        self.model.train()
        self.optimizer = train_mod.build_optimizer(cfg, self.model.get_params_groups())
        it = cfg.optim.warmup_epochs * cfg.train.OFFICIAL_EPOCH_LENGTH  # past warm-up and the frozen last layer
        scheds = train_mod.build_schedulers(cfg)
        self.lr, self.wd, self.mom, self.teacher_temp, self.last_layer_lr = (float(s[it]) for s in scheds)
        self.loss = float("nan")

    def step(self) -> None:
        m, opt, cfg = self.model, self.optimizer, self.cfg
        self.t.apply_optim_scheduler(opt, self.lr, self.wd, self.last_layer_lr)
        opt.zero_grad(set_to_none=True)
        loss_dict = m.forward_backward(self.batch, teacher_temp=self.teacher_temp)
        if m.fp16_scaler is not None:
            if cfg.optim.clip_grad:
                m.fp16_scaler.unscale_(opt)
                for v in m.student.values():
                    v.clip_grad_norm_(cfg.optim.clip_grad)
            m.fp16_scaler.step(opt)
            m.fp16_scaler.update()
        else:
            if cfg.optim.clip_grad:
                for v in m.student.values():
                    v.clip_grad_norm_(cfg.optim.clip_grad)
            opt.step()
        m.update_teacher(self.mom)
        self.loss = sum(v.item() for v in loss_dict.values())  # the loop's per-step loss_dict_reduced


def official_batch(cfg, b: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """A batch from dinov2's own collate_data_and_cast and MaskingGenerator (blank images of the crop sizes,
    as dinopipe's synthetic batch)."""
    from dinov2.data import MaskingGenerator, collate_data_and_cast

    g, loc, n_l = cfg.crops.global_crops_size, cfg.crops.local_crops_size, cfg.crops.local_crops_number
    p = cfg.student.patch_size
    glob, local = torch.zeros(3, g, g), torch.zeros(3, loc, loc)
    samples = [({"global_crops": [glob, glob], "local_crops": [local] * n_l}, ()) for _ in range(b)]
    torch.manual_seed(seed)
    import random

    random.seed(seed)
    return collate_data_and_cast(samples, mask_ratio_tuple=cfg.ibot.mask_ratio_min_max,
                                 mask_probability=cfg.ibot.mask_sample_probability, dtype=dtype,
                                 n_tokens=(g // p) ** 2,
                                 mask_generator=MaskingGenerator(input_size=(g // p, g // p),
                                                                 max_num_patches=0.5 * g // p * g // p))
