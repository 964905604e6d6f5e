"""The generic loop (dinopipe.train.loop.Trainer) in one process around a fake task: the order of a step's parts,
schedules into the optimizer and the task, clipping, the non-finite stop, logging, checkpoints and resume."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

import dinopipe.train.loop as loop_mod
from dinopipe.logs import setup_logging
from dinopipe.train.checkpoint import ModelOptimState
from dinopipe.train.dist import DistInfo
from dinopipe.train.loop import LoopConfig, NonFiniteLossError, Phase, Trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as meant

POOL = 12
BATCH = 2


def _batch(epoch: int, offset: int) -> dict[str, torch.Tensor]:
    idx = torch.arange(offset, offset + BATCH, dtype=torch.float32) + 100 * epoch
    x = torch.stack([torch.ones_like(idx), idx % 5 + 1], dim=1)  # (B, 2)
    return {"x": x, "y": 3 * x[:, 0] - 2 * x[:, 1], "pos": (epoch, offset)}


def _loader(pos):
    epoch, offset = pos.epoch, pos.offset  # a snapshot: the loop advances `pos` itself

    def gen():
        e, o = epoch, offset
        while True:
            if o + BATCH > POOL:
                e, o = e + 1, 0
            yield _batch(e, o)
            o += BATCH

    return gen()


class RecordingSGD(torch.optim.SGD):
    def __init__(self, params, events):
        super().__init__(params, lr=0.0, momentum=0.9)
        self.events, self.at_step = events, []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.events.append("zero_grad")
        super().zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        grads = [p.grad.flatten() for g in self.param_groups for p in g["params"]]
        self.at_step.append({"lr": self.param_groups[0]["lr"], "wd": self.param_groups[0]["weight_decay"],
                             "grad_norm": float(torch.cat(grads).norm())})
        self.events.append("optimizer.step")
        return super().step(closure)


class FakeTask:
    """What the loop needs from a task: a linear model, an EMA copy, and a loss that can turn nan."""

    metric_keys = ("mse", "host_metric")

    def __init__(self, events, nan_at=None, scale=1.0):
        torch.manual_seed(0)
        self.model = nn.Linear(2, 1, bias=False)
        self.ema = copy.deepcopy(self.model).requires_grad_(False)
        self.events, self.nan_at, self.scale = events, nan_at, scale
        self.values, self.raw_grad_norms, self.batches, self.exported = [], [], [], None
        self.model.weight.register_hook(self._on_grad)

    def _on_grad(self, g):
        self.events.append("backward")
        self.raw_grad_norms.append(float(g.norm()))

    def __call__(self, batch, values):
        self.events.append("forward")
        self.values.append(dict(values))
        self.batches.append(batch["pos"])
        loss = ((self.model(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean() * self.scale
        if self.nan_at is not None and len(self.values) - 1 == self.nan_at:
            loss = loss * float("nan")
        return loss, {"mse": loss.detach(), "host_metric": 2.0}

    def trainable_parameters(self):
        return self.model.parameters()

    def after_step(self, values):
        self.events.append("after_step")
        m = values["momentum"]
        with torch.no_grad():
            self.ema.weight.mul_(m).add_(self.model.weight, alpha=1 - m)

    def checkpoint_states(self, optimizer):
        return {"model": ModelOptimState(self.model, optimizer), "ema": ModelOptimState(self.ema)}

    def export(self, run_dir, step):
        self.events.append("export")
        self.exported = step


def _schedules(n: int) -> dict[str, np.ndarray]:
    return {"lr": np.linspace(0.01, 0.001, n), "wd": np.linspace(0.0, 0.1, n), "momentum": np.linspace(0.5, 0.9, n)}


def _trainer(tmp_path, task, events, steps=6, **cfg):
    tmp_path.mkdir(parents=True, exist_ok=True)  # (the stage writes config.yaml there first)
    opt = RecordingSGD(task.model.parameters(), events)
    phases = [Phase("base", 0, steps, BATCH, 8, 4, build_loader=_loader)]
    loop_cfg = LoopConfig(**{"seed": 0, "clip_grad": 0.0, "log_every": 1, "checkpoint_every": 100, "keep_last": 2,
                             "progress": False, **cfg})
    trainer = Trainer(task, opt, _schedules(steps), phases, tmp_path, DistInfo(), loop_cfg, pool_size=POOL)
    return trainer, opt


@pytest.fixture
def recorded(monkeypatch):
    """Events of the loop itself: metrics rows logged and checkpoints saved, in order with the task's."""
    events: list = []

    class Metrics(loop_mod.MetricsLogger):
        def log(self, step, values):
            events.append("log")
            super().log(step, values)

    monkeypatch.setattr(loop_mod, "MetricsLogger", Metrics)
    return events


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_step_order_schedules_logs_and_checkpoints(tmp_path, recorded):
    task = FakeTask(recorded)
    trainer, opt = _trainer(tmp_path, task, recorded, checkpoint_every=2)
    save = trainer.save
    trainer.save = lambda: (recorded.append("checkpoint"), save())[1]
    assert trainer.fit() == 0
    step = ["zero_grad", "forward", "backward", "optimizer.step", "after_step", "log"]
    assert recorded == (step * 2 + ["checkpoint"]) * 3 + ["export"]
    sched = _schedules(6)
    for i in range(6):  # this step's schedule values, in the task and in the optimizer
        assert task.values[i] == {k: pytest.approx(float(v[i])) for k, v in sched.items()}
        assert opt.at_step[i]["lr"] == pytest.approx(sched["lr"][i]) and opt.at_step[i]["wd"] == pytest.approx(
            sched["wd"][i])
    # the data position walks the pool and wraps to the next epoch (remainder dropped)
    assert task.batches == [(0, 0), (0, 2), (0, 4), (0, 6), (0, 8), (0, 10)]
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(6))
    assert rows[0]["phase"] == "base" and rows[0]["host_metric"] == 2.0 and rows[0]["corrupt_images"] == 0
    assert rows[3]["lr"] == pytest.approx(sched["lr"][3]) and rows[3]["grad_norm"] == pytest.approx(
        task.raw_grad_norms[3], rel=1e-5)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000006"]
    assert task.exported == 6


