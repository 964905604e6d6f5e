"""Two complete DINOv2 training steps of dinopipe equal the official code's, tensor by tensor.

How the fixture was made (once, not in CI): ``python tests/fixtures/make_dinov2_step.py /path/to/dinov2``
imports facebookresearch/dinov2 (the commit is in the file's metadata) from that checkout and runs its
``SSLMetaArch.forward_backward``, param groups, AdamW, schedules and the ``do_train`` step on CPU, xFormers /
distributed / FSDP replaced by their single-process equivalents (the generator's docstring lists each). The start
state and the batches come from fixed numpy seeds in ``tests/ssl/_official_step.py``, so this test rebuilds them
bit for bit without the official code. ``tests/fixtures/dinov2_step.safetensors`` holds the student and teacher
after both steps, the official losses, per-module gradient norms and schedule values, and the official code's own
run-to-run noise: the same two steps with the batch's images in another order, per parameter piece, as a
fraction of that piece's update.

What is pinned: forward and losses (DINO with Sinkhorn–Knopp, iBOT, KoLeo), backward, clipping of the backbone,
DINO head and iBOT head each on its own norm, the last layer frozen at iteration 3 and free at 4 (its gain trained),
param groups (layer decay, patch-embed multiplier, weight decay on tokens and the gain), AdamW with the scheduled
lr and weight decay, and the EMA teacher. Each parameter group must stay within twice the run-to-run noise of that
group: the official code's on the fixture's machine plus dinopipe's own measured in the test on the running machine
(:func:`measure`), so another CPU's rounding does not fail it; the switch tests show what it still catches.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple, Optional
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dinopipe.config import ModelConfig
from dinopipe.models.convert import from_dinov2
from dinopipe.ssl.config import HeadConfig, PhaseConfig, PretrainConfig
from dinopipe.ssl.param_groups import apply_optim_schedules, build_param_groups
from dinopipe.ssl.task import SSLTask
from dinopipe.train.builders import build_schedules
from dinopipe.train.clip import clip_groups_, local_grad_sq

from . import _official_step as spec
from . import _official_step_v3 as v3

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dinov2_step.safetensors"


def recipe(**optim) -> PretrainConfig:
    r = spec.RECIPE
    cfg = PretrainConfig(model=ModelConfig(name="vit_test_reg4", embed_dim=spec.DIM, depth=spec.DEPTH,
                                           num_heads=spec.HEADS, ffn="swiglu", patch_size=spec.PATCH,
                                           img_size=spec.GLOBAL, init_values=r["init_values"]))
    cfg.dino.head, cfg.dino.koleo_loss_weight = HeadConfig(**spec.HEAD), r["koleo_loss_weight"]
    cfg.ibot.separate_head, cfg.ibot.head = True, HeadConfig(**spec.IBOT_HEAD)
    cfg.teacher.centering = "sinkhorn_knopp"
    for k in ("momentum_teacher", "final_momentum_teacher", "warmup_teacher_temp", "teacher_temp",
              "warmup_teacher_temp_epochs"):
        setattr(cfg.teacher, k, r[k])
    for k in ("base_lr", "min_lr", "warmup_epochs", "weight_decay", "weight_decay_end", "layerwise_decay",
              "patch_embed_lr_mult", "clip_grad", "freeze_last_layer_epochs"):
        setattr(cfg.optim, k, r[k])
    for k, v in optim.items():
        setattr(cfg.optim, k, v)
    cfg.crops.local_crops_number = spec.N_LOCAL
    cfg.phases = [PhaseConfig(global_crops_size=spec.GLOBAL, local_crops_size=spec.LOCAL,
                              batch_size_per_gpu=spec.BATCH)]
    cfg.train.epochs, cfg.train.epoch_length = spec.EPOCHS, spec.EPOCH_LENGTH
    return cfg


def dinopipe_name(official: str) -> str:
    """student/backbone.blocks.0.mlp.w12.weight -> backbone.blocks.0.mlp.fc1.weight; weight_v / weight_g of
    the weight-normed prototype layer -> last_layer.weight / last_layer_gain."""
    part, rest = official.split(".", 1)
    if part == "backbone":
        rest = next(iter(from_dinov2({rest: torch.zeros(())})))
    rest = rest.replace("last_layer.weight_v", "last_layer.weight").replace("last_layer.weight_g", "last_layer_gain")
    return f"{part}.{rest}"


@pytest.fixture(scope="module")
def official() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE))


def run_dinopipe(official: dict, order=None, **optim) -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
    cfg = recipe(**optim)
    task = SSLTask(cfg)
    for group in (task.student, task.teacher):
        # DINOv2's training config interpolates position embeddings the legacy way (offset 0.1, no antialias)
        # for every model; dinopipe gives register models the released hub models' way (offset 0, antialias).
        group["backbone"].interpolate_offset, group["backbone"].interpolate_antialias = 0.1, False
    names = [k.split("/", 1)[1] for k in official if k.startswith("student/")]
    with torch.no_grad():
        params = dict(task.named_parameters())
        for name in names:
            v = spec.initial_value(name, tuple(official[f"student/{name}"].shape))
            for who in ("student", "teacher"):
                params[f"{who}.{dinopipe_name(name)}"].copy_(v.view_as(params[f"{who}.{dinopipe_name(name)}"]))
    o = cfg.optim
    optimizer = task.build_optimizer(partial(build_param_groups, lr_decay_rate=o.layerwise_decay,
                                             patch_embed_lr_mult=o.patch_embed_lr_mult, decay_tokens=o.decay_tokens),
                                     betas=(o.adamw_beta1, o.adamw_beta2))
    schedules = build_schedules(cfg, world_size=1)
    groups = [[p for p in g if p.requires_grad] for g in task.clip_groups()]
    logs: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for k in ("lr", "wd", "momentum", "teacher_temp", "last_layer_lr"):
        logs[k] = []
    for it in spec.ITERATIONS:  # the loop's step (dinopipe/train/loop.py), one process
        values = {k: float(v[it]) for k, v in schedules.items()}
        apply_optim_schedules(optimizer, values["lr"], values["wd"], values["last_layer_lr"])
        optimizer.zero_grad(set_to_none=True)
        loss, _ = task(dict(spec.batch(it, order), n_images=spec.BATCH), values)
        loss.backward()
        norms = [math.sqrt(float(local_grad_sq(g))) for g in groups]
        clip_groups_(groups, norms, o.clip_grad)
        optimizer.step()
        task.after_step(values)
        logs["loss"].append(float(loss.detach()))
        logs["grad_norm"].append(norms)
        for k in ("lr", "wd", "momentum", "teacher_temp", "last_layer_lr"):
            logs[k].append(values[k])
    params = dict(task.named_parameters())
    out = {f"{who}/{n}": params[f"{who}.{dinopipe_name(n)}"].detach().reshape(official[f"student/{n}"].shape)
           for who in ("student", "teacher") for n in names}
    return out, logs


def deviations(official: dict, ours: dict, spec=spec,
               local: Optional[dict[str, float]] = None) -> tuple[dict[str, float], dict[str, float]]:
    """Per parameter piece: (our deviation from the official tensor, the bound it is held to), both as fractions
    of the official update. The bound: the run-to-run noise of the piece's group (the worst piece of backbone /
    DINO head / iBOT head, student or teacher) -- the official code's, measured on the machine that made the
    fixture, plus dinopipe's own measured on this machine (``local``, from :func:`measure`): our deviation is
    a difference of two runs that each round differently, and another CPU's float rounding (AMD EPYC vs Intel,
    another BLAS kernel) moves ours without touching the fixture's -- or one float32 rounding of the piece's
    largest value when that is larger (the teacher's EMA update is ~1e-4 of its values, so an ulp is ~1e-2 of
    it)."""
    noise: dict[str, float] = {}
    rows = []
    for key, ref in ((k, v) for k, v in official.items() if k.startswith(("student/", "teacher/"))):
        who, name = key.split("/", 1)
        start = spec.initial_value(name, tuple(ref.shape))
        for (piece, a), (_, b), (_, s0) in zip(*(spec.pieces(key, t) for t in (ours[key], ref, start))):
            group = f"{who}/{spec.part(piece.split('/', 1)[1])}"
            noise[group] = max(noise.get(group, 0.0), float(official[f"noise/{piece}"]))
            rows.append((piece, group, spec.relative_deviation(a, b, s0), spec.float32_resolution(b, s0)))
    dev = {piece: d for piece, _, d, _ in rows}
    bound = {piece: max(noise[group] + (local or {}).get(group, 0.0), res) for piece, group, _, res in rows}
    return dev, bound


class Measured(NamedTuple):
    """dinopipe's two steps on this machine and its own run-to-run noise here (see :func:`measure`)."""
    ours: dict[str, torch.Tensor]
    logs: dict[str, list]
    noise: dict[str, float]  # per group, as a fraction of the official update
    log_noise: dict[str, float]  # per logged value: the largest difference of a step (grad_norm: relative)


