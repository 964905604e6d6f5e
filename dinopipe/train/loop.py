"""The generic training loop (dinov2 ``do_train`` order, torchtitan's checkpointing):

    per step: seed -> schedules into the optimizer -> zero_grad -> task forward/backward -> one small
              all-reduce (preemption flag, grad norms, loss and metric sums) -> finite check -> clip ->
              optimizer step -> teacher EMA -> log -> checkpoint

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
from .clip import clip_groups_, local_grad_sq
from .dist import DistInfo, all_reduce_max_scalar
from .metrics import MetricsLogger
from .signals import EXIT_PREEMPTED, PreemptionFlag, maybe_test_signal, signals_blocked

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    pass


class Task(Protocol):
    """What the loop needs from a task (``dinopipe.train.run.LoopTask`` wraps the SSL tasks)."""

    def __call__(self, batch: Any, values: dict[str, float]) -> tuple[torch.Tensor, dict[str, Any]]: ...
    def trainable_parameters(self) -> Iterable[nn.Parameter]: ...
    def after_step(self, values: dict[str, float]) -> None: ...
    def checkpoint_states(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...
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

    def _any_rank(self, flag: bool) -> bool:
        return all_reduce_max_scalar(1.0 if flag else 0.0) > 0

    # -- main -----------------------------------------------------------------------------------
    def fit(self) -> int:
        """Train to the end (returns 0) or until preempted (returns EXIT_PREEMPTED after saving)."""
        resumed = self.ckpt.load(self._states())  # rank 0 picks the checkpoint, every rank loads it
        step = int(self.state.values["step"])
        if resumed is not None and self.info.is_main:
            log.info("resuming from checkpoint at step %d", step)
        metrics = MetricsLogger(self.run_dir, enabled=self.info.is_main, resume_step=step)
        preempt = PreemptionFlag()
        bar = tqdm(total=self.total_steps, initial=step, disable=not (self.cfg.progress and self.info.is_main),
                   desc="train", dynamic_ncols=True)
        steps_this_run = 0
        try:
            while step < self.total_steps:
                phase = self.phases[self._phase_index(step)]
                pos = DataPosition(int(self.state.values["data_epoch"]), int(self.state.values["data_offset"]))
                global_batch = phase.batch_per_rank * self.info.world_size
                loader = phase.build_loader(pos)
                with signals_blocked():  # workers are forked here; they must never die of a preemption signal
                    batches = iter(loader)
                t0 = time.perf_counter()
                for batch in batches:
                    data_time = time.perf_counter() - t0
                    logs, preempted = self._train_step(batch, step, preempt)
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
                    if step % self.cfg.checkpoint_every == 0 or step == phase.end or stop or preempted:
                        self.save()
                        # A signal that arrived during this save: the checkpoint just written is the one to
                        # resume from (one extra all-reduce, on checkpoint steps only).
                        preempted = preempted or self._any_rank(bool(preempt))
                    if preempted:
                        if self.info.is_main:
                            log.info("preempted (signal %s): checkpoint saved at step %d", preempt.received, step)
                        return EXIT_PREEMPTED
                    if stop:
                        return 0
                    if step >= phase.end:
                        break
                    t0 = time.perf_counter()
                del batches, loader  # the phase's workers stop here, not when the next phase's start
            self.task.export(self.run_dir, step)  # collective under FSDP: every rank gathers, rank 0 writes
            return 0
        finally:
            bar.close()
            metrics.close()
            preempt.restore()

    def _train_step(self, batch: Any, step: int, preempt: PreemptionFlag) -> tuple[dict[str, Any], bool]:
        """One optimizer step. Returns the logs (global means) and whether any rank was asked to stop.

        Everything the ranks must agree on travels in ONE small all-reduce, read back with ONE host sync: the
        preemption flag, each clip group's squared gradient norm (its local shards; this replaces clipping's
        own reduction), the loss and the task's metric sums. A non-finite loss or norm makes the sums
        non-finite on every rank, so all ranks stop together before the optimizer touches anything."""
        seed_step(self.cfg.seed, step, self.info.rank)
        values = self._values(step)
        self._apply_schedules(values)
        self.optimizer.zero_grad(set_to_none=True)
        loss, logs = self.task(batch, values)
        loss.backward()
        maybe_test_signal("step", step, self.info.rank, preempt)

        def mean(k: str, v: Any) -> bool:  # a per-rank value averaged over ranks (corrupt/* counters stay rank 0's)
            return not k.startswith("corrupt/") and (torch.is_tensor(v) or isinstance(v, (int, float)))

        on_device = sorted(k for k, v in logs.items() if mean(k, v) and torch.is_tensor(v))
        on_host = sorted(k for k, v in logs.items() if mean(k, v) and not torch.is_tensor(v))
        f64 = dict(dtype=torch.float64, device=self.info.device)
        host = torch.tensor([1.0 if preempt else 0.0] + [float(logs[k]) for k in on_host], **f64)
        vec = torch.cat([host[:1], torch.stack([local_grad_sq(g) for g in self._clip_groups]),
                         torch.stack([t.detach().to(torch.float64).reshape(()) for t in
                                      [loss] + [logs[k] for k in on_device]]),
                         host[1:]])
        keys = on_device + on_host
        if self.info.distributed:
            torch.distributed.all_reduce(vec)
        vals = vec.tolist()  # the step's one device-to-host sync
        world, n_groups = float(self.info.world_size), len(self._clip_groups)
        preempted = vals[0] > 0
        norms = [math.sqrt(x) if x >= 0 else math.nan for x in vals[1 : 1 + n_groups]]
        loss_mean = vals[1 + n_groups] / world
        grad_norm = max(norms)
        if not math.isfinite(loss_mean) or not all(math.isfinite(n) for n in norms):
            last = self.ckpt.latest_step()
            raise NonFiniteLossError(
                f"loss or gradient is not finite at step {step} (mean loss={loss_mean}, grad norm="
                f"{grad_norm}); nothing was updated. The last good checkpoint is "
                f"{'step ' + str(last) if last is not None else 'none'} in {self.ckpt.dir}. Lower the lr, check "
                f"the data, or use fp32 (parallel.param_dtype=fp32), then rerun to resume from it."
            )
        clip_groups_(self._clip_groups, norms, self.cfg.clip_grad)
        self.optimizer.step()
        self.task.after_step(values)
        # Metrics are global means (each rank's value averaged; equal per-rank batches), so they do not
        # depend on the world size. Per-rank counters (corrupt/*) stay rank 0's.
        out = {k: v for k, v in logs.items() if k not in keys}
        out.update({k: v / world for k, v in zip(keys, vals[2 + n_groups:])})
        out.update(loss=loss_mean, grad_norm=grad_norm, **values)
        return out, preempted


__all__ = ["Trainer", "Task", "Phase", "LoopConfig", "NonFiniteLossError", "seed_step", "EXIT_PREEMPTED"]
