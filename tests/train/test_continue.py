"""Continued pretraining from a release (issue 23), in one process: the head warm-up leaves the released backbone
bit for bit as it was while the heads learn, the backbone's lr ramps after it, saved heads are loaded (and wrong
ones refused, naming the key), and the config keys are checked."""

import glob
from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image

from dinopipe import hub
from dinopipe.config import ConfigError, load_config
from dinopipe.data.transforms import MultiCropAugmentation, MultiCropCollator
from dinopipe.models import create_model
from dinopipe.ssl.adapt import check_heads, head_warmup_schedules
from dinopipe.ssl.config import PretrainConfig
from dinopipe.ssl.config_checks import validate
from dinopipe.ssl.distill_config import DistillConfig
from dinopipe.ssl.distill_config import validate as validate_distill
from dinopipe.ssl.param_groups import apply_optim_schedules, build_param_groups
from dinopipe.ssl.task import SSLTask
from dinopipe.train.builders import build_schedules
from dinopipe.train.checks import validate_pretrain
from tests.train.conftest import REPO, TINY, TINY_DISTILL


@pytest.fixture(scope="module")
def batch(photo_pool):
    aug = MultiCropAugmentation(global_size=56, local_size=28, n_local=2)
    imgs = [Image.open(p).convert("RGB") for p in sorted(glob.glob(f"{photo_pool}/*.jpg"))[:8]]
    return MultiCropCollator(14, mask_probability=0.5)([aug(im, seed=i) for i, im in enumerate(imgs)])


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A backbone 'released' by an earlier run: an export folder without heads."""
    torch.manual_seed(7)
    model = create_model("vit_test", img_size=56, init_values=None).eval()
    out = tmp_path_factory.mktemp("release") / "export"
    hub.save_backbone(model, out)
    return out, {k: v.clone() for k, v in model.state_dict().items()}


def config(*overrides, pretrained=None):
    pre = [f"model.pretrained={pretrained}"] if pretrained else []
    return load_config(PretrainConfig, REPO / "configs/pretrain/quickstart.yaml",
                       [*TINY, "data.paths=[x]", "train.epochs=3", *pre, *overrides])


def task_for(cfg):
    torch.manual_seed(0)
    return SSLTask(cfg, load_backbone=hub.load, load_heads=hub.load_heads)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_schedules_freeze_then_ramp_the_backbone_only_when_asked():
    cfg = config("train.head_warmup_steps=3", "optim.backbone_warmup_steps=5")
    s = head_warmup_schedules(cfg, 12)
    np.testing.assert_array_equal(s["backbone_frozen"], [1, 1, 1] + [0] * 9)
    np.testing.assert_allclose(s["backbone_lr_scale"], [0, 0, 0, 0, 0.25, 0.5, 0.75, 1, 1, 1, 1, 1])
    full = build_schedules(cfg)
    assert {"backbone_frozen", "backbone_lr_scale"} <= set(full) and len(full["backbone_lr_scale"]) == 12
    plain = build_schedules(config())
    assert not {"backbone_frozen", "backbone_lr_scale"} & set(plain)  # a plain run's schedules (and logs) unchanged


def test_backbone_lr_scale_reaches_backbone_groups_only():
    task = SSLTask(config())
    groups = build_param_groups(task.student, lr_decay_rate=0.9)
    opt = torch.optim.AdamW(groups)
    apply_optim_schedules(opt, 1.0, 0.04, 1.0, backbone_lr_scale=0.25)
    backbone = {id(p) for p in task.student["backbone"].parameters()}
    seen = set()
    for g in opt.param_groups:
        inside = {id(p) in backbone for p in g["params"]}
        assert len(inside) == 1 and g["is_backbone"] == inside.pop()  # groups never mix backbone and heads
        assert g["lr"] == pytest.approx(g["lr_multiplier"] * (0.25 if g["is_backbone"] else 1.0))
        seen.add(g["is_backbone"])
    assert seen == {True, False}


def _step(task, opt, batch, values):
    apply_optim_schedules(opt, values["lr"], values["wd"], values["last_layer_lr"], values.get("backbone_lr_scale", 1))
    opt.zero_grad(set_to_none=True)
    loss, _ = task(batch, values)
    loss.backward()
    opt.step()
    task.after_step(values)


def test_head_warmup_keeps_the_release_bitwise_then_the_backbone_trains(release, batch):
    path, released = release
    cfg = config("train.head_warmup_steps=3", "optim.backbone_warmup_steps=2", "optim.warmup_epochs=0",
                 "dino.koleo_loss_weight=0.1", pretrained=path)
    task = task_for(cfg)
    opt = task.build_optimizer(partial(build_param_groups, lr_decay_rate=0.9))
    sched = build_schedules(cfg)
    heads0 = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in task.student.items() if n != "backbone"}
    for step in range(3):  # the head warm-up
        _step(task, opt, batch, {k: float(v[step]) for k, v in sched.items()})
        assert same(task.student["backbone"].state_dict(), released), step
        assert same(task.teacher["backbone"].state_dict(), released), step  # student = teacher = release
    for name, sd in heads0.items():
        assert not same(task.student[name].state_dict(), sd), f"student {name} did not train"
        assert not same(task.teacher[name].state_dict(), sd), f"teacher {name} did not follow by EMA"
    # AdamW state exists for the frozen backbone (so a checkpoint written now resumes) but was never stepped
    states = [opt.optimizers["student"].state[p] for p in task.student["backbone"].parameters()]
    assert states and all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in states)
    lrs = []
    for step in range(3, 6):  # unfrozen: the backbone's lr ramps 0 -> the schedule's
        values = {k: float(v[step]) for k, v in sched.items()}
        _step(task, opt, batch, values)
        lrs.append(max(g["lr"] / g["lr_multiplier"] for g in opt.param_groups if g["is_backbone"]))
        head_lr = max(g["lr"] / g["lr_multiplier"] for g in opt.param_groups if not g["is_backbone"])
        assert head_lr == pytest.approx(values["lr"])
    assert lrs[0] == 0 and float(sched["lr"][4]) > 0 and lrs[1] == pytest.approx(float(sched["lr"][4]))
    assert not same(task.student["backbone"].state_dict(), released)
    assert not same(task.teacher["backbone"].state_dict(), released)


def _saved_heads(tmp_path, cfg, release_path):
    """An export folder like a previous continued run leaves: the release's backbone + trained (here: random) heads."""
    torch.manual_seed(3)
    donor = SSLTask(cfg, load_backbone=hub.load, load_heads=hub.load_heads)
    heads = {n: m.state_dict() for n, m in donor.teacher.items() if n != "backbone"}
    out = tmp_path / "previous"
    hub.save_backbone(hub.load(release_path), out)
    hub.save_heads(out, heads)
    return out, heads


