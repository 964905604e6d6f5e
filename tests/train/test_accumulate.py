"""Gradient accumulation (train.accumulate=K, issue 20 item 7): K micro-batches per optimizer step with the teacher
targets centred over all of them equal one batch K times larger, for the exact parts (DINO and iBOT
cross-entropies, EMA centring and Sinkhorn-Knopp); KoLeo, a within-batch statistic, is left out (weight 0)."""

import glob

import pytest
import torch
from PIL import Image

from dinopipe.utils.masks import mask_token_weights
from dinopipe.data.transforms import MultiCropAugmentation, MultiCropCollator
from dinopipe.train.dist import DistInfo
from dinopipe.train.loop import LoopConfig, Phase, Trainer
from dinopipe.train.run import LoopTask
from tests.train.test_task import make_task

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def halves(photo_pool):
    """Two collated micro-batches of 4 photos (each with its own iBOT masks) and the same 8 samples as one batch."""
    aug = MultiCropAugmentation(global_size=56, local_size=28, n_local=2)
    imgs = [Image.open(p).convert("RGB") for p in sorted(glob.glob(f"{photo_pool}/*.jpg"))[:8]]
    collate = MultiCropCollator(14, mask_probability=1.0)
    a, b = (collate([aug(im, seed=i) for i, im in enumerate(imgs[s:s + 4], start=s)]) for s in (0, 4))
    return a, b, merge(a, b)


def merge(a: dict, b: dict) -> dict:
    """One crop-major batch of a's and b's samples (crop c of all of a's samples, then of b's, for each c)."""
    def cat(x, y, n_crops):
        return torch.cat([t for c in range(n_crops) for t in (x.chunk(n_crops)[c], y.chunk(n_crops)[c])])
    masks = cat(a["masks"], b["masks"], 2)
    return {"global_crops": cat(a["global_crops"], b["global_crops"], 2),
            "local_crops": cat(a["local_crops"], b["local_crops"], 2), "masks": masks,
            "mask_indices": masks.flatten().nonzero().flatten(), "masks_weight": mask_token_weights(masks)}


def one_step(tmp_path, micro: list[dict], batch_per_rank: int, centering: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    task = make_task("dino.koleo_loss_weight=0.0", f"teacher.centering={centering}", "ibot.separate_head=true")
    before = {k: v.detach().clone() for k, v in task.student.named_parameters()}
    opt = torch.optim.SGD(task.student.parameters(), lr=1.0)  # the update is the gradient itself
    task.optimizers["student"] = opt
    sched = {"lr": [1.0], "wd": [0.0], "last_layer_lr": [1.0], "momentum": [0.5], "teacher_temp": [0.05]}
    phases = [Phase("base", 0, 1, batch_per_rank, 56, 28, build_loader=lambda pos: iter(list(micro)))]
    cfg = LoopConfig(clip_grad=0.0, log_every=1, checkpoint_every=100, progress=False, accumulate=len(micro))
    trainer = Trainer(LoopTask(task), opt, {k: torch.tensor(v).numpy() for k, v in sched.items()}, phases, tmp_path,
                      DistInfo(), cfg, pool_size=64)
    assert trainer.fit() == 0
    update = {k: before[k] - v.detach() for k, v in task.student.named_parameters()}
    centres = {k: v.clone() for k, v in task.state_dict().items() if "center" in k}
    return update, centres, task


@pytest.mark.parametrize("centering", ["centering", "sinkhorn_knopp"])
def test_accumulate_2_at_batch_b_equals_one_step_at_batch_2b(tmp_path, halves, centering):
    a, b, merged = halves
    acc, acc_centres, _ = one_step(tmp_path / "acc", [a, b], 4, centering)
    big, big_centres, _ = one_step(tmp_path / "big", [merged], 8, centering)
    assert any(v.abs().max() > 0 for v in big.values())
    for k in big:
        # Batch shapes differ (two matmuls of 4 vs one of 8): elements near zero differ by float rounding, so the
        # absolute tolerance scales with the tensor's update (measured worst: 2.3e-6 of it).
        atol = max(1e-5 * float(big[k].abs().max()), 1e-9)
        torch.testing.assert_close(acc[k], big[k], rtol=1e-4, atol=atol, msg=k)
    assert acc_centres.keys() == big_centres.keys()
    for k in big_centres:
        torch.testing.assert_close(acc_centres[k], big_centres[k], rtol=1e-5, atol=1e-7)


def test_without_whole_batch_targets_the_centring_differs(tmp_path, halves):
    """What begin_accumulation buys: micro-batches centred one by one (each with its own Sinkhorn-Knopp) give
    another update than the batch 2x larger."""
    a, b, merged = halves
    big, _, _ = one_step(tmp_path / "big", [merged], 8, "sinkhorn_knopp")
    from dinopipe.ssl.task import SSLTask

    begin = SSLTask.begin_accumulation
    try:
        del SSLTask.begin_accumulation
        per_micro, _, _ = one_step(tmp_path / "per", [a, b], 4, "sinkhorn_knopp")
    finally:
        SSLTask.begin_accumulation = begin
    assert max(float((per_micro[k] - big[k]).abs().max()) for k in big) > 1e-5
