"""The generic training loop (dinov2 ``do_train`` order, torchtitan's checkpointing):

    per step: seed -> schedules into the optimizer -> zero_grad -> task forward/backward (K micro-batches with
              ``accumulate=K``) -> one small all-reduce (preemption flag, grad norms, loss, the declared metrics,
              the next step's data report) -> finite check -> clip -> optimizer step -> teacher EMA -> log ->
              checkpoint

A *task* owns the models and the loss (pretraining and distillation are tasks); this loop owns time:
steps, resolution phases, data position, checkpoints, preemption and metrics. Each part has its own function:
``fit`` (phases and loaders), ``_run_phase`` (steps of one loader), ``_train_step`` (one update),
``_forward_backward`` (micro-batches), ``_reduce`` (the one all-reduce), ``_check_finite`` and ``_clip``; the
data agreement is :mod:`.step_data`, the metric key set :class:`.metrics.MetricSet`, the lr record
:mod:`.lr_record`. Randomness is derived from
(seed, step, rank) every step and augmentations from (seed, epoch, sample), so a run resumed from a
checkpoint repeats exactly what the uninterrupted run would have done.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, Sequence

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from ..utils.progress import progress

from ..data.loader import DataPosition
from ..data.sources import stable_hash
from ..ssl.param_groups import apply_optim_schedules
from ..utils.device import host_tensor
from .checkpoint import CheckpointManager, ValueState
from .clip import clip_groups_, local_grad_sq
from .dist import DistInfo, all_reduce_max_scalar
from .lr_record import LrBasis, resume_batches
from .metrics import MetricSet, MetricsLogger, UndeclaredMetricError, read_metrics
from .signals import EXIT_PREEMPTED, PreemptionFlag, signals_blocked, test_hooks_from_env
from .step_data import REPORT_SIZE, DataGuard, DataReport, local_report

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
    # Optional: ``metric_keys`` (the numeric log keys, declared once; none declared: only the loop's own),
    # ``clip_groups()``, ``begin_accumulation(batches, values)`` (teacher targets over all micro-batches).


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
    accumulate: int = 1
    """Micro-batches per optimizer step (gradient accumulation); the global batch is K times the loader's."""
    checkpoint_dir: str = ""
    """'' = run_dir/checkpoints; a folder or an fsspec URL (CheckpointManager)."""
    max_skipped_in_a_row: int = 50
    """Steps in a row skipped (a rank had no readable image) after which training stops with exit 65; 0: never."""
    max_corrupt_fraction: float = 0.5
    """Fraction of unreadable images (this invocation) above which training stops with exit 65; 1.0: never."""


def seed_step(seed: int, step: int, rank: int) -> None:
    torch.manual_seed(stable_hash(f"step/{seed}/{step}/{rank}") % (2**63))


# Keys the loop logs itself; a task must not declare them (its own values would be overwritten).
_LOOP_KEYS = ("loss", "grad_norm", "phase", "data_time", "step_time", "skipped_steps", "corrupt_images",
              "checkpoint_step")
_RUN_STATE = ("lr_batch", "lr_peak", "skipped_steps")  # trainer state added after the first checkpoints


