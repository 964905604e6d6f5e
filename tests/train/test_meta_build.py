"""Models are born on ``meta`` in multi-rank runs (``train/run.py:build_sharded_task``): every rank, rank 0
included, records the build on ``meta`` (``train/meta_init.py``), shards the empty task and replays each
tensor's init into its own shard. The initial weights must be exactly those a one-process build of the same
seed gives (what every earlier version trained from), and the CPU generator must continue from the same state,
for the pretraining task (student, heads, EMA teacher), continued pretraining from a released ``.pth``
(DINOv2's layout, and DINOv3's official one, whose SwiGLU halves are packed per slice) and from an export with
its heads (``model.pretrained_heads``), the DINOv3 task with its Gram teacher, and
distillation (teacher + heads read from files, ViT students, timm CNN students with BatchNorm buffers, their
EMAs). A build the recorder cannot replay (an init with an explicit generator) falls back to rank 0 building
and broadcasting, says so in one log line, and still starts from the same weights."""

import subprocess
import sys

import pytest
import torch

from dinopipe.config import load_config
from dinopipe.ssl.task import SSLTask
from tests.train.conftest import REPO, TINY, TINY_DISTILL, env

CASES = ("pretrain", "dinov3_gram", "released", "released_dinov3", "heads", "distill", "distill_timm", "fallback")
WORKER = str(REPO / "tests" / "train" / "_meta_build_worker.py")
PHASE64 = "phases=[{name: base, fraction: 1.0, global_crops_size: 64, local_crops_size: 32, batch_size_per_gpu: 2}]"
TIMM_STUDENTS = ("students=[{name: cnx, model: {name: 'timm:convnext_atto', img_size: 64}},"
                 " {name: rn, model: {name: 'timm:resnet10t', img_size: 64}},"
                 " {name: vit, model: {name: vit_test, patch_size: 16, embed_dim: 32, num_heads: 1, depth: 2,"
                 " img_size: 64}}]")


class GeneratorInitTask(SSLTask):
    """A task whose init draws from its own generator: the recorder does not replay it (fallback case)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        with torch.no_grad():  # the same draw into the student and its EMA copy (the fallback shares their tensors)
            for model in (self.student, self.teacher):
                model.backbone.cls_token.normal_(generator=torch.Generator().manual_seed(7))


def config(name: str, files: dict):
    """(config, task class) of a test case (shared with the worker); ``files``: paths written by the fixture."""
    if name.startswith("distill"):
        from dinopipe.ssl.distill import DistillTask
        from dinopipe.ssl.distill_config import DistillConfig

        extra = [f"teacher_model.path={files['teacher']}", "train.seed=3"]
        if name == "distill_timm":
            extra = [f"teacher_model.path={files['released16']}", "train.seed=4", "mode=feature", TIMM_STUDENTS,
                     PHASE64]
        return load_config(DistillConfig, str(REPO / "configs/distill/quickstart.yaml"),
                           [*TINY_DISTILL, "data.paths=[x]", *extra]), DistillTask
    from dinopipe.ssl.config import PretrainConfig

    extra = ["train.seed=5"]
    if name == "dinov3_gram":
        extra += ["model.name=vit_test_dinov3", "gram.enabled=true", "gram.first_step=0", PHASE64]
    elif name == "released":
        extra += [f"model.pretrained={files['released']}"]
    elif name == "released_dinov3":  # packed SwiGLU fc1 and masked key bias: converted per slice (issue 31)
        extra += ["model.name=vit_test_dinov3_swiglu", f"model.pretrained={files['released_dinov3']}", PHASE64]
    elif name == "heads":
        extra += [f"model.pretrained={files['teacher']}", "model.pretrained_heads=auto",
                  "ibot.separate_head=true"]
    cfg = load_config(PretrainConfig, str(REPO / "configs/pretrain/quickstart.yaml"), [*TINY, "data.paths=[x]", *extra])
    return cfg, GeneratorInitTask if name == "fallback" else SSLTask


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A teacher export with heads (what a pretraining run writes) and two released-layout ``.pth`` files."""
    from dinopipe.export import save_backbone, save_heads
    from dinopipe.hub import export_dinov2, export_dinov3
    from dinopipe.models import DINOHead, create_model

    root = tmp_path_factory.mktemp("files")
    torch.manual_seed(11)
    save_backbone(create_model("vit_test"), root / "teacher")
    save_heads(root / "teacher", {n: DINOHead(64, 128, 64, 32, 3).state_dict() for n in ("dino_head", "ibot_head")})
    export_dinov2(create_model("vit_test"), root / "released.pth")
    export_dinov2(create_model("vit_test_reg4", img_size=64, patch_size=16, embed_dim=128, num_heads=2),
                  root / "released16.pth")
    export_dinov3(create_model("vit_test_dinov3_swiglu"), root / "dinov3_vitx16.pth")
    return {"teacher": str(root / "teacher"), "released": str(root / "released.pth"),
            "released16": str(root / "released16.pth"), "released_dinov3": str(root / "dinov3_vitx16.pth")}


def reference(name: str, files: dict) -> tuple[dict, torch.Tensor]:
    """The one-process build of the same seed (train/run.py before meta builds: every rank did this), and the
    generator state after it."""
    from dinopipe.train.run import build_task

    cfg, task_cls = config(name, files)
    torch.manual_seed(cfg.train.seed)
    sd = build_task(task_cls, cfg).state_dict()
    return sd, torch.get_rng_state()


@pytest.mark.slow
@pytest.mark.dist
def test_ranks_built_on_meta_start_from_the_one_process_weights_exactly(tmp_path, files):
    world = 2
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                        WORKER, str(tmp_path), *(f"{k}={v}" for k, v in files.items())],
                       env=env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"worker exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    assert r.stderr.count("rank 0 builds it and broadcasts") == 1, r.stderr[-3000:]  # the fallback case only
    assert "explicit generator" in r.stderr
    for name in CASES:
        ref, rng = reference(name, files)
        got = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert not got["meta_left"], name
        assert sorted(got["state"]) == sorted(ref), name
        for k, v in ref.items():
            assert torch.equal(got["state"][k], v), f"{name}: {k} differs from the one-process init"
        total = sum(v.numel() * v.element_size() for v in ref.values())
        largest = max(v.numel() * v.element_size() for v in ref.values())
        for rank in range(world):
            mine = torch.load(tmp_path / f"{name}.rank{rank}.pt", weights_only=True)
            assert torch.equal(mine["rng"], rng), f"{name}: rank {rank}'s generator is not where one process leaves it"
            # every rank (0 included) holds about 1/W of the task, not the whole of it
            assert mine["local_bytes"] < 0.6 * total, (name, rank)
            report = mine["report"]
            assert report["path"] == ("rank0-broadcast" if name == "fallback" else "replay"), (name, report)
            if name != "fallback":
                # full-size temporaries alive at once: one tensor and the one it was cloned from, never a model
                assert 0 < report["peak_replay_bytes"] <= 2 * largest, (name, report, largest)
                assert report["peak_scratch_bytes"] <= largest, (name, report, largest)
                assert report["random_ops"] > 0
