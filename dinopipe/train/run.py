"""``run_training(cfg, task_cls)``: the one body of every training stage (pretrain, distill), and the
train-layer side of the task interface (``dinopipe/ssl/base.py``).

A task declares what it holds (groups to shard, forward methods, checkpoint states, backbones to export);
this module does the distributed work on it: FSDP2 ``parallelize`` and forward-method registration, DCP
state wrapping, gathering full state dicts and writing exports. The loop (``loop.py``) sees a ``LoopTask``.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch

from .. import hub
from ..config import ConfigError, ParallelConfig, save_config
from ..export import save_backbone, save_heads
from ..utils.norm import set_input_norm
from ..utils.torch_compat import deepcopies_share_parameters
from ..models import build_vit
from ..ssl.base import TeacherStudentTask
from ..ssl.param_groups import build_param_groups
from .builders import open_pool, train
from .checkpoint import ModelOptimState, full_state_dict
from .dist import DistInfo, all_gather_fn, all_reduce_sum_fn, get_info, init_distributed
from .parallel import parallelize
from ..utils.run_layout import TrainLayout

log = logging.getLogger(__name__)


def build_task(task_cls: type[TeacherStudentTask], cfg: Any, all_reduce_fn=None, load_backbone=None,
               load_heads=None) -> TeacherStudentTask:
    """The task, with the readers it needs for files (pretrained backbones, a distillation teacher)."""
    return task_cls(cfg, all_reduce_fn=all_reduce_fn, load_backbone=load_backbone or hub.load,
                    load_heads=load_heads or hub.load_heads)


def _recording_readers(record: list):
    """File readers for rank 0 that note what they returned (architectures, head shapes), so the other ranks can
    rebuild the same modules on ``meta`` without opening the files."""

    def load_backbone(path, **kwargs):
        model = hub.load(path, **kwargs)
        record.append(("backbone", dict(model._arch_kwargs), getattr(model, "variant", None)))
        return model

    def load_heads(path):
        sds = hub.load_heads(path)
        record.append(("heads", {n: {k: (tuple(v.shape), v.dtype) for k, v in sd.items()} for n, sd in sds.items()}))
        return sds

    return load_backbone, load_heads


def _replaying_readers(record: list):
    """The readers of the ranks other than 0: the modules rank 0 read, rebuilt empty (called under ``meta``)."""
    items = iter(record)

    def take(kind: str):
        item = next(items, None)
        if item is None or item[0] != kind:
            raise RuntimeError(f"rank 0 read files in another order than this rank builds the task (wanted {kind})")
        return item

    def load_backbone(path, **kwargs):
        _, arch, variant = take("backbone")
        model = build_vit(**arch)
        if variant:
            model.variant = variant
        return model

    def load_heads(path):
        _, shapes = take("heads")
        return {n: {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in sd.items()} for n, sd in shapes.items()}

    return load_backbone, load_heads


def build_sharded_task(task_cls: type[TeacherStudentTask], cfg: Any, info: DistInfo,
                       pcfg: Optional[ParallelConfig] = None) -> TeacherStudentTask:
    """Build, shard and materialise the task so that no rank ever holds a full model.

    One process: built on the device as before. Several: every rank seeds as a single process would and
    builds the task on ``meta`` under a recorder (``meta_init.InitRecorder``: the random ops advance the CPU
    generator exactly as real ones, the files are read memory-mapped and only referenced), shards it
    (``parallelize_task``), allocates its own shards (``to_empty``) and replays each parameter's and buffer's
    init on one full-size CPU temporary at a time, keeping its slice (a tensor copied from a file reads only
    the slice). The initial weights and the generator state afterwards are those of a one-process build.
    Memory per rank: its shards + the largest tensor (+ the one it was cloned from). A build the recorder
    cannot replay exactly falls back to :func:`build_rank0_broadcast`, saying why."""
    reduce_fn = all_reduce_sum_fn()
    if not info.distributed:
        torch.manual_seed(cfg.train.seed)  # same initial weights on every rank and every rerun
        task = build_task(task_cls, cfg, all_reduce_fn=reduce_fn).to(info.device)
        parallelize_task(task, info, pcfg)
        return task
    from .meta_init import InitRecorder

    torch.manual_seed(cfg.train.seed)
    rec = InitRecorder()
    try:
        with rec.recording():
            task = build_task(task_cls, cfg, reduce_fn)
        rec.bind(task)
        why = rec.unreplayable()
    except (ConfigError, hub.CheckpointError):
        raise  # the user's input: every rank builds, so every rank says so
    except Exception as exc:  # noqa: BLE001 - e.g. an op without a meta kernel: built the earlier way
        task, why = None, f"{type(exc).__name__}: {exc}"
    import torch.distributed as dist

    reasons: list = [None] * info.world_size
    dist.all_gather_object(reasons, why)  # every rank takes the same path
    why = next((r for r in reasons if r), None)
    if why:
        if info.is_main:
            log.info("task init not replayable shard by shard (%s): rank 0 builds it and broadcasts", why[:300])
        del task, rec
        return build_rank0_broadcast(task_cls, cfg, info, pcfg)
    parallelize_task(task, info, pcfg)
    task.to_empty(device=info.device)
    rec.materialize(task)
    task.init_report = {"path": "replay", "random_ops": rec.random_ops, "peak_scratch_bytes": rec.peak_scratch_bytes,
                        "peak_replay_bytes": rec.peak_replay_bytes}
    task.all_gather_fn, task.rank = all_gather_fn(), info.rank  # DINOv3's distributed KoLeo
    return task


def build_rank0_broadcast(task_cls: type[TeacherStudentTask], cfg: Any, info: DistInfo,
                          pcfg: Optional[ParallelConfig] = None) -> TeacherStudentTask:
    """The fallback (and the path before shard-by-shard replay): rank 0 builds the task on its CPU exactly as a
    single process would (same seed, released files read there), the others build it on ``meta``
    (architectures of files rank 0 read come over the process group; no file is opened). Every rank then
    shards the meta task, allocates its shards (``to_empty``) and receives the weights from rank 0 tensor by
    tensor (``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``). Memory: ranks > 0 hold
    their shards + the largest single tensor; rank 0 also holds each initial model once (copies share its
    tensors: EMA and Gram teachers) until the broadcast ends."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from .dist import broadcast_object

    torch.manual_seed(cfg.train.seed)
    reduce_fn = all_reduce_sum_fn()
    record: list = []
    full: dict = {}
    if info.is_main:
        with deepcopies_share_parameters():
            task = build_task(task_cls, cfg, reduce_fn, *_recording_readers(record))
        full = task.state_dict()  # real CPU tensors; the module itself goes to meta like every other rank's
        rng = torch.get_rng_state()
        task = task.to("meta")
    record, rng = broadcast_object((record, rng if info.is_main else None))
    if not info.is_main:
        with torch.device("meta"):
            task = build_task(task_cls, cfg, reduce_fn, *_replaying_readers(record))
    torch.set_rng_state(rng)  # the generator continues where a one-process build leaves it, on every rank
    parallelize_task(task, info, pcfg)
    task.to_empty(device=info.device)
    set_model_state_dict(task, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    task.init_report = {"path": "rank0-broadcast"}
    task.all_gather_fn, task.rank = all_gather_fn(), info.rank  # DINOv3's distributed KoLeo
    return task


def compile_methods(task: TeacherStudentTask, backend: str = "inductor") -> None:
    """Compile the task's ``compiled_methods`` (its losses) as the blocks are: fullgraph (a graph break is an
    error), dynamic shapes (the masked-patch count changes every step)."""
    for name in getattr(task, "compiled_methods", ()):
        fn = getattr(task, name)
        if not getattr(fn, "_dinopipe_compiled", False):
            compiled = torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)
            compiled._dinopipe_compiled = True
            setattr(task, name, compiled)