@pytest.mark.parametrize("separate", [False, True])
def test_heads_from_a_previous_run_are_loaded(release, tmp_path, separate):
    path, _ = release
    extra = [f"ibot.separate_head={str(separate).lower()}"]
    prev, heads = _saved_heads(tmp_path, config(*extra, pretrained=path), path)
    for src in ("auto", str(prev)):
        pre = prev if src == "auto" else path
        cfg = config(*extra, f"model.pretrained_heads={src}", pretrained=pre)
        validate_pretrain(cfg)
        task = task_for(cfg)
        assert set(heads) == {n for n in task.student if n != "backbone"}
        for name, sd in heads.items():
            assert same(task.student[name].state_dict(), sd) and same(task.teacher[name].state_dict(), sd)
    fresh = task_for(config(*extra, pretrained=prev))  # null (the default): fresh heads, as before
    assert not same(fresh.student["dino_head"].state_dict(), heads["dino_head"])
    auto_bare = task_for(config(*extra, "model.pretrained_heads=auto", pretrained=path))  # a bare release: fresh
    assert not same(auto_bare.student["dino_head"].state_dict(), heads["dino_head"])


@pytest.mark.parametrize("override, key", [
    ("dino.head.n_prototypes=64", "dino_head.last_layer.weight"),
    ("dino.head.hidden_dim=32", "dino_head.mlp.0."),
    ("ibot.separate_head=true", "ibot_head"),
    ("dino.head.last_layer=linear", "dino_head."),
])
def test_heads_of_another_shape_are_refused_naming_the_key(release, tmp_path, override, key):
    path, _ = release
    prev, heads = _saved_heads(tmp_path, config(pretrained=path), path)
    cfg = config(override, "model.pretrained_heads=auto", pretrained=prev)
    with pytest.raises(ConfigError, match="model.pretrained_heads") as exc:
        validate_pretrain(cfg)
    assert key in str(exc.value)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_heads(heads, cfg, 64, str(prev))  # the same check the task runs


