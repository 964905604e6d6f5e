"""One rank of a process group, bf16: train/mirror.py (fp32 masters, one multi-tensor cast per forward, one
multi-tensor gradient copy after backward) is the same step as FSDP2's MixedPrecisionPolicy(bf16, fp32) at one
rank -- same losses, gradients, parameters and EMA teacher after several steps, micro-batch accumulation
included -- with far fewer cast / copy launches; between steps the modules hold fp32 nn.Parameters."""

import glob
from functools import partial

import pytest
import torch
import torch.distributed as dist
from PIL import Image

from dinopipe.config import load_config
from dinopipe.data.transforms import MultiCropAugmentation, MultiCropCollator
from dinopipe.plan import gpu_cost as gc
from dinopipe.ssl.config import PretrainConfig
from dinopipe.ssl.param_groups import build_param_groups
from dinopipe.ssl.task import SSLTask
from dinopipe.train import parallel
from dinopipe.train.clip import clip_groups_, local_grad_sq
from dinopipe.train.dist import DistInfo
from dinopipe.train.run import parallelize_task
from tests.train.conftest import REPO, TINY

VALUES = {"teacher_temp": 0.04, "momentum": 0.9}


@pytest.fixture(scope="module")
def batch(photo_pool):
    aug = MultiCropAugmentation(global_size=56, local_size=28, n_local=2)
    imgs = [Image.open(p).convert("RGB") for p in sorted(glob.glob(f"{photo_pool}/*.jpg"))[:4]]
    return MultiCropCollator(14, mask_probability=0.5)([aug(im, seed=i) for i, im in enumerate(imgs)])


@pytest.fixture(scope="module")
def one_rank():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DistInfo(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    if created:
        dist.destroy_process_group()


def _train(batch, info, mirror: bool, monkeypatch, micro: int = 1, steps: int = 3):
    monkeypatch.setattr(parallel, "ONE_RANK_MIRROR", mirror)
    torch.manual_seed(0)
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/quickstart.yaml",
                      [*TINY, "data.paths=[x]", "parallel.param_dtype=bf16"])
    task = SSLTask(cfg)
    parallelize_task(task, info, cfg.parallel)
    o = cfg.optim
    opt = task.build_optimizer(partial(build_param_groups, lr_decay_rate=o.layerwise_decay,
                                       patch_embed_lr_mult=o.patch_embed_lr_mult), betas=(o.adamw_beta1, o.adamw_beta2))
    groups = [[p for p in g if p.requires_grad] for g in task.clip_groups()]
    losses, grads, rec = [], [], gc.CostRecorder()
    for step in range(steps):
        rec.active = step == steps - 1
        opt.zero_grad(set_to_none=True)
        with rec:
            for _ in range(micro):
                loss, _ = task(batch, VALUES)
                (loss / micro).backward()
                losses.append(float(loss.detach()))
            norms = [float(local_grad_sq(g)) ** 0.5 for g in groups]
            grads.append(norms)
            clip_groups_(groups, norms, o.clip_grad)
            opt.step()
            task.after_step(VALUES)
    params = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in task.named_parameters()}
    copies = sum(op.kernels for op in rec.ops if op.category == "copy/cast/cat")
    return task, opt, losses, grads, params, copies


@pytest.mark.parametrize("micro", [1, 2])
def test_mirror_is_fsdp2_mixed_precision_at_one_rank(batch, one_rank, monkeypatch, micro):
    task, opt, losses, norms, params, copies = _train(batch, one_rank, True, monkeypatch, micro)
    _, _, ref_losses, ref_norms, ref_params, ref_copies = _train(batch, one_rank, False, monkeypatch, micro)
    assert losses == ref_losses  # same shapes, same kernels: the same bits
    assert norms == ref_norms
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        assert torch.equal(p, ref_params[name]), name  # student and EMA teacher alike
    # FSDP2 casts and copies each parameter per forward; the mirror does one multi-tensor launch per chunk
    n_params = sum(1 for _ in task.parameters())
    assert copies + n_params < ref_copies, (copies, ref_copies, n_params)
    # between steps the modules show their fp32 masters, the very tensors the optimizer updates
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    trained = [p for p in task.student.parameters() if p.requires_grad]
    assert trained and all(id(p) in in_opt for p in trained)
    assert all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32 for p in task.parameters())
    assert all(v.dtype == torch.float32 for k, v in task.state_dict().items() if v.is_floating_point())


def test_frozen_forward_puts_the_masters_back_and_sees_updates(batch, one_rank, monkeypatch):
    task, opt, *_ = _train(batch, one_rank, True, monkeypatch, steps=1)
    backbone = task.teacher["backbone"]
    before = [p for p in backbone.parameters()]
    with torch.no_grad():
        out1 = backbone.forward_features_list([batch["global_crops"]], [None])[0]["x_norm_clstoken"]
        assert [p for p in backbone.parameters()] == before  # the same fp32 objects, nothing left swapped in
        for p in backbone.parameters():
            p.mul_(1.5)
        out2 = backbone.forward_features_list([batch["global_crops"]], [None])[0]["x_norm_clstoken"]
    assert out1.dtype == torch.bfloat16  # ran on the compute copy
    assert not torch.equal(out1, out2)  # the copy was refreshed from the updated masters


def test_compiled_blocks_see_the_same_parameters_every_step():
    """The bf16 copy keeps its Parameter objects (only their storage is freed between uses), so a compiled block
    with activation checkpointing compiles once, not once per step."""
    from torch import nn

    from dinopipe.train.mirror import apply_mirror
    from dinopipe.train.parallel import apply_activation_checkpointing, compile_block
    from dinopipe.utils import torch_compat as compat

    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x):
            return x + self.lin(self.norm(x))

    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = nn.Sequential(Blk(), Blk())
    for blk in blocks:
        apply_activation_checkpointing(blk)
        compile_block(blk, "aot_eager")
    apply_mirror(blocks, torch.bfloat16, ("forward",))
    opt = torch.optim.AdamW(blocks.parameters(), lr=0.1)
    before = compat.dynamo_counters()["stats"]["unique_graphs"]
    masters = list(blocks.parameters())
    for _ in range(4):
        y = blocks(torch.randn(3, 5, 8))
        y.float().square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert y.dtype == torch.bfloat16
        assert list(blocks.parameters()) == masters and all(p.dtype == torch.float32 for p in masters)
    assert compat.dynamo_counters()["stats"]["unique_graphs"] - before == 2  # one per block, whatever the step