def parallelize_task(task: TeacherStudentTask, info: DistInfo, pcfg: Optional[ParallelConfig] = None,
                     compile_backend: str = "inductor") -> str:
    """Shard trained and frozen modules alike (so EMA copies pair local shards with their students one to
    one); frozen ones (no backward) always reshard after forward; with ``compile`` the blocks, the heads and
    the task's losses are compiled. Returns the compute dtype in effect."""
    trained, frozen = task.shard_groups()
    task.compute_dtype = parallelize(trained, info, pcfg, compile_backend=compile_backend)
    parallelize(frozen, info, pcfg, frozen=True, compile_backend=compile_backend)
    if pcfg is not None and pcfg.compile:
        compile_methods(task, compile_backend)
    if info.distributed:
        from torch.distributed.fsdp import register_fsdp_forward_method

        for backbone in task.backbones():
            for method in task.forward_methods:  # called instead of forward(): FSDP2 must unshard around them
                register_fsdp_forward_method(backbone, method)
    return task.compute_dtype


def checkpoint_states(task: TeacherStudentTask, optimizer: Any = None) -> dict[str, ModelOptimState]:
    """The task's resumable state as DCP Statefuls, by checkpoint name."""
    return {name: ModelOptimState(module, opt) for name, (module, opt) in task.state_modules(optimizer).items()}


