"""The generic training loop (dinov2 ``do_train`` order, torchtitan's checkpointing):

    per step: seed -> schedules into the optimizer -> zero_grad -> task forward/backward -> clip ->
              finite check -> optimizer step -> teacher EMA -> log -> checkpoint

A *task* owns the models and the loss (pretraining and distillation are tasks); this loop owns time:
steps, resolution phases, data position, checkpoints, preemption and metrics. Randomness is derived from
(seed, step, rank) every step and augmentations from (seed, epoch, sample), so a run resumed from a
checkpoint repeats exactly what the uninterrupted run would have done.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from ..data.loader import DataPosition
from ..data.sources import stable_hash
from ..ssl.param_groups import apply_optim_schedules
from .checkpoint import CheckpointManager, ValueState
from .dist import DistInfo, all_reduce_max_scalar
from .metrics import MetricsLogger
from .signals import EXIT_PREEMPTED, PreemptionFlag

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    pass


class Task(Protocol):
    """What the loop needs from a task (see dinopipe/ssl/task.py)."""

    def __call__(self, batch: Any, values: dict[str, float]) -> tuple[torch.Tensor, dict[str, Any]]: ...
    def trainable_parameters(self) -> Iterable[nn.Parameter]: ...
    def after_step(self, values: dict[str, float]) -> None: ...
    def checkpoint_states(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...
    def set_phase(self, phase: "Phase") -> None: ...
    def export(self, run_dir: Path, step: int) -> None: ...


@dataclass
class Phase:
    """A stretch of steps with one crop resolution and per-rank batch size."""

    name: str
    start: int
    end: int
    batch_per_rank: int
    global_size: int
    local_size: int
    build_loader: Callable[[DataPosition], Iterable] = field(repr=False, default=None)  # type: ignore[assignment]


@dataclass
class LoopConfig:
    seed: int = 0
    clip_grad: float = 3.0
    log_every: int = 10
    checkpoint_every: int = 500
    keep_last: int = 3
    stop_after: Optional[int] = None
    """Stop (with a checkpoint) after this many steps of *this* invocation; tests use it to simulate kills."""
    progress: bool = True


def seed_step(seed: int, step: int, rank: int) -> None:
    torch.manual_seed(stable_hash(f"step/{seed}/{step}/{rank}") % (2**63))


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Total grad norm over all (possibly sharded) parameters, clipped in place when max_norm > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


class Trainer:
    def __init__(self, task: Task, optimizer: torch.optim.Optimizer, schedules: dict[str, np.ndarray],
                 phases: Sequence[Phase], run_dir: str | Path, info: DistInfo, cfg: LoopConfig,
                 pool_size: int) -> None:
        self.task, self.optimizer, self.schedules = task, optimizer, schedules
        self.phases, self.run_dir, self.info, self.cfg = list(phases), Path(run_dir), info, cfg
        self.total_steps = self.phases[-1].end
        self.pool_size = pool_size  # the data position's epoch arithmetic mirrors the sampler's
        self.ckpt = CheckpointManager(self.run_dir, keep_last=cfg.keep_last)
        self.state = ValueState(step=0, data_epoch=0, data_offset=0)
        # Parameter sets clipped separately (one per student when distilling several); one set by default.
        groups = task.clip_groups() if hasattr(task, "clip_groups") else [list(task.trainable_parameters())]
        self._clip_groups = [[p for p in g if p.requires_grad] for g in groups]

    # -- helpers --------------------------------------------------------------------------------
    def _states(self) -> dict[str, Any]:
        return {"trainer": self.state, **self.task.checkpoint_states(self.optimizer)}

    def save(self) -> Path:
        return self.ckpt.save(int(self.state.values["step"]), self._states())

    def _values(self, step: int) -> dict[str, float]:
        return {k: float(v[step]) for k, v in self.schedules.items()}

    def _apply_schedules(self, values: dict[str, float]) -> None:
        apply_optim_schedules(self.optimizer, values["lr"], values.get("wd", 0.0), values.get("last_layer_lr"))

    def _phase_index(self, step: int) -> int:
        for i, ph in enumerate(self.phases):
            if ph.start <= step < ph.end:
                return i
        return len(self.phases) - 1

    # -- main -----------------------------------------------------------------------------------
    def fit(self) -> int:
        """Train to the end (returns 0) or until preempted (returns EXIT_PREEMPTED after saving)."""
        resumed = self.ckpt.load(self._states())
        step = int(self.state.values["step"])
        if resumed is not None and self.info.is_main:
            print(f"resuming from checkpoint at step {step}", flush=True)
        metrics = MetricsLogger(self.run_dir, enabled=self.info.is_main, resume_step=step)
        preempt = PreemptionFlag()
        bar = tqdm(total=self.total_steps, initial=step, disable=not (self.cfg.progress and self.info.is_main),
                   desc="train", dynamic_ncols=True)
        steps_this_run, exit_code = 0, 0
        try:
            while step < self.total_steps:
                phase = self.phases[self._phase_index(step)]
                self.task.set_phase(phase)
                pos = DataPosition(int(self.state.values["data_epoch"]), int(self.state.values["data_offset"]))
                global_batch = phase.batch_per_rank * self.info.world_size
                t0 = time.perf_counter()
                for batch in phase.build_loader(pos):
                    data_time = time.perf_counter() - t0
                    logs = self._train_step(batch, step)
                    step += 1
                    steps_this_run += 1
                    pos.advance(global_batch, self.pool_size)
                    self.state.values.update(step=step, data_epoch=pos.epoch, data_offset=pos.offset)
                    bar.update(1)
                    if step % self.cfg.log_every == 0 or step == phase.end or step == 1:
                        logs.update(phase=phase.name, data_time=data_time, step_time=time.perf_counter() - t0)
                        metrics.log(step - 1, logs)
                        bar.set_postfix(loss=f"{logs['loss']:.4f}")
                    stop = self.cfg.stop_after is not None and steps_this_run >= self.cfg.stop_after
                    preempted = all_reduce_max_scalar(1.0 if preempt else 0.0) > 0
                    if step % self.cfg.checkpoint_every == 0 or step == phase.end or stop or preempted:
                        self.save()
                    if preempted:
                        if self.info.is_main:
                            print(f"preempted (signal {preempt.received}): checkpoint saved at step {step}", flush=True)
                        return EXIT_PREEMPTED
                    if stop:
                        return 0
                    if step >= phase.end:
                        break
                    t0 = time.perf_counter()
            self.task.export(self.run_dir, step)  # collective under FSDP: every rank gathers, rank 0 writes
            return exit_code
        finally:
            bar.close()
            metrics.close()
            preempt.restore()

    def _train_step(self, batch: Any, step: int) -> dict[str, Any]:
        seed_step(self.cfg.seed, step, self.info.rank)
        values = self._values(step)
        self._apply_schedules(values)
        self.optimizer.zero_grad(set_to_none=True)
        loss, logs = self.task(batch, values)
        loss.backward()
        grad_norm = max(clip_grad_norm(g, self.cfg.clip_grad) for g in self._clip_groups)
        bad = not math.isfinite(float(loss.detach())) or not math.isfinite(grad_norm)
        if all_reduce_max_scalar(1.0 if bad else 0.0) > 0:
            last = self.ckpt.latest_step()
            raise NonFiniteLossError(
                f"loss or gradient is not finite at step {step} (loss={float(loss.detach())}, grad norm="
                f"{grad_norm}); nothing was updated. The last good checkpoint is "
                f"{'step ' + str(last) if last is not None else 'none'} in {self.ckpt.dir}. Lower the lr, check "
                f"the data, or use fp32 (parallel.param_dtype=fp32), then rerun to resume from it."
            )
        self.optimizer.step()
        self.task.after_step(values)
        out = {k: float(v) if isinstance(v, (int, float)) or torch.is_tensor(v) else v for k, v in logs.items()}
        out["loss"] = float(loss.detach())
        out = self._global_means(out)
        out.update(grad_norm=grad_norm, **{k: values[k] for k in values})
        return out

    def _global_means(self, logs: dict[str, Any]) -> dict[str, Any]:
        """Losses of the *global* batch: each rank's value averaged over ranks (equal per-rank batches), so
        metrics do not depend on the world size. Per-rank counters (corrupt/*) stay rank 0's."""
        if not self.info.distributed:
            return logs
        keys = sorted(k for k, v in logs.items() if isinstance(v, float) and not k.startswith("corrupt/"))
        t = torch.tensor([logs[k] for k in keys], dtype=torch.float64, device=self.info.device)
        torch.distributed.all_reduce(t)
        return {**logs, **{k: float(v) / self.info.world_size for k, v in zip(keys, t.tolist())}}


__all__ = ["Trainer", "Task", "Phase", "LoopConfig", "NonFiniteLossError", "seed_step", "EXIT_PREEMPTED"]
