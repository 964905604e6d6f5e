"""The real Trainer (loop, FSDP2 on gloo, DCP checkpoints, export, signals, teardown) around a tiny MLP task,
so tests can start it many times: ``python _mini_trainer.py RUN_DIR MODE [key=value ...]``.

Launched once per rank with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (as srun would, each rank leading its
own process group), or alone. Modes:
  train  - train to the end (or until preempted); prints nothing special. Exit code: the loop's.
  count  - also counts, per step, torch.distributed.all_reduce calls and host reads of tensors made inside
           the step (``.item() .tolist() float() int() bool() .numpy()``: on CUDA each one waits for the GPU)
           and writes them to RUN_DIR/counts_rank{R}.json.
Options: steps=8 workers=2 persistent=1 phases=2 ckpt=4 log=1000 groups=1 clip=0.5 accumulate=1
         extras=none|rank1 (rank 1 alone logs the declared 'rank1_only')|undeclared (rank 1 alone logs 'oops')
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dinopipe.data.loader import DataPosition, GlobalBatchSampler
from dinopipe.train.checkpoint import ModelOptimState, full_state_dict
from dinopipe.train.dist import end_rank, init_distributed
from dinopipe.train.loop import LoopConfig, Phase, Trainer
try:
    from dinopipe.train.signals import worker_ignore_signals
except ImportError:  # an older checkout (to count its syncs for comparison)
    worker_ignore_signals = None

POOL = 64


class Points(Dataset):
    """(index, epoch) -> a fixed random point; the target is a fixed function of it."""

    def __len__(self):
        return POOL

    def __getitem__(self, key):
        i, epoch = key
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return x, torch.stack([x[:4].sum(), x[4:].prod(), x.abs().max(), x.mean()])


class MiniTask:
    """What the loop needs from a task (dinopipe.train.loop.Task), around an FSDP2-sharded MLP."""

    metric_keys = ("mse", "x_mean", "n", "rank1_only")

    def __init__(self, info, groups: int, extras: str = "none") -> None:
        self.rank, self.extras = info.rank, extras
        torch.manual_seed(0)
        self.models = nn.ModuleList(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)) for _ in range(groups))
        if info.distributed:
            from torch.distributed.fsdp import fully_shard

            for m in self.models:
                fully_shard(m[0])
                fully_shard(m)

    def __call__(self, batch, values):
        x, y = batch
        losses = [nn.functional.mse_loss(m(x), y) for m in self.models]
        loss = sum(losses)
        logs = {"mse": losses[0].detach(), "x_mean": x.mean(), "n": int(x.shape[0])}
        if self.rank == 1 and self.extras == "rank1":
            logs["rank1_only"] = 7.0
        if self.rank == 1 and self.extras == "undeclared":
            logs["oops"] = torch.ones(())
        return loss, logs

    def trainable_parameters(self):
        return [p for m in self.models for p in m.parameters()]

    def clip_groups(self):
        return [list(m.parameters()) for m in self.models]

    def after_step(self, values):
        pass

    def checkpoint_states(self, optimizer):
        return {"models": ModelOptimState(self.models, optimizer)}

    def export(self, run_dir, step):
        sds = [full_state_dict(m) for m in self.models]  # collective: every rank gathers
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        (Path(run_dir) / "export").mkdir(parents=True, exist_ok=True)
        torch.save(sds, Path(run_dir) / "export" / "params.pt")


def build(run_dir: str, opts: dict, info):
    steps, n_phases = int(opts.get("steps", 8)), int(opts.get("phases", 2))
    task = MiniTask(info, int(opts.get("groups", 1)), opts.get("extras", "none"))
    optimizer = torch.optim.AdamW(task.trainable_parameters(), lr=1e-2)
    bounds = [(steps * i // n_phases, steps * (i + 1) // n_phases) for i in range(n_phases)]
    workers = int(opts.get("workers", 2))

    def loader(pos: DataPosition, b: int):
        sampler = GlobalBatchSampler(POOL, b, info.rank, info.world_size, 0, pos)
        return DataLoader(Points(), batch_sampler=sampler, num_workers=workers, worker_init_fn=worker_ignore_signals,
                          persistent_workers=workers > 0 and opts.get("persistent", "1") == "1",
                          prefetch_factor=2 if workers else None)

    phases = [Phase(f"p{i}", s, e, 4 - 2 * (i % 2), 8, 8, build_loader=lambda pos, b=4 - 2 * (i % 2): loader(pos, b))
              for i, (s, e) in enumerate(bounds)]
    schedules = {"lr": torch.full((steps,), 1e-2).numpy(), "wd": torch.zeros(steps).numpy()}
    cfg = LoopConfig(seed=0, clip_grad=float(opts.get("clip", 0.5)), log_every=int(opts.get("log", 1000)),
                     checkpoint_every=int(opts.get("ckpt", 4)), keep_last=2, progress=False,
                     accumulate=int(opts.get("accumulate", 1)))
    return Trainer(task, optimizer, schedules, phases, run_dir, info, cfg, pool_size=POOL)


SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__", "numpy")


def install_counters(trainer: Trainer, out: Path, rank: int) -> None:
    """Count all_reduce calls and host reads per step: from the start of one step to the start of the next
    (the step, its logging, checkpoint and preemption decisions). Not counted: AdamW's step counters (host
    tensors unless capturable/fused) and the sampler's index tensors (built on the host): no device waits."""
    counts: list[dict] = []
    active = [False]

    def host_counters():
        return [st["step"] for st in trainer.optimizer.state.values() if "step" in st]

    def counting(name, fn):
        def wrapper(*a, **k):
            # AdamW keeps its step counters on the host unless capturable/fused: reading them is no sync.
            if active[0] and not (a and any(a[0] is t for t in host_counters())) \
                    and not sys._getframe(1).f_code.co_filename.endswith("loader.py"):
                counts[-1][name] = counts[-1].get(name, 0) + 1
            return fn(*a, **k)
        return wrapper

    dist.all_reduce = counting("all_reduce", dist.all_reduce)
    torch.distributed.all_reduce = dist.all_reduce
    for name in SYNCS:
        setattr(torch.Tensor, name, counting("sync", getattr(torch.Tensor, name)))
    step_fn = trainer._train_step

    def step(*a, **k):
        out.write_text(json.dumps(counts))  # the previous steps, complete
        counts.append({})
        active[0] = True
        return step_fn(*a, **k)

    trainer._train_step = step