def measure(run, official: dict, spec=spec) -> Measured:
    """dinopipe's own run-to-run noise on the running machine, measured the way the fixture generators measure
    the official code's -- the same two steps with the batch's images in the other orders of
    ``spec.permutations()`` -- and once more through other kernels (ATen's convolution and GELU instead of
    oneDNN's): an image order changes only the sums across the batch, while another CPU (AVX2 vs AVX-512) also
    rounds each image's forward differently, and the DINOv3 step's bf16 RoPE and first AdamW step amplify that
    (measured on AMD EPYC with oneDNN capped at AVX2: 4000x the fixture's noise on a backbone piece, 1.7e-5 of
    the second loss). Per group, the largest difference of a piece from our reference run as a fraction of the
    official update; per logged loss the largest difference of a step; per gradient norm the relative one."""
    ours, logs = run(official)
    noise: dict[str, float] = {}
    log_noise: dict[str, float] = {}
    for order in [*spec.permutations(), None]:
        if order is None:
            enabled = torch.backends.mkldnn.enabled
            torch.backends.mkldnn.enabled = False
            try:
                other, other_logs = run(official)
            finally:
                torch.backends.mkldnn.enabled = enabled
        else:
            other, other_logs = run(official, order=order)
        for key, ref in ((k, v) for k, v in official.items() if k.startswith(("student/", "teacher/"))):
            start = spec.initial_value(key.split("/", 1)[1], tuple(ref.shape))
            for (piece, a), (_, b), (_, s0), (_, o) in zip(*(spec.pieces(key, t)
                                                             for t in (other[key], ours[key], start, ref))):
                d = (a - b).abs().max().item() / max((o - s0).abs().max().item(), 1e-30)
                noise[group_of(piece, spec)] = max(noise.get(group_of(piece, spec), 0.0), d)
        for k in ("loss", "gram_loss"):
            if k in logs:
                diff = max(abs(x - y) for x, y in zip(other_logs[k], logs[k]))
                log_noise[k] = max(log_noise.get(k, 0.0), diff)
        for k in ("grad_norm", "clipped_norm"):
            if k in logs:
                a, b = (torch.tensor(v[k], dtype=torch.float64) for v in (other_logs, logs))
                log_noise[k] = max(log_noise.get(k, 0.0), ((a - b).abs() / b).max().item())
    return Measured(ours, logs, noise, log_noise)


