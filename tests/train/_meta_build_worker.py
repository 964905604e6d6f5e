"""Builds tasks the way a multi-rank run does (``build_sharded_task``: recorded on meta on every rank, replayed
into each rank's shards; or rank 0's weights broadcast), gathers every full state dict and (rank 0) saves them,
and (every rank) its generator state, local bytes and init report, for the test to compare with the one-process
build of the same seed.

    torchrun --nproc_per_node=2 tests/train/_meta_build_worker.py OUT teacher=DIR released=FILE released16=FILE
"""

import logging
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from dinopipe.train.dist import destroy, init_distributed  # noqa: E402
from dinopipe.train.run import build_sharded_task  # noqa: E402
from tests.train.test_meta_build import CASES, config  # noqa: E402


def main(out: str, *files: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    info = init_distributed("cpu")
    paths = dict(f.split("=", 1) for f in files)
    for name in CASES:
        cfg, task_cls = config(name, paths)
        task = build_sharded_task(task_cls, cfg, info, cfg.parallel)
        rng = torch.get_rng_state()
        local = sum((t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes()
                    for t in [*task.parameters(), *task.buffers()])
        torch.save({"rng": rng, "local_bytes": local, "report": task.init_report},
                   Path(out) / f"{name}.rank{info.rank}.pt")
        sd = get_model_state_dict(task, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if info.is_main:
            torch.save({"state": sd, "meta_left": [n for n, p in task.named_parameters() if p.device.type == "meta"]},
                       Path(out) / f"{name}.pt")
    destroy()


if __name__ == "__main__":
    main(*sys.argv[1:])