def test_pretrained_heads_path_without_heads_is_refused(release, tmp_path):
    path, _ = release
    with pytest.raises(ConfigError, match="holds no DINO heads"):
        validate_pretrain(config(f"model.pretrained_heads={path}", pretrained=path))
    with pytest.raises(ConfigError, match="does not exist"):
        validate_pretrain(config(f"model.pretrained_heads={tmp_path / 'nowhere'}", pretrained=path))


@pytest.mark.parametrize("overrides, key", [
    (["train.head_warmup_steps=4"], "train.head_warmup_steps"),  # no model.pretrained: nothing to keep
    (["model.pretrained=x", "train.head_warmup_steps=12"], "train.head_warmup_steps"),  # the whole run (3 x 4)
    (["model.pretrained=x", "train.head_warmup_steps=-1"], "train.head_warmup_steps"),
    (["optim.backbone_warmup_steps=-2"], "optim.backbone_warmup_steps"),
    (["model.pretrained_heads=auto"], "model.pretrained_heads"),  # heads without a backbone
    (["model.pretrained=x", "optim.backbone_lr_mult=0"], "optim.backbone_lr_mult"),  # freezing is the warm-up's job
    (["model.pretrained=x", "optim.backbone_lr_mult=-0.2"], "optim.backbone_lr_mult"),
    (["model.pretrained=x", "optim.backbone_lr_mult=1.5"], "optim.backbone_lr_mult"),  # a backbone faster than heads
    (["optim.backbone_lr_mult=0.2"], "optim.backbone_lr_mult"),  # no release: nothing to keep
])
def test_config_validation_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(config(*overrides))
    validate(config("model.pretrained=x", "train.head_warmup_steps=11", "optim.backbone_warmup_steps=20"))


def test_distillation_refuses_the_continue_keys():
    base = ["data.paths=[x]", "teacher_model.path=x"]
    for extra, key in ((["train.head_warmup_steps=2"], "train.head_warmup_steps"),
                       (["optim.backbone_warmup_steps=2"], "optim.backbone_warmup_steps"),
                       (["optim.backbone_lr_mult=0.5"], "optim.backbone_lr_mult")):
        cfg = load_config(DistillConfig, REPO / "configs/distill/quickstart.yaml", [*TINY_DISTILL, *base, *extra])
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate_distill(cfg)


def test_backbone_lr_mult_scales_the_backbone_schedule_and_a_plain_run_is_unchanged():
    mult = 0.2
    alone = head_warmup_schedules(config("optim.backbone_lr_mult=0.2", pretrained="x"), 6)
    np.testing.assert_allclose(alone["backbone_lr_scale"], [mult] * 6)
    assert not alone["backbone_frozen"].any()
    both = head_warmup_schedules(config("train.head_warmup_steps=3", "optim.backbone_warmup_steps=5",
                                        "optim.backbone_lr_mult=0.2", pretrained="x"), 12)
    ramp = head_warmup_schedules(config("train.head_warmup_steps=3", "optim.backbone_warmup_steps=5",
                                        pretrained="x"), 12)
    np.testing.assert_allclose(both["backbone_lr_scale"], mult * ramp["backbone_lr_scale"])
    assert head_warmup_schedules(config("optim.backbone_lr_mult=1.0"), 6) == {}  # the default: schedules as before