class Trainer:
    def __init__(self, task: Task, optimizer: torch.optim.Optimizer,
                 schedules: dict[str, np.ndarray] | LrBasis, phases: Sequence[Phase], run_dir: str | Path,
                 info: DistInfo, cfg: LoopConfig, pool_size: int,
                 step_hooks: Optional[list[Callable[[int, int, Any], None]]] = None, probe: Any = None) -> None:
        self.task, self.optimizer = task, optimizer
        self.phases, self.run_dir, self.info, self.cfg = list(phases), Path(run_dir), info, cfg
        self.total_steps = self.phases[-1].end
        self.pool_size = pool_size  # the data position's epoch arithmetic mirrors the sampler's
        self.ckpt = CheckpointManager(self.run_dir, keep_last=cfg.keep_last, location=cfg.checkpoint_dir or None)
        self.state = ValueState(step=0, data_epoch=0, data_offset=0, skipped_steps=0)
        self.lr_basis = schedules if isinstance(schedules, LrBasis) else None
        if self.lr_basis is not None:
            self._use_lr_batches(self.lr_basis.batches)
        else:
            self.schedules = schedules
        # Parameter sets clipped separately (one per student when distilling several); one set by default.
        groups = task.clip_groups() if hasattr(task, "clip_groups") else [list(task.trainable_parameters())]
        self._clip_groups = [[p for p in g if p.requires_grad] for g in groups]
        keys = getattr(task, "metric_keys", ())
        self.metric_set = MetricSet(keys() if callable(keys) else keys)
        clash = sorted(set(self.metric_set.keys) & set(_LOOP_KEYS))
        if clash:
            raise ValueError(f"metric_keys {clash} are logged by the loop itself; give the task's values other names")
        # Test hooks (signals at an exact step) only exist when a test asks for them: nothing in a real run.
        self.step_hooks = test_hooks_from_env() if step_hooks is None else step_hooks
        # An evaluation at a few steps (``probe.steps``; 0 = before the first): called on every rank, collective.
        self.probe = probe

    # -- state ----------------------------------------------------------------------------------
    def _states(self) -> dict[str, Any]:
        return {"trainer": self.state, **self.task.checkpoint_states(self.optimizer)}

    def save(self) -> Path:
        return self.ckpt.save(int(self.state.values["step"]), self._states())

    def _use_lr_batches(self, batches: Sequence[int]) -> None:
        """Schedules from the lr derived at these per-phase global batches, recorded in the checkpoint state."""
        assert self.lr_basis is not None
        self.schedules = self.lr_basis.build(batches)
        self.state.values["lr_batch"] = torch.tensor(list(batches), dtype=torch.int64)
        self.state.values["lr_peak"] = torch.tensor(self.lr_basis.peaks(batches), dtype=torch.float64)

    def _load(self) -> Optional[int]:
        """Resume from the latest checkpoint (rank 0 picks it, every rank loads it), keeping the run's lr."""
        try:
            resumed = self.ckpt.load(self._states())
        except (Exception, CheckpointException) as exc:  # (a BaseException) a checkpoint from before the lr
            text = str(exc)                               # record / skip counter: load what it has
            if "Missing key" not in text or not any(f"trainer.{k}" in text for k in _RUN_STATE):
                raise
            extra = {k: self.state.values.pop(k) for k in _RUN_STATE if k in self.state.values}
            resumed = self.ckpt.load(self._states())
            self.state.values.update({k: v for k, v in extra.items() if k == "skipped_steps"})
            if self.lr_basis is not None:
                self._use_lr_batches(self.lr_basis.batches)
            return resumed
        if resumed is not None and self.lr_basis is not None:
            v = self.state.values
            self._use_lr_batches(resume_batches(self.lr_basis, v["lr_batch"].tolist(), v["lr_peak"].tolist(),
                                                main=self.info.is_main))
        return resumed

    def _values(self, step: int) -> dict[str, float]:
        return {k: float(v[step]) for k, v in self.schedules.items()}

    def _apply_schedules(self, values: dict[str, float]) -> None:
        apply_optim_schedules(self.optimizer, values["lr"], values.get("wd", 0.0), values.get("last_layer_lr"),
                              values.get("backbone_lr_scale", 1.0))

    def _phase_index(self, step: int) -> int:
        for i, ph in enumerate(self.phases):
            if ph.start <= step < ph.end:
                return i
        return len(self.phases) - 1

    def _any_rank(self, flag: bool) -> bool:
        return all_reduce_max_scalar(1.0 if flag else 0.0) > 0

    def _all_reduce(self, vec: torch.Tensor) -> list[float]:
        if self.info.distributed:
            torch.distributed.all_reduce(vec)
        return vec.tolist()  # the step's one device-to-host sync

    # -- main -----------------------------------------------------------------------------------
    def _check_not_backward(self) -> None:
        """Refuse (exit 2, every rank) a resume that would go backward: this run folder's metrics.jsonl records a
        checkpoint saved at a later step than the one found (``latest`` lost, checkpoints deleted, another
        ``train.checkpoint_dir``): training on would overwrite the later work."""
        from .dist import broadcast_object

        found = self.ckpt.latest_step() if self.info.is_main else None
        rows = read_metrics(self.run_dir) if self.info.is_main else []
        saved = max((int(r.get("checkpoint_step", 0)) for r in rows), default=0)
        msg = None
        if self.info.is_main and saved > (found or 0):
            where = self.ckpt.url or self.ckpt.dir
            msg = (f"resume would go backward: {self.run_dir}/metrics.jsonl records the checkpoint of step {saved}, "
                   f"but the checkpoint found in {where} is " + (f"step {found}" if found is not None else "none")
                   + f"; restore step_{saved:08d} (and `latest`) or start a new train.output_dir")
        msg = broadcast_object(msg)
        if msg:
            from ..config import ConfigError

            raise ConfigError(msg)

    def fit(self) -> int:
        """Train to the end (returns 0) or until preempted (returns EXIT_PREEMPTED after saving)."""
        self._check_not_backward()
        resumed = self._load()
        step = int(self.state.values["step"])
        self._saved_step = step if resumed is not None else 0
        self._guard = DataGuard(self.cfg.max_skipped_in_a_row, self.cfg.max_corrupt_fraction)
        if resumed is not None and self.info.is_main:
            log.info("resuming from checkpoint at step %d", step)
        self._metrics = MetricsLogger(self.run_dir, enabled=self.info.is_main, resume_step=step)
        self._preempt = PreemptionFlag()
        self._bar = progress(total=self.total_steps, initial=step, desc="train", unit="step",
                             disable=not (self.cfg.progress and self.info.is_main))
        self._steps_this_run = 0
        try:
            if step == 0 and self.probe is not None and 0 in self.probe.steps:
                self.probe(0)  # the random init: the baseline of every later point
            while step < self.total_steps:
                phase = self.phases[self._phase_index(step)]
                rc = self._run_phase(phase)
                if rc is not None:
                    return rc
                step = int(self.state.values["step"])
            self.task.export(self.run_dir, step)  # collective under FSDP: every rank gathers, rank 0 writes
            return 0
        finally:
            self._bar.close()
            self._metrics.close()
            self._preempt.restore()

    def _take(self, batches: Iterator, n: int) -> list[Any]:
        return [next(batches) for _ in range(n)]

    def _run_phase(self, phase: Phase) -> Optional[int]:
        """Steps of one phase's loader from the current position; returns an exit code to leave with, or None
        when the phase is done."""
        k = max(1, self.cfg.accumulate)
        step = int(self.state.values["step"])
        pos = DataPosition(int(self.state.values["data_epoch"]), int(self.state.values["data_offset"]))
        micro_global = phase.batch_per_rank * self.info.world_size
        loader = phase.build_loader(pos)
        with signals_blocked():  # workers are forked here; they must never die of a preemption signal
            batches = iter(loader)
        t0 = time.perf_counter()
        micro = self._take(batches, k)
        # The first step of a loader: its data report needs a reduction of its own (later ones ride along).
        report = DataReport.from_reduced(self._all_reduce(torch.tensor(local_report(micro), dtype=torch.float64,
                                                                       device=self.info.device)))
        data_time = time.perf_counter() - t0
        try:
            while True:
                stop = self.cfg.stop_after is not None and self._steps_this_run + 1 >= self.cfg.stop_after
                last = step + 1 >= phase.end or stop
                micro_done, report_done = micro, report
                logs, preempted, micro, report, fetch_time = self._train_step(micro, report, batches, step,
                                                                              None if last else k)
                step += 1
                self._steps_this_run += 1
                for _ in range(k):
                    pos.advance(micro_global, self.pool_size)
                self.state.values.update(step=step, data_epoch=pos.epoch, data_offset=pos.offset)
                self._bar.update(1)
                self._guard.update(step - 1, report_done, micro_done, micro_global * k)
                if step % self.cfg.log_every == 0 or step == phase.end or step == 1:
                    logs.update(phase=phase.name, data_time=data_time, step_time=time.perf_counter() - t0,
                                checkpoint_step=self._saved_step)
                    self._metrics.log(step - 1, logs)
                    if "loss" in logs:
                        self._bar.set_postfix(loss=f"{logs['loss']:.4f}")
                if step % self.cfg.checkpoint_every == 0 or step == phase.end or stop or preempted:
                    self.save()
                    self._saved_step = step
                    # A signal that arrived during this save: the checkpoint just written is the one to
                    # resume from (one extra all-reduce, on checkpoint steps only).
                    preempted = preempted or self._any_rank(bool(self._preempt))
                if preempted:
                    if self.info.is_main:
                        log.info("preempted (signal %s): checkpoint saved at step %d", self._preempt.received, step)
                    return EXIT_PREEMPTED
                if self.probe is not None and step in self.probe.steps:
                    self.probe(step)
                if stop:
                    return 0
                if step >= phase.end:
                    return None
                t0, data_time = time.perf_counter(), fetch_time
        finally:
            del batches, loader  # the phase's workers stop here, not when the next phase's start

    def _train_step(self, micro: list[Any], report: DataReport, batches: Iterator, step: int,
                    fetch: Optional[int]) -> tuple[dict[str, Any], bool, list[Any], DataReport, float]:
        """One optimizer step over ``micro`` (this rank's micro-batches), or a step all ranks skip together when
        ``report`` says some rank has an empty micro-batch. Fetches the next step's ``fetch`` micro-batches
        (None: this is the loader's last step) and reports on them in the step's all-reduce.

        Returns (logs as global means, whether any rank was asked to stop, the next step's micro-batches, their
        agreed report, seconds spent waiting for them)."""
        seed_step(self.cfg.seed, step, self.info.rank)
        values = self._values(step)
        self._apply_schedules(values)
        self.optimizer.zero_grad(set_to_none=True)
        skip = report.skip
        loss, logs = (None, {}) if skip else self._forward_backward(micro, values)
        for hook in self.step_hooks:
            hook(step, self.info.rank, self._preempt)
        t = time.perf_counter()
        nxt = self._take(batches, fetch) if fetch else []
        fetch_time = time.perf_counter() - t
        vals = self._reduce(loss, logs, nxt)
        preempted, next_report = vals["preempted"], vals["next"]
        if skip:
            self.state.values["skipped_steps"] = int(self.state.values.get("skipped_steps", 0)) + 1
            if self.info.is_main:
                log.warning("step %d skipped on every rank: a rank's batch had no readable image (%s)", step,
                            report.corrupt)
            out = dict(values)
        else:
            self._check_finite(step, vals["loss"], vals["norms"])
            self._clip(vals["norms"])
            self.optimizer.step()
            self.task.after_step(values)
            out = {k: v for k, v in logs.items() if not torch.is_tensor(v) and not isinstance(v, (int, float))}
            out.update(vals["metrics"])
            out.update(loss=vals["loss"], grad_norm=max(vals["norms"]), **values)
        out.update(report.logs(), skipped_steps=int(self.state.values.get("skipped_steps", 0)))
        return out, preempted, nxt, next_report, fetch_time

    def _forward_backward(self, micro: list[Any], values: dict[str, float]) -> tuple[torch.Tensor, dict[str, Any]]:
        """Forward and backward of each micro-batch, gradients summed (each loss divided by K): the update of one
        batch K times larger where the loss is a mean over samples. A task with ``begin_accumulation`` first
        computes the teacher targets of all K micro-batches, so centring / Sinkhorn-Knopp see the whole batch.
        Under FSDP2 every micro-batch reduce-scatters its gradients into the sharded ones (no unsharded gradient
        is kept between micro-batches: the memory of one micro-batch, K reductions per step). Logs: means over
        the micro-batches."""
        k = len(micro)
        begin = getattr(self.task, "begin_accumulation", None)
        if k > 1 and begin is not None:
            begin(micro, values)
        total, logs = None, {}
        for batch in micro:
            loss, part = self.task(batch, values)
            (loss / k if k > 1 else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
            for key, v in part.items():
                numeric = torch.is_tensor(v) or (isinstance(v, (int, float)) and not isinstance(v, bool))
                logs[key] = (logs.get(key, 0) + v / k) if numeric else v
        return total / k, logs

    def _reduce(self, loss: Optional[torch.Tensor], logs: dict[str, Any], nxt: list[Any]) -> dict[str, Any]:
        """The step's ONE all-reduce and ONE host sync: preemption flag, undeclared-metric flag, the next step's
        data report, each clip group's squared gradient norm (its local shards; this replaces clipping's own
        reduction), the loss and the declared metrics. A non-finite loss or norm makes the sums non-finite on
        every rank, so all ranks stop together before the optimizer touches anything. A skipped step (no loss)
        sends the flags and the report only."""
        undeclared = self.metric_set.undeclared(logs, ignore=("corrupt/",))
        # host numbers reach the device asynchronously (pinned on CUDA): the .tolist() below stays the one sync
        head = host_tensor([1.0 if self._preempt else 0.0, 1.0 if undeclared else 0.0] + local_report(nxt),
                           self.info.device)
        parts = [head]
        if loss is not None:
            parts += [torch.stack([local_grad_sq(g) for g in self._clip_groups]),
                      loss.detach().to(torch.float64).reshape(1), self.metric_set.slots(logs, self.info.device)]
        vals = self._all_reduce(torch.cat(parts))
        if vals[1] > 0:
            where = f"this rank logged {undeclared}" if undeclared else "another rank logged one (see its error)"
            raise UndeclaredMetricError(f"a task logged a metric it does not declare in metric_keys ({where}); "
                                        f"declared: {list(self.metric_set.keys)}")
        out: dict[str, Any] = {"preempted": vals[0] > 0, "next": DataReport.from_reduced(vals[2:2 + REPORT_SIZE])}
        if loss is not None:
            world, n, i = float(self.info.world_size), len(self._clip_groups), 2 + REPORT_SIZE
            out["norms"] = [math.sqrt(x) if x >= 0 else math.nan for x in vals[i:i + n]]
            out["loss"] = vals[i + n] / world
            # Global means (each rank's value averaged; equal per-rank batches): independent of the world size.
            out["metrics"] = self.metric_set.means(vals[i + n + 1:])
        return out

    def _check_finite(self, step: int, loss_mean: float, norms: list[float]) -> None:
        if not math.isfinite(loss_mean) or not all(math.isfinite(n) for n in norms):
            last = self.ckpt.latest_step()
            raise NonFiniteLossError(
                f"loss or gradient is not finite at step {step} (mean loss={loss_mean}, grad norm="
                f"{max(norms)}); nothing was updated. The last good checkpoint is "
                f"{'step ' + str(last) if last is not None else 'none'} in {self.ckpt.dir}. Lower the lr, check "
                f"the data, or use fp32 (parallel.param_dtype=fp32), then rerun to resume from it."
            )

    def _clip(self, norms: list[float]) -> None:
        clip_groups_(self._clip_groups, norms, self.cfg.clip_grad)


__all__ = ["Trainer", "Task", "Phase", "LoopConfig", "NonFiniteLossError", "seed_step", "EXIT_PREEMPTED"]
