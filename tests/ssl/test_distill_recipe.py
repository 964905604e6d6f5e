"""ssl-mode distillation recipe options (issue 14): where the students' heads start (``student_heads``)."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from dinopipe.config import ConfigError, load_config
from dinopipe.hub import load, load_heads, save_backbone
from dinopipe.models import DINOHead, create_model
from dinopipe.ssl.distill import DistillTask
from dinopipe.ssl.distill_config import DistillConfig, validate

STUDENT = "{name: s, model: {name: vit_test, embed_dim: 32, num_heads: 1, depth: 2, img_size: 56, init_values: null}}"


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    """A teacher folder as a pretraining export leaves it: a 64-wide backbone plus its DINO head."""
    torch.manual_seed(0)
    backbone = create_model("vit_test", img_size=56, embed_dim=64, num_heads=2, depth=2, init_values=None)
    out = save_backbone(backbone, tmp_path_factory.mktemp("teacher"))
    head = DINOHead(64, 128, hidden_dim=32, bottleneck_dim=16, nlayers=3)
    save_file({f"dino_head.{k}": v.contiguous() for k, v in head.state_dict().items()}, str(out / "heads.safetensors"))
    return out, head


def task_for(teacher_run, *overrides) -> DistillTask:
    # data.paths only has to exist: these tests build the task and feed it tensors, no loader
    cfg = load_config(DistillConfig, None, [f"teacher_model.path={teacher_run[0]}", "mode=ssl",
                                            f"students=[{STUDENT}]", f"data.paths=[{teacher_run[0]}]", *overrides])
    validate(cfg)
    return DistillTask(cfg, load_backbone=load, load_heads=load_heads)


def step_grads(task: DistillTask) -> None:
    torch.manual_seed(1)
    batch = {"global_crops": torch.randn(2 * 4, 3, 56, 56), "local_crops": torch.randn(2 * 4, 3, 28, 28)}
    loss, _ = task(batch, {"teacher_temp": 0.04, "momentum": 0.9})
    loss.backward()


def test_teacher_heads_start_the_student_from_a_trainable_copy_behind_a_width_map(teacher_run):
    task = task_for(teacher_run, "student_heads=teacher")
    head = task.students["s"]["dino_head"]
    # 32-wide student, 64-wide teacher head: a new linear map in front of the copy
    assert isinstance(head, nn.Sequential) and (head[0].in_features, head[0].out_features) == (32, 64)
    t_sd = teacher_run[1].state_dict()
    assert all(torch.equal(v, t_sd[k]) for k, v in head[1].state_dict().items())
    step_grads(task)
    assert head[0].weight.grad is not None and head[1].last_layer.weight.grad is not None
    assert all(p.grad is None and not p.requires_grad for p in task.teacher.parameters())  # the teacher stays frozen
    with torch.no_grad():  # a copy, not the teacher's own module: training the student never moves the targets
        head[1].last_layer.weight.add_(1.0)
    assert torch.equal(task.teacher["dino_head"].last_layer.weight, t_sd["last_layer.weight"])


def test_default_student_heads_are_fresh(teacher_run):
    head = task_for(teacher_run).students["s"]["dino_head"]
    assert isinstance(head, DINOHead) and head.mlp[0].in_features == 32
    assert not torch.equal(head.last_layer.weight, teacher_run[1].state_dict()["last_layer.weight"])


def test_unknown_student_heads_is_a_config_error(teacher_run):
    with pytest.raises(ConfigError, match="student_heads"):
        task_for(teacher_run, "student_heads=copy")