def export_task(task: TeacherStudentTask, run_dir: str | Path, step: int) -> None:
    """Each kept backbone (+ heads) consolidated to RUN/export/NAME, loadable by dinopipe.load without
    torch.distributed. Collective under FSDP: every rank gathers, rank 0 writes."""
    for spec in task.export_specs(step):
        backbone_sd = full_state_dict(spec.backbone)
        heads_sd = {name: full_state_dict(m) for name, m in spec.heads.items()}
        if not get_info().is_main:
            continue
        model = build_vit(**spec.backbone.arch_config())
        model.load_state_dict(backbone_sd)
        set_input_norm(model, getattr(spec.backbone, "input_mean", None), getattr(spec.backbone, "input_std", None))
        out = TrainLayout(run_dir).export(spec.name)
        save_backbone(model, out, extra=spec.extra)
        if heads_sd:
            save_heads(out, heads_sd)
        log.info("exported %s backbone to %s", spec.name, out)


class LoopTask:
    """What the generic loop drives: the task's forward, EMA and clip groups, plus the train layer's
    checkpoint states and export around it."""

    def __init__(self, task: TeacherStudentTask) -> None:
        self.task = task
        self.metric_keys = getattr(task, "metric_keys", ())  # the loop reduces exactly these (dinopipe/train/metrics.py)
        if hasattr(task, "begin_accumulation"):  # teacher targets over all micro-batches (train.accumulate)
            self.begin_accumulation = task.begin_accumulation

    def __call__(self, batch: Any, values: dict[str, float]):
        return self.task(batch, values)

    def trainable_parameters(self):
        return self.task.trainable_parameters()

    def clip_groups(self):
        return self.task.clip_groups()

    def after_step(self, values: dict[str, float]) -> None:
        self.task.after_step(values)

    def checkpoint_states(self, optimizer) -> dict[str, Any]:
        return checkpoint_states(self.task, optimizer)

    def export(self, run_dir: Path, step: int) -> None:
        export_task(self.task, run_dir, step)


def run_training(cfg: Any, task_cls: type[TeacherStudentTask]) -> int:
    """Load the pool -> init distributed -> write the config -> build, shard, optimize -> loop. Returns the
    exit code. Config mistakes were caught by the stage's validate() before this runs."""
    refs, read = open_pool(cfg)  # a wrong data path is a config error: exit 2 before anything is written
    info = init_distributed(cfg.train.device)
    if info.is_main:
        save_config(cfg, cfg.train.output_dir)
    task = build_sharded_task(task_cls, cfg, info, cfg.parallel)
    o = cfg.optim
    optimizer = task.build_optimizer(partial(build_param_groups, lr_decay_rate=o.layerwise_decay,
                                             patch_embed_lr_mult=o.patch_embed_lr_mult, decay_tokens=o.decay_tokens),
                                     betas=(o.adamw_beta1, o.adamw_beta2))
    return train(cfg, LoopTask(task), optimizer, info, refs, read, task.data_patch_size)


__all__ = ["run_training", "build_task", "build_sharded_task", "build_rank0_broadcast", "parallelize_task",
           "compile_methods", "checkpoint_states", "export_task", "LoopTask"]