def test_backbone_lr_mult_reaches_the_backbone_groups_only(release):
    path, _ = release
    cfg = config("optim.backbone_lr_mult=0.25", "optim.warmup_epochs=0", pretrained=path)
    validate_pretrain(cfg)
    task = task_for(cfg)
    opt = task.build_optimizer(partial(build_param_groups, lr_decay_rate=0.9))
    sched = build_schedules(cfg)
    values = {k: float(v[5]) for k, v in sched.items()}
    apply_optim_schedules(opt, values["lr"], values["wd"], values["last_layer_lr"], values["backbone_lr_scale"])
    backbone = {id(p) for p in task.student["backbone"].parameters()}
    for g in opt.param_groups:
        assert g["is_backbone"] == (id(g["params"][0]) in backbone)
        base = values["last_layer_lr"] if g["is_last_layer"] else values["lr"]
        assert g["lr"] == pytest.approx(base * g["lr_multiplier"] * (0.25 if g["is_backbone"] else 1.0))


def test_a_slower_backbone_moves_less_from_the_release_while_the_heads_train_alike(release, batch):
    """One AdamW step from the release with fresh heads: the heads' update does not depend on the backbone's lr,
    and the backbone's displacement scales with backbone_lr_mult (Adam's first step is lr x sign-like)."""
    path, released = release
    moved, heads = {}, {}
    for mult in (1.0, 0.2):
        cfg = config(f"optim.backbone_lr_mult={mult}", "optim.warmup_epochs=0", "dino.koleo_loss_weight=0.1",
                     pretrained=path)
        task = task_for(cfg)
        opt = task.build_optimizer(partial(build_param_groups, lr_decay_rate=0.9))
        _step(task, opt, batch, {k: float(v[0]) for k, v in build_schedules(cfg).items()})
        sd = task.student["backbone"].state_dict()
        moved[mult] = torch.sqrt(sum(((sd[k] - released[k]).double() ** 2).sum() for k in released)).item()
        heads[mult] = {k: v.clone() for k, v in task.student["dino_head"].state_dict().items()}
    assert moved[1.0] > 0 and moved[0.2] == pytest.approx(0.2 * moved[1.0], rel=0.05)
    assert same(heads[1.0], heads[0.2])


def test_a_bad_backbone_lr_mult_exits_2_before_anything_is_written(release, tmp_path, photo_pool, capsys):
    from dinopipe.train.pretrain import main
    from tests.train.conftest import stage_cmd

    path, _ = release
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(stage_cmd("pretrain", out, photo_pool, f"model.pretrained={path}", "optim.backbone_lr_mult=0")[3:])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "optim.backbone_lr_mult" in err, err
    assert not out.exists()


def test_head_warmup_with_gram_anchoring_to_the_release(release, batch):
    """dinov3_continue.yaml's combination: the Gram teacher is the release (first_step 0) while the head warm-up
    keeps the student's backbone frozen: the release stays bit for bit, the Gram loss is computed (no gradient)."""
    path, released = release
    cfg = config("train.head_warmup_steps=2", "optim.backbone_warmup_steps=2", "optim.backbone_lr_mult=0.2",
                 "optim.warmup_epochs=0", "gram.enabled=true", "gram.first_step=0", pretrained=path)
    validate_pretrain(cfg)
    task = task_for(cfg)
    opt = task.build_optimizer(partial(build_param_groups, lr_decay_rate=0.9))
    sched = build_schedules(cfg)
    for step in range(4):
        values = {k: float(v[step]) for k, v in sched.items()}
        apply_optim_schedules(opt, values["lr"], values["wd"], values["last_layer_lr"], values["backbone_lr_scale"])
        opt.zero_grad(set_to_none=True)
        loss, logs = task(batch, values)
        assert "gram_loss" in logs and torch.isfinite(logs["gram_loss"])
        loss.backward()
        opt.step()
        task.after_step(values)
        assert same(task.student["backbone"].state_dict(), released) == (step < 3), step  # the ramp starts at 0
    assert same(task.gram.backbone.state_dict(), released)  # the anchor is the release throughout