def main() -> int:
    run_dir, mode = sys.argv[1], sys.argv[2]
    opts = dict(a.split("=", 1) for a in sys.argv[3:])
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    info = init_distributed("cpu")
    clean, done = False, None
    try:
        trainer = build(run_dir, opts, info)
        if mode == "count":
            install_counters(trainer, Path(run_dir) / f"counts_rank{info.rank}.json", info.rank)
        rc = trainer.fit()
        clean, done = True, rc
        record_teardown(Path(run_dir) / f"teardown_rank{info.rank}.json")
        return rc
    finally:
        end_rank(clean, done)  # as the stages end a rank (train.builders.stage_main)


def record_teardown(out: Path) -> None:
    """What is still running when the loop has returned and the process group is about to go: data workers
    (child processes) and threads. Tests of a clean exit expect no worker and no non-daemon thread here: what
    lives on is torn down by interpreter exit, in no set order, where an abort in a C++ destructor happens."""
    import multiprocessing
    import threading

    out.write_text(json.dumps({
        "children": [p.name for p in multiprocessing.active_children()],
        "threads": sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()),
        "non_daemon_threads": sorted(t.name for t in threading.enumerate()
                                     if t is not threading.main_thread() and not t.daemon),
    }))


def repeat(n: int, base: str, opts: list[str]) -> int:
    """Run a 2-rank job ``n`` times; print each run's per-rank exit codes (-6 for SIGABRT) as JSON.

    Torch and dinopipe are imported once here; each rank is a fork of this process, launched as torchrun
    launches one (TORCHELASTIC_RUN_ID set), that runs ``main`` and so ends as a stage's rank does
    (``train.dist.end_rank``: the barrier, the group destroyed, then ``exit_now``), so a run costs its
    training, not the imports. Interpreter exit's teardown of gloo's threads is what aborted ranks
    ("terminate called without an active exception"; pytorch PR 179291): a finished launched rank never
    runs it. What the loop leaves when it returns (data workers, non-daemon threads) is recorded before the
    group goes: the part of a clean exit that is the loop's own."""
    import socket

    codes = []
    for i in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                os.setsid()  # its own process group, as under srun
                log = os.open(f"{base}/run{i}.rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=f"repeat-{i}")
                sys.argv = [sys.argv[0], f"{base}/run{i}", "train", *opts]
                raise SystemExit(main())  # main ends the rank with exit_now; a failed rank unwinds to here
            pids.append(pid)
        waited = [os.wait4(p, 0) for p in pids]
        codes.append([os.waitstatus_to_exitcode(w[1]) for w in waited])
        print(f"run {i}: exit codes {codes[-1]}, cpu s {[round(w[2].ru_utime + w[2].ru_stime, 2) for w in waited]}",
              file=sys.stderr, flush=True)
    print(json.dumps(codes), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "repeat":
        sys.exit(repeat(int(sys.argv[2]), sys.argv[3], sys.argv[4:]))
    sys.exit(main())
