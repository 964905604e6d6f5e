"""The teacher–student base (dinopipe/ssl/base.py) and the train layer around it (dinopipe/train/run.py):
one way to build a head, what a task declares for checkpoints and sharding, and distillation's config
mistakes refused with exit 2 before a run directory exists."""

import pytest
import torch

from dinopipe.config import load_config
from dinopipe.hub import export_dinov2
from dinopipe.models import create_model
from dinopipe.models.head import DINOHead
from dinopipe.ssl.base import build_head, head_config
from dinopipe.ssl.config import HeadConfig, PretrainConfig
from dinopipe.ssl.task import SSLTask
from dinopipe.train import distill
from dinopipe.train.run import checkpoint_states
from conftest import REPO, TINY, TINY_DISTILL


def test_head_from_config_and_rebuilt_from_its_weights():
    torch.manual_seed(0)
    cfg = HeadConfig(n_prototypes=40, hidden_dim=24, bottleneck_dim=8, nlayers=3)
    fresh = build_head(16, cfg)
    assert head_config(fresh.state_dict()) == cfg
    trained = DINOHead(16, 40, 24, 8, 3, norm_last_layer=False)  # DINOv2's learnable prototype gain
    with torch.no_grad():
        trained.last_layer_gain.mul_(1.5)
    x = torch.randn(5, 16)
    for head in (fresh, trained):
        back = build_head(state_dict=head.state_dict())
        assert (back.last_layer_gain is None) == (head.last_layer_gain is None)
        torch.testing.assert_close(back(x), head(x))
    like = build_head(32, head_config(trained.state_dict()))  # a student's head next to its teacher's
    assert like.mlp[0].in_features == 32 and like.last_layer.weight.shape == trained.last_layer.weight.shape


def test_pretraining_task_declares_its_states_and_exports():
    torch.manual_seed(0)
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/quickstart.yaml", [*TINY, "data.paths=[x]"])
    task = SSLTask(cfg)
    opt = task.build_optimizer(lambda m: [{"params": list(m.parameters()), "lr_multiplier": 1.0}])
    states = checkpoint_states(task, opt)
    assert list(states) == ["student", "teacher", "loss_state"]
    assert states["student"].optimizer is task.optimizers["student"] and states["teacher"].optimizer is None
    trained, frozen = task.shard_groups()
    assert [id(m) for m in trained] == [id(m) for m in task.student.values()]
    assert [id(m) for m in frozen] == [id(m) for m in task.teacher.values()]
    [spec] = task.export_specs(step=7)
    assert spec.name == "teacher" and spec.backbone is task.teacher["backbone"] and set(spec.heads) == {"dino_head"}


@pytest.fixture(scope="module")
def bare_teacher(tmp_path_factory):
    torch.manual_seed(0)
    return export_dinov2(create_model("vit_test", img_size=56), tmp_path_factory.mktemp("bare") / "t.pth")


@pytest.mark.parametrize("overrides, key", [
    (["mode=ssl"], "mode: mode=ssl needs the teacher's heads"),
    (["dino.koleo_loss_weight=0.1"], "dino.koleo_loss_weight"),
    (["students=[{name: p16, model: {name: vit_test, patch_size: 16}}]"], "not a multiple of patch size"),
    (["students=[{name: s, model: {name: vit_nope}}]"], "students[0].model.name"),
    (["teacher_model.path=/nonexistent/teacher"], "teacher_model.path"),
])
def test_distill_mistakes_exit_2_before_anything_is_written(tmp_path, bare_teacher, capsys, overrides, key):
    out = tmp_path / "run"
    argv = ["--config", str(REPO / "configs/distill/quickstart.yaml"), *TINY_DISTILL, f"data.paths=[{tmp_path}]",
            f"train.output_dir={out}", f"teacher_model.path={bare_teacher}", *overrides]
    with pytest.raises(SystemExit) as exc:
        distill.main(argv)
    assert exc.value.code == 2
    assert key in capsys.readouterr().err
    assert not out.exists()