NOISE_MARGIN = 2.0
"""How far beyond the summed run-to-run noise (the official code's on the fixture's machine plus ours here) a piece
may sit: each noise is the largest of a few runs, a sample of the rounding's spread, not its edge (measured on AMD
EPYC: 1.03x the summed noise on the DINOv2 backbone's SwiGLU weight, 1.7x the official noise alone). The
deliberate switches below move pieces 17-165x beyond the margin, and the one whose parameters move only 2.6x
(DINOv3's clip rule: Adam's update is nearly blind to a gradient's scale) its clipped gradient norms 433x
(measured on the 2-core AMD EPYC development machine, fixture regenerated there)."""


def assert_within_noise(official: dict, m: Measured, spec=spec) -> None:
    """The losses within 10x the official plus our own noise (or 1e-5 of the loss: ~80 float32 roundings of a sum
    of ~1e3 terms; a wrong term moves it by > 1e-3 of it), the gradient norms within 1e-4 or 10x our own noise,
    and every parameter piece within the margin times the summed noise of its group."""
    for key in ("loss", "gram_loss"):
        if key in m.logs:
            noise = (official[f"log_permuted/{key}"] - official[f"log/{key}"]).abs().max().item() + m.log_noise[key]
            assert m.logs[key] == pytest.approx(official[f"log/{key}"].tolist(), rel=1e-5,
                                                abs=NOISE_MARGIN * 10 * noise), (key, noise)
    norms = torch.tensor(m.logs["grad_norm"], dtype=torch.float64)  # (steps, [backbone, dino_head, ibot_head])
    want = torch.stack([official[f"log/grad_norm/{p}"] for p in ("backbone", "dino_head", "ibot_head")], 1)
    torch.testing.assert_close(norms, want, rtol=max(1e-4, NOISE_MARGIN * 10 * m.log_noise["grad_norm"]), atol=0)
    if f"log/clipped_norm/{CLIPPED[0]}" in official:  # the DINOv3 fixture: the gradients after clipping too
        assert clipped_over_noise(official, m.logs, m) <= 1, (m.logs["clipped_norm"], m.log_noise["clipped_norm"])
    dev, bound = deviations(official, m.ours, spec, m.noise)
    over = {p: (dev[p], bound[p]) for p in dev if dev[p] > NOISE_MARGIN * bound[p]}
    assert not over, f"pieces beyond the run-to-run noise (ours, bound before the margin): {over}"