def test_gradients_are_clipped_before_the_step(tmp_path, recorded):
    task = FakeTask(recorded, scale=100.0)  # large gradients
    trainer, opt = _trainer(tmp_path, task, recorded, steps=3, clip_grad=0.5)
    trainer.fit()
    assert all(n > 0.5 for n in task.raw_grad_norms)
    assert [s["grad_norm"] for s in opt.at_step] == pytest.approx([0.5] * 3, rel=1e-4)
    # and unclipped with clip_grad=0
    events: list = []
    task = FakeTask(events, scale=100.0)
    trainer, opt = _trainer(tmp_path / "noclip", task, events, steps=3, clip_grad=0.0)
    trainer.fit()
    assert [s["grad_norm"] for s in opt.at_step] == pytest.approx(task.raw_grad_norms, rel=1e-5)


def test_non_finite_loss_stops_before_the_update_and_keeps_the_last_checkpoint(tmp_path, recorded):
    task = FakeTask(recorded, nan_at=3)
    trainer, opt = _trainer(tmp_path, task, recorded, checkpoint_every=2)
    weight_at_2 = {}
    save = trainer.save
    trainer.save = lambda: (weight_at_2.setdefault("w", task.model.weight.detach().clone()), save())[1]
    with pytest.raises(NonFiniteLossError, match="not finite at step 3.*last good checkpoint is step 2"):
        trainer.fit()
    assert len(opt.at_step) == 3  # steps 0, 1, 2 updated; step 3 did not
    assert recorded[-3:] == ["zero_grad", "forward", "backward"]  # no optimizer.step, after_step or log
    assert [r["step"] for r in _rows(tmp_path)] == [0, 1, 2]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert not (tmp_path / "checkpoints" / "step_00000004").exists()


def test_stop_and_resume_repeats_the_uninterrupted_run(tmp_path, capsys):
    setup_logging(rank=0)
    ref_events: list = []
    ref = FakeTask(ref_events)
    trainer, _ = _trainer(tmp_path / "ref", ref, ref_events)
    assert trainer.fit() == 0

    events: list = []
    first = FakeTask(events)
    trainer, _ = _trainer(tmp_path / "run", first, events, stop_after=4)
    assert trainer.fit() == 0 and first.exported is None  # stopped with a checkpoint, not finished
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    second = FakeTask(events)  # a fresh process: same initial weights, state comes from the checkpoint
    trainer, _ = _trainer(tmp_path / "run", second, events)
    assert trainer.fit() == 0
    assert "resuming from checkpoint at step 4" in capsys.readouterr().err
    assert second.batches == ref.batches[4:] and len(second.values) == 2
    torch.testing.assert_close(second.model.weight, ref.model.weight)
    torch.testing.assert_close(second.ema.weight, ref.ema.weight)
    assert [r["step"] for r in _rows(tmp_path / "run")] == list(range(6))


def test_a_checkpoint_from_before_the_skip_counter_and_lr_record_still_resumes(tmp_path):
    from dinopipe.train.lr_record import LrBasis

    events: list = []
    first = FakeTask(events)
    trainer, _ = _trainer(tmp_path, first, events, stop_after=2)
    for key in ("skipped_steps", "lr_batch", "lr_peak"):  # what an older trainer saved
        trainer.state.values.pop(key, None)
    assert trainer.fit() == 0
    second = FakeTask(events)
    trainer, _ = _trainer(tmp_path, second, events)
    trainer.lr_basis = LrBasis([2], lambda b: _schedules(6), lambda b: [0.01])
    trainer._use_lr_batches([2])
    assert trainer.fit() == 0
    assert second.batches == [(0, 4), (0, 6), (0, 8), (0, 10)]
    assert _rows(tmp_path)[-1]["skipped_steps"] == 0
