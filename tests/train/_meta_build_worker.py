"""Builds tasks the way a multi-rank run does (``build_sharded_task``: meta on every rank, rank 0's weights
broadcast into the shards), gathers every full state dict and (rank 0) saves them for the test to compare with
the one-process build of the same seed.

    torchrun --nproc_per_node=2 tests/train/_meta_build_worker.py OUT TEACHER_DIR
"""

import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from dinopipe.train.dist import destroy, init_distributed  # noqa: E402
from dinopipe.train.run import build_sharded_task  # noqa: E402
from tests.train.test_meta_build import CASES, config  # noqa: E402


def main(out: str, teacher: str) -> None:
    info = init_distributed("cpu")
    for name in CASES:
        cfg, task_cls = config(name, teacher)
        task = build_sharded_task(task_cls, cfg, info, cfg.parallel)
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in task.parameters())
        sd = get_model_state_dict(task, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if info.is_main:
            torch.save({"state": sd, "local_numel": local, "meta_left": [n for n, p in task.named_parameters()
                                                                          if p.device.type == "meta"]},
                       Path(out) / f"{name}.pt")
    destroy()


if __name__ == "__main__":
    main(*sys.argv[1:3])