def worst_over_noise(official: dict, ours: dict, m: Measured, spec=spec) -> float:
    """The student piece farthest beyond what :func:`assert_within_noise` allows (> 1: that test would fail)."""
    dev, bound = deviations(official, ours, spec, m.noise)
    return max(dev[p] / (NOISE_MARGIN * bound[p]) for p in dev
               if p.startswith("student/") and group_of(p, spec) != "student/key_bias")


CLIPPED = ("backbone", "dino_head", "ibot_head")
"""The student modules clipped on their own in the official code, in its order."""


def grad_norm64(module: torch.nn.Module) -> float:
    """The L2 norm of a module's gradients, summed in float64 (as the fixture generator records the official one)."""
    sq = sum(float(torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float64)) ** 2
             for p in module.parameters() if p.grad is not None)
    return sq ** 0.5


def clipped_over_noise(official: dict, logs: dict, m: Measured) -> float:
    """How far the per-module gradient norms after clipping (what AdamW is handed) sit from the official ones,
    as a multiple of what the test allows: the larger of 1e-4 and the margin x 10 x our own run-to-run noise of
    them measured on this machine (relative), as for the norms before clipping. Adam's update is nearly blind to
    a gradient's scale, so a changed clip rule moves the parameters by little more than the DINOv3 step's noise
    (2.6x); the clipped norms show it directly."""
    ours = torch.tensor(logs["clipped_norm"], dtype=torch.float64)  # (steps, modules)
    want = torch.stack([official[f"log/clipped_norm/{k}"] for k in CLIPPED], 1)
    allowed = max(1e-4, NOISE_MARGIN * 10 * m.log_noise["clipped_norm"])
    return ((ours - want).abs() / want).max().item() / allowed


def group_of(piece: str, spec=spec) -> str:
    who, name = piece.split("/", 1)
    return f"{who}/{spec.part(name)}"


@pytest.fixture(scope="module")
def measured(official) -> Measured:
    return measure(run_dinopipe, official)


def test_two_dinov2_steps_equal_the_official_code(official, measured):
    logs = measured.logs
    for k in ("lr", "wd", "momentum", "teacher_temp", "last_layer_lr"):  # the schedules, value for value
        assert logs[k] == pytest.approx(official[f"log/{k}"].tolist(), rel=1e-12, abs=1e-15), k
    assert logs["last_layer_lr"][0] == 0 < logs["last_layer_lr"][1]  # frozen, then free
    assert_within_noise(official, measured)


@pytest.mark.parametrize("switch", [{"clip_per_module": False}, {"decay_tokens": False}], ids=str)
def test_each_deliberate_switch_leaves_the_official_step(official, measured, switch):
    """The test can fail: one clip norm for the whole student (scales the backbone and iBOT head by the DINO
    head's norm) or no weight decay on tokens and the prototype gain moves tensors far beyond the noise (measured
    on AMD EPYC: 165x and 130x what the test allows, 420x and 260x the official noise alone)."""
    ours, _ = run_dinopipe(official, **switch)
    worst = worst_over_noise(official, ours, measured)
    print(switch, f"worst student piece: {worst:.1f}x what the test allows")
    assert worst > 10


# -- DINOv3: one Gram-anchored stage, two steps ---------------------------------------------------------------------

