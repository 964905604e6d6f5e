"""``model.rope_dtype`` holds under FSDP2 mixed precision: the RoPE tables reach every block in the configured dtype.

FSDP2's ``MixedPrecisionPolicy`` casts a module's floating-point forward inputs to the compute dtype by default, so
with each block wrapped the ``rope=`` argument arrived in bf16 whatever ``model.rope_dtype`` said (found by the 7B
trace). Only the root module casts its inputs now; the blocks receive activations already in the compute dtype."""

from __future__ import annotations

import os
import sys

import torch

WORLD = 2


def _rank_main(rank: int, port: int, out: str, rope_dtype: str) -> None:
    import torch.distributed as dist

    from dinopipe.config import ParallelConfig
    from dinopipe.models.registry import create_model
    from dinopipe.train.dist import DistInfo
    from dinopipe.train.parallel import parallelize
    from dinopipe.utils.proc import exit_now

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = create_model("vit_test_dinov3", img_size=64, rope_dtype=rope_dtype)
    info = DistInfo(rank=rank, world_size=WORLD, backend="gloo")
    parallelize([model], info, ParallelConfig(param_dtype="bf16", compile=False))
    seen = {}

    def hook(module, args, kwargs):
        sin, cos = kwargs["rope"][0] if isinstance(kwargs["rope"], (list, tuple)) else kwargs["rope"]
        seen.setdefault("rope", str(sin.dtype))
        seen.setdefault("x", str((args[0][0] if isinstance(args[0], (list, tuple)) else args[0]).dtype))

    for blk in model.blocks:
        blk.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(torch.randn(2, 3, 64, 64))
    torch.save(seen, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    exit_now(0)  # gloo's teardown at interpreter exit can abort a finished rank (SIGABRT: the test failed in CI)


def test_blocks_receive_rope_tables_in_the_configured_dtype(tmp_path):
    import torch.multiprocessing as mp

    from tests.train.conftest import free_port

    sys.path.insert(0, os.getcwd())
    for rope_dtype, want in (("fp32", "torch.float32"), ("bf16", "torch.bfloat16")):
        out = str(tmp_path / rope_dtype)
        mp.start_processes(_rank_main, args=(free_port(), out, rope_dtype), nprocs=WORLD, start_method="spawn")
        for r in range(WORLD):
            seen = torch.load(f"{out}.{r}", weights_only=True)
            assert seen["rope"] == want, (rope_dtype, seen)
            assert seen["x"] == "torch.bfloat16", seen  # the activations are still in the compute dtype
