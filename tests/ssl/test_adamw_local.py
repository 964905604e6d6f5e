"""The trainer's AdamW runs its update on the local shards of FSDP2's DTensors (ssl/adamw.py): on 2 gloo ranks, a
real backbone (vit_test, DINOv2's layer-wise lr groups) trained 4 steps on crops of a photo ends with the same
weights and moments as torch's stock AdamW, bit for bit, for the foreach and the fused kernel; its moments stay
DTensors and DCP's optimizer state dict (a checkpoint's content) is the stock one. In one process (plain tensors)
it is the stock AdamW, bit for bit. Resuming from a checkpoint with it: tests/train/test_fsdp_matrix.py (resumed
== uninterrupted, bit for bit) and test_pretrain_resume.py."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from dinopipe.ssl.adamw import SUPPORTED, ShardLocalAdamW
from dinopipe.ssl.param_groups import build_param_groups
from dinopipe.utils.proc import exit_now

WORLD = 2


def _photo_batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    from skimage import data as skdata

    img = torch.from_numpy(skdata.astronaut().astype(np.float32) / 255.0).permute(2, 0, 1)
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ys, xs = g.integers(0, img.shape[1] - 56, 4), g.integers(0, img.shape[2] - 56, 4)
        out.append(torch.stack([img[:, y:y + 56, x:x + 56] for y, x in zip(ys, xs)]))
    return out


def _model():
    from dinopipe.models import create_model

    torch.manual_seed(0)
    return create_model("vit_test", img_size=56, drop_path_rate=0.0)


def _sharded(fully_shard):
    model = _model()
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    return model


def _train(model, opt, batches) -> None:
    for x in batches:
        opt.zero_grad(set_to_none=True)
        out = model(x)
        out.square().mean().backward()
        opt.step()


def _opt(cls, model, impl: str):
    groups = build_param_groups(model)
    for i, g in enumerate(groups):
        g["lr"], g["weight_decay"] = 1e-3 * (1 + i % 3), 0.04 * g["wd_multiplier"]
    return cls(groups, betas=(0.9, 0.999), **{impl: True})


def _rank_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    batches = _photo_batches(4, seed=rank)
    result = {}
    for impl in ("foreach", "fused"):
        trained = {}
        for name, cls in (("stock", torch.optim.AdamW), ("local", ShardLocalAdamW)):
            model = _sharded(fully_shard)
            opt = _opt(cls, model, impl)
            _train(model, opt, batches)
            trained[name] = (model, opt)
        (ms, os_), (ml, ol) = trained["stock"], trained["local"]
        same_w = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(ms.parameters(), ml.parameters()))
        pairs = [(a, b) for a, b in zip(ms.parameters(), ml.parameters()) if os_.state.get(a)]  # trained ones
        same_m = len(pairs) > 10 and all(
            len(ol.state[b]) == 3 and torch.equal(os_.state[a][k].to_local(), ol.state[b][k].to_local())
            for a, b in pairs for k in ("exp_avg", "exp_avg_sq"))
        dtensor_state = all(isinstance(ol.state[b][k], DTensor) for _, b in pairs for k in ("exp_avg", "exp_avg_sq"))
        # DCP's optimizer state dict (what a checkpoint holds) is the stock one: same keys, same sharded values.
        sd_s, sd_l = get_optimizer_state_dict(ms, os_), get_optimizer_state_dict(ml, ol)
        def local(t):
            return getattr(t, "_local_tensor", t)

        same_sd = sd_s["state"].keys() == sd_l["state"].keys() and all(
            type(v) is type(sd_l["state"][n][k]) and torch.equal(local(v), local(sd_l["state"][n][k]))
            for n, st in sd_s["state"].items() for k, v in st.items())
        result[impl] = torch.tensor([same_w, same_m, dtensor_state, same_sd])
    torch.save(result, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    exit_now(0)  # gloo's teardown at interpreter exit can abort a finished rank


def test_two_gloo_ranks_give_the_stock_adamw_weights_and_moments_bit_for_bit(tmp_path):
    import torch.multiprocessing as mp

    from tests.train.conftest import free_port

    assert SUPPORTED, f"ShardLocalAdamW falls back to the stock step on torch {torch.__version__}"
    out = str(tmp_path / "r")
    sys.path.insert(0, os.getcwd())
    mp.start_processes(_rank_main, args=(free_port(), out), nprocs=WORLD, start_method="spawn")
    for r in range(WORLD):
        got = torch.load(f"{out}.{r}", weights_only=True)
        for impl, flags in got.items():
            same_w, same_m, dtensor_state, same_sd = flags.tolist()
            assert same_w and same_m, (r, impl)  # the same update as torch's AdamW on DTensors
            assert dtensor_state, (r, impl)  # moments stay sharded DTensors: DCP files unchanged
            assert same_sd, (r, impl)  # a checkpoint's optimizer state is what the stock AdamW writes


def test_one_process_is_the_stock_adamw():
    batches = _photo_batches(3)
    for impl in ("foreach", "fused"):
        runs = []
        for cls in (torch.optim.AdamW, ShardLocalAdamW):
            model = _model()
            opt = _opt(cls, model, impl)
            _train(model, opt, batches)
            runs.append([p.detach().clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*runs)), impl