FIXTURE_V3 = Path(__file__).resolve().parents[1] / "fixtures" / "dinov3_step.safetensors"
"""Made once by ``python tests/fixtures/make_dinov3_step.py /path/to/dinov3`` (the generator's docstring lists what
of the official code runs and what is replaced): facebookresearch/dinov3's ``SSLMetaArch`` with Gram anchoring,
schedules v2, fused AdamW groups and the ``do_train`` step, on CPU, from the start state and batches of
``tests/ssl/_official_step_v3.py``; the official run-to-run noise is its same two steps with the images permuted."""


@pytest.fixture(scope="module")
def official_v3() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE_V3))


def recipe_v3(**optim) -> PretrainConfig:
    from dinopipe.ssl.config import GramConfig, WeightSchedule

    r = v3.RECIPE
    cfg = PretrainConfig(model=ModelConfig(name="vit_7b16_dinov3", embed_dim=v3.DIM, depth=v3.DEPTH,
                                           num_heads=v3.HEADS, patch_size=v3.PATCH, img_size=v3.GLOBAL,
                                           init_values=r["init_values"], rope_rescale=r["rope_rescale"],
                                           rope_dtype="bf16"))
    cfg.dino.head = HeadConfig(**v3.HEAD, last_layer="linear")
    cfg.dino.koleo_loss_weight = r["koleo_loss_weight"]
    cfg.dino.local_loss_weight_schedule = WeightSchedule(**r["local_weight"])
    cfg.ibot.separate_head, cfg.ibot.head = True, HeadConfig(**v3.IBOT_HEAD, last_layer="linear")
    t = cfg.teacher
    t.centering = "sinkhorn_knopp"
    t.warmup_teacher_temp, t.teacher_temp = r["warmup_teacher_temp"], r["teacher_temp"]
    t.warmup_teacher_temp_epochs = r["warmup_teacher_temp_epochs"]
    o = cfg.optim
    o.base_lr, o.lr_schedule, o.warmup_epochs = 4 * v3.LR_PEAK, "constant", r["lr_warmup_epochs"]
    o.schedule_shape = "dinov3"
    o.weight_decay = o.weight_decay_end = r["weight_decay"]
    for k in ("layerwise_decay", "patch_embed_lr_mult", "clip_grad", "freeze_last_layer_epochs", "adamw_beta1",
              "adamw_beta2"):
        setattr(o, k, r[k])
    for k, v in optim.items():
        setattr(o, k, v)
    cfg.crops.local_crops_number = v3.N_LOCAL
    # The Gram stage's own momentum (DINOv3: 0.999) as a phase key; the run-wide default would be 0.992 -> 1.
    cfg.phases = [PhaseConfig(global_crops_size=v3.GLOBAL, local_crops_size=v3.LOCAL, batch_size_per_gpu=v3.BATCH,
                              gram_crops_size=v3.GRAM, momentum_teacher=r["momentum"])]
    cfg.gram = GramConfig(enabled=True, loss_weight=r["gram_loss_weight"], first_step=v3.GRAM_FIRST,
                          refresh_every=v3.GRAM_REFRESH - v3.GRAM_FIRST, max_refreshes=1)
    cfg.train.epochs, cfg.train.epoch_length = v3.EPOCHS, v3.EPOCH_LENGTH
    return cfg


