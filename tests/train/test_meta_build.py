"""Models are born on ``meta`` in multi-rank runs (``train/run.py:build_sharded_task``): every rank shards an
empty task and receives rank 0's weights shard by shard. The initial weights must be exactly those a
one-process build of the same seed gives (what every earlier version trained from), for the pretraining task
(student, heads, EMA teacher), the DINOv3 task with its Gram teacher, and distillation (teacher + heads read
from a file by rank 0 only, students and their EMAs)."""

import subprocess
import sys

import pytest
import torch

from dinopipe.config import load_config
from tests.train.conftest import REPO, TINY, TINY_DISTILL, env

CASES = ("pretrain", "dinov3_gram", "distill")
WORKER = str(REPO / "tests" / "train" / "_meta_build_worker.py")


def config(name: str, teacher: str):
    """(config, task class) of a test case (shared with the worker)."""
    if name == "distill":
        from dinopipe.ssl.distill import DistillTask
        from dinopipe.ssl.distill_config import DistillConfig

        return load_config(DistillConfig, str(REPO / "configs/distill/quickstart.yaml"),
                           [*TINY_DISTILL, "data.paths=[x]", f"teacher_model.path={teacher}", "train.seed=3"]), DistillTask
    from dinopipe.ssl.config import PretrainConfig
    from dinopipe.ssl.task import SSLTask

    extra = ["train.seed=5"]
    if name == "dinov3_gram":
        extra += ["model.name=vit_test_dinov3", "gram.enabled=true", "gram.first_step=0",
                  "phases=[{name: base, fraction: 1.0, global_crops_size: 64, local_crops_size: 32, batch_size_per_gpu: 2}]"]
    return load_config(PretrainConfig, str(REPO / "configs/pretrain/quickstart.yaml"),
                       [*TINY, "data.paths=[x]", *extra]), SSLTask


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher export with heads (what a pretraining run writes), for distillation in ssl mode."""
    from dinopipe.export import save_backbone, save_heads
    from dinopipe.models import DINOHead, create_model

    out = tmp_path_factory.mktemp("teacher") / "teacher"
    torch.manual_seed(11)
    save_backbone(create_model("vit_test"), out)
    save_heads(out, {n: DINOHead(64, 128, 64, 32, 3).state_dict() for n in ("dino_head", "ibot_head")})
    return out


def reference(name: str, teacher: str) -> dict:
    """The one-process build of the same seed (train/run.py before meta builds: every rank did this)."""
    from dinopipe.train.run import build_task

    cfg, task_cls = config(name, teacher)
    torch.manual_seed(cfg.train.seed)
    return build_task(task_cls, cfg).state_dict()


@pytest.mark.slow
@pytest.mark.dist
def test_two_ranks_built_on_meta_start_from_the_one_process_weights_exactly(tmp_path, teacher_dir):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER,
                        str(tmp_path), str(teacher_dir)], env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"worker exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    for name in CASES:
        got = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        ref = reference(name, str(teacher_dir))
        assert not got["meta_left"], name
        assert sorted(got["state"]) == sorted(ref), name
        for k, v in ref.items():
            assert torch.equal(got["state"][k], v), f"{name}: {k} differs from the one-process init"
        # rank 0 holds about half of every sharded parameter, not the whole task
        assert got["local_numel"] < 0.6 * sum(v.numel() for v in ref.values() if v.dim() > 0), name
