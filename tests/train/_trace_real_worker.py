"""One rank of a real gloo run (torchrun) of the step ``plan --trace`` traces: same task, same FSDP2, same step
order, real tensors, FSDPMemTracker in real mode. Rank 0 writes its peak to argv[1] (tests/test_plan_trace.py)."""

import json
import sys
from functools import partial

import torch

from dinopipe.config import load_config
from dinopipe.plan.trace import _phase, _step, synthetic_batch
from dinopipe.ssl.config import PretrainConfig
from dinopipe.ssl.param_groups import build_param_groups
from dinopipe.ssl.task import SSLTask
from dinopipe.train.builders import build_schedules
from dinopipe.train.dist import all_reduce_sum_fn, destroy, init_distributed
from dinopipe.train.run import build_task, parallelize_task
from dinopipe.utils.torch_compat import fsdp_mem_tracker


def main(out: str, overrides: list[str]) -> None:
    cfg = load_config(PretrainConfig, None, overrides)
    info = init_distributed("cpu")
    torch.manual_seed(0)
    task = build_task(SSLTask, cfg, all_reduce_fn=all_reduce_sum_fn())
    parallelize_task(task, info, cfg.parallel)
    _, ph = _phase(cfg, None)
    micro = [synthetic_batch(cfg, ph, task.data_patch_size, i) for i in range(cfg.train.accumulate)]
    o = cfg.optim
    optimizer = task.build_optimizer(partial(build_param_groups, lr_decay_rate=o.layerwise_decay,
                                             patch_embed_lr_mult=o.patch_embed_lr_mult), betas=(o.adamw_beta1, o.adamw_beta2))
    values = {k: float(v[0]) for k, v in build_schedules(cfg, info.world_size).items()}
    tracker = fsdp_mem_tracker([m for m in task.modules() if hasattr(m, "unshard")][0],
                               next(iter(task.optimizers.values())), roots=task)
    tracker.track_inputs((micro,))
    with tracker:
        for _ in range(2):
            _step(task, optimizer, micro, values, o.clip_grad)
            tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")
    if info.is_main:
        dev = next(iter(peak))
        json.dump({"peak": int(peak[dev]["Total"])}, open(out, "w"))
    destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