def run_dinopipe_v3(official: dict, model: Optional[dict] = None, order=None,
                    **optim) -> tuple[dict[str, torch.Tensor], dict]:
    from dinopipe.models.convert_dinov3 import from_official_dinov3, to_official_dinov3

    cfg = recipe_v3(**optim)
    for k, v in (model or {}).items():
        setattr(cfg.model, k, v)
    task = SSLTask(cfg)
    names = [k.split("/", 1)[1] for k in official if k.startswith("student/")]
    start = {n: v3.initial_value(n, tuple(official[f"student/{n}"].shape)) for n in names}
    backbone, _ = from_official_dinov3({n.split(".", 1)[1]: v for n, v in start.items() if n.startswith("backbone.")})
    heads = {n: v for n, v in start.items() if not n.startswith("backbone.")}
    with torch.no_grad():
        for who in (task.student, task.teacher):
            who["backbone"].load_state_dict(backbone, strict=True)
            for n, v in heads.items():
                part, rest = n.split(".", 1)
                who[part].get_parameter(rest).copy_(v)
    o = cfg.optim
    optimizer = task.build_optimizer(partial(build_param_groups, lr_decay_rate=o.layerwise_decay,
                                             patch_embed_lr_mult=o.patch_embed_lr_mult, decay_tokens=o.decay_tokens),
                                     betas=(o.adamw_beta1, o.adamw_beta2))
    schedules = build_schedules(cfg, world_size=1)
    groups = [[p for p in g if p.requires_grad] for g in task.clip_groups()]
    keys = ("lr", "wd", "momentum", "teacher_temp", "last_layer_lr", "dino_local_weight")
    logs: dict[str, list] = {"loss": [], "grad_norm": [], "gram_loss": [], "clipped_norm": [], **{k: [] for k in keys}}
    for it in v3.ITERATIONS:  # the loop's step (dinopipe/train/loop.py), one process
        values = {k: float(v[it]) for k, v in schedules.items()}
        apply_optim_schedules(optimizer, values["lr"], values["wd"], values["last_layer_lr"])
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(v3.seed(it))  # the same RoPE rescale draws as the official step
        loss, step_logs = task(dict(v3.batch(it, order), n_images=v3.BATCH), values)
        loss.backward()
        norms = [math.sqrt(float(local_grad_sq(g))) for g in groups]
        clip_groups_(groups, norms, o.clip_grad)
        logs["clipped_norm"].append([grad_norm64(task.student[k]) for k in CLIPPED])  # what the optimizer gets
        optimizer.step()
        task.after_step(values)
        logs["loss"].append(float(loss.detach()))
        logs["gram_loss"].append(float(step_logs["gram_loss"]))
        logs["grad_norm"].append(norms)
        for k in keys:
            logs[k].append(values[k])
    arch = task.student["backbone"].arch_config()
    out = {}
    for who in ("student", "teacher"):
        group = getattr(task, who)
        sd = to_official_dinov3({k: v.detach() for k, v in group["backbone"].state_dict().items()}, arch)
        out.update({f"{who}/backbone.{k}": v for k, v in sd.items()})
        out.update({f"{who}/{part}.{n}": p.detach() for part in ("dino_head", "ibot_head")
                    for n, p in group[part].named_parameters()})
    return out, logs


@pytest.fixture(scope="module")
def measured_v3(official_v3) -> Measured:
    return measure(run_dinopipe_v3, official_v3, v3)


def test_two_dinov3_gram_steps_equal_the_official_code(official_v3, measured_v3):
    logs = measured_v3.logs
    for k in ("lr", "wd", "momentum", "teacher_temp", "last_layer_lr", "dino_local_weight"):
        assert logs[k] == pytest.approx(official_v3[f"log/{k}"].tolist(), rel=1e-12, abs=1e-15), k
    assert logs["last_layer_lr"][0] == 0 < logs["last_layer_lr"][1]  # frozen, then free
    assert_within_noise(official_v3, measured_v3, v3)


@pytest.mark.parametrize("switch", [{"model": {"rope_dtype": "fp32"}}, {"schedule_shape": "dinov2"},
                                    {"clip_per_module": False}], ids=str)
def test_each_dinov3_switch_leaves_the_official_step(official_v3, measured_v3, switch):
    """The DINOv3 test can fail: RoPE in float32 (the released models' setting, not the official trainer's bf16),
    DINOv2's sampling of the warm-ups, or one clip norm for the student each move what the test checks at least
    10x beyond what it allows, the bound measured here (:func:`measure`). Measured on AMD EPYC: the parameters
    34x, 17x and 2.6x (36000x, 18000x and 2300x the official noise alone -- the DINOv3 step's own noise under
    another CPU's kernels is large); the clip rule, nearly invisible in the parameters after AdamW, moves the
    per-module gradient norms after clipping 433x (:func:`clipped_over_noise`)."""
    ours, logs = run_dinopipe_v3(official_v3, **switch)
    worst = worst_over_noise(official_v3, ours, measured_v3, v3)
    clipped = clipped_over_noise(official_v3, logs, measured_v3)
    print(switch, f"worst student piece: {worst:.1f}x, clipped gradient norms: {clipped:.1f}x what the test allows")
    assert max(worst, clipped) > 10
