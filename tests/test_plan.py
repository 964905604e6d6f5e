"""The planner's numbers against the real thing: parameter / gradient / AdamW bytes of the built task, bytes
autograd actually saves (per block and for a whole SSL step), and forward FLOPs from torch's FLOP counter."""

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dinopipe.app.cli import main as cli_main
from dinopipe.config import load_config
from dinopipe.models import create_model
from dinopipe.plan import (GiB, block_saved_bytes, crop_forward_flops, describe, format_report, implied_mfu,
                           largest_batch, param_counts, plan, sharded_numel, state_memory, step_memory)
from dinopipe.ssl.config import PretrainConfig
from dinopipe.ssl.param_groups import build_param_groups
from dinopipe.ssl.task import SSLTask

REPO = Path(__file__).resolve().parents[1]
VITG = REPO / "configs/pretrain/vitg14_lvd142m.yaml"
TINY = [
    "model.name=vit_test", "model.img_size=56", "model.attn_backend=sdpa", "crops.local_crops_number=2",
    "dino.head.n_prototypes=128", "dino.head.hidden_dim=64", "dino.head.bottleneck_dim=32",
    "ibot.head.n_prototypes=96", "ibot.head.hidden_dim=48", "ibot.head.bottleneck_dim=16", "ibot.separate_head=true",
    "parallel.param_dtype=fp32",
    "phases=[{name: base, fraction: 1.0, global_crops_size: 56, local_crops_size: 28, batch_size_per_gpu: 4}]",
]


def tiny_cfg(*overrides):
    return load_config(PretrainConfig, REPO / "configs/pretrain/quickstart.yaml", [*TINY, *overrides])


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def saved_bytes(fn, exclude=()):
    """Bytes of the distinct storages autograd saves for backward while running fn (parameters excluded)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


# -- model state --------------------------------------------------------------------------------------


def test_parameter_gradient_and_adamw_bytes_equal_the_built_tiny_task():
    cfg = tiny_cfg()
    torch.manual_seed(0)
    task = SSLTask(cfg)
    arch, heads = describe(cfg)
    st = state_memory(arch, heads, 1, "fp32", "fp32")
    assert st["student_params"] == nbytes(task.student.parameters())
    assert st["teacher_params"] == nbytes(task.teacher.parameters())
    opt = torch.optim.AdamW(build_param_groups(task.student), lr=1e-3)
    loss = sum((p.float() ** 2).sum() for p in task.student.parameters())
    loss.backward()
    opt.step()
    assert st["student_grads"] == nbytes(p.grad for p in task.student.parameters())
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert len(opt.state) == len(list(task.student.parameters()))
    assert st["optimizer"] == nbytes(moments)


@pytest.mark.parametrize("config", ["vitg14_lvd142m.yaml", "vitl14_lvd142m.yaml"])
def test_parameter_bytes_equal_the_real_size_task_built_on_meta(config):
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain" / config)
    with torch.device("meta"):
        task = SSLTask(cfg)
    arch, heads = describe(cfg)
    st = state_memory(arch, heads, 1, "fp32", "fp32")
    assert st["student_params"] == nbytes(task.student.parameters())
    assert st["teacher_params"] == nbytes(task.teacher.parameters())
    if config.startswith("vitg"):  # DINOv2 ViT-g/14: 1.1B backbone; 131072 prototypes: DINO head (bottleneck 384)
        counts = param_counts(arch, heads)  # ~59M, iBOT head (bottleneck 256, vitg14.yaml) ~42M
        assert 1.13e9 < counts["backbone"] < 1.14e9
        assert 58e6 < counts["dino_head"] < 59e6
        assert 41e6 < counts["ibot_head"] < 42e6


def test_fsdp_shards_pad_dim0_and_divide_state():
    assert sharded_numel((10, 3), 4) == 9 and sharded_numel((8,), 4) == 2 and sharded_numel((5, 2), 1) == 10
    cfg = load_config(PretrainConfig, VITG)
    arch, heads = describe(cfg)
    one, many = state_memory(arch, heads, 1, "bf16", "fp32"), state_memory(arch, heads, 256, "bf16", "fp32")
    # (1, N, D) tokens / position embeddings have one row: FSDP2 pads it, so every rank holds all of it.
    assert one["student_params"] / 256 < many["student_params"] < 1.1 * one["student_params"] / 256
    assert many["unsharded_units"] > 0 == one["unsharded_units"]


# -- FLOPs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kw", [("vit_test", {}), ("vit_s14", {}),
                                     ("vit_test", {"ffn": "swiglu", "patch_size": 16, "num_register_tokens": 4})])
def test_forward_flops_match_torch_flop_counter(name, kw):
    # FlopCounterMode does not count SDPA on CPU (checked: 0 FLOPs), so count the math backend's matmuls.
    torch.manual_seed(0)
    model = create_model(name, img_size=224, attn_backend="math", **kw).eval()
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    cfg = load_config(PretrainConfig, None, [f"model.name={name}", "model.attn_backend=math"]
                      + [f"model.{k}={v}" for k, v in kw.items()])
    arch, _ = describe(cfg)
    assert crop_forward_flops(arch, 224) == pytest.approx(fc.get_total_flops(), rel=0.02)


def test_drop_path_saving_and_vitg_forward_flops():
    arch, _ = describe(load_config(PretrainConfig, VITG))
    full = crop_forward_flops(arch, 224, None, 24)
    dropped = crop_forward_flops(arch, 224, arch.drop_rates, 24)  # uniform 0.4: 14 of 24 samples run
    assert dropped / full == pytest.approx(14 / 24, abs=0.01)
    # 24·N·d² per block (SwiGLU sized to match) + 4·N²·d attention, N = 257 tokens, d = 1536, 40 blocks.
    n, d = 257, 1536
    assert crop_forward_flops(arch, 224) == pytest.approx(40 * (24 * n * d * d + 4 * n * n * d), rel=0.01)


# -- activations ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_scale", ["null", "1e-5"])
@pytest.mark.parametrize("attn", ["sdpa", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rate,groups", [(0.0, [(4, 17)]), (0.0, [(4, 17), (8, 5)]), (0.4, [(4, 17), (8, 5)]),
                                         (0.05, [(6, 17)])])
def test_block_activation_bytes_equal_what_autograd_saves(attn, dtype, rate, groups, layer_scale):
    cfg = tiny_cfg(f"model.attn_backend={attn}", f"model.drop_path_rate={rate}", "model.drop_path_uniform=true",
                   f"model.init_values={layer_scale}")
    arch, _ = describe(cfg)
    assert arch.layer_scale == (layer_scale != "null")
    torch.manual_seed(0)
    blk = create_model("vit_test", attn_backend=attn, drop_path_rate=rate, drop_path_uniform=True,
                       init_values=cfg.model.init_values).blocks[0]
    blk = blk.train().to(dtype)
    xs = [torch.randn(b, n, arch.dim, dtype=dtype, requires_grad=True) for b, n in groups]
    measured, _ = saved_bytes(lambda: blk(xs), exclude=list(blk.parameters()))
    c = torch.finfo(dtype).bits // 8
    # CPU LayerNorm keeps mean/rstd in the input dtype; CUDA (the planner's default) keeps them in fp32.
    expected = block_saved_bytes(arch, groups, c, "math" if attn == "math" else "fused", rate, stat_bytes=c)
    assert measured == expected


def test_whole_step_activation_bytes_match_what_autograd_saves():
    """Student backbone + heads + losses of a real SSLTask step (teacher targets included) vs the plan."""
    from dinopipe.data.transforms import MultiCropCollator

    cfg = tiny_cfg("model.drop_path_rate=0.3", "model.drop_path_uniform=true")
    torch.manual_seed(0)
    task = SSLTask(cfg)
    samples = [{"global_crops": [torch.randn(3, 56, 56) for _ in range(2)],
                "local_crops": [torch.randn(3, 28, 28) for _ in range(2)]} for _ in range(4)]
    batch = MultiCropCollator(14, seed=0)(samples)
    values = {"teacher_temp": 0.04}
    measured, (loss, logs) = saved_bytes(lambda: task(batch, values), exclude=list(task.parameters()))
    arch, heads = describe(cfg)
    sm = step_memory(cfg, arch, heads, cfg.phases[0], 4, 4, "fused", False, n_masked=logs["n_masked"])
    expected = sm["backbone_activations"] + sm["head_activations"] + sm["teacher_targets"]
    assert logs["n_masked"] > 0
    assert measured == pytest.approx(expected, rel=0.03)


def test_activation_checkpointing_and_fused_attention_save_memory():
    cfg = load_config(PretrainConfig, VITG)
    r = plan(cfg, 256, 80)
    for ph in r["phases"]:
        m = ph["memory"]
        assert m["fused_ac"]["per_image"] < m["fused_noac"]["per_image"] / 5
        assert m["fused_noac"]["peak"] < m["math_noac"]["peak"]
        assert m["fused_ac"]["max_batch"] > m["fused_noac"]["max_batch"] > 0


def test_largest_batch_is_monotone_in_gpu_memory():
    cfg = load_config(PretrainConfig, VITG)
    arch, heads = describe(cfg)
    found = []
    for g in (8, 16, 24, 40, 80, 141):
        found.append(largest_batch(lambda b: step_memory(cfg, arch, heads, cfg.phases[0], b, 2, "fused", False)["peak"],
                                   g))
    assert found == sorted(found) and found[0] < found[-1]
    # and the batch it returns is the largest that fits
    def need(b):
        return step_memory(cfg, arch, heads, cfg.phases[0], b, 2, "fused", False)["peak"]

    b = largest_batch(need, 40)
    assert need(b) <= 40 * GiB < need(b + 1)



def test_accumulation_holds_one_micro_batch_of_activations_and_all_targets():
    """train.accumulate=K at micro-batch b: the student's activations are those of b (not K b), the teacher
    targets of all K micro-batches are held, and the plan's total grows with K only by those targets."""
    cfg = load_config(PretrainConfig, VITG)
    arch, heads = describe(cfg)
    ph = cfg.phases[0]

    def mem(k, b):
        cfg.train.accumulate = k
        return step_memory(cfg, arch, heads, ph, b, 2, "fused", True, n_masked=100 * b)

    one, four, big = mem(1, 12), mem(4, 12), mem(1, 48)
    assert four["backbone_activations"] == one["backbone_activations"]
    assert four["teacher_targets"] == 4 * one["teacher_targets"]
    assert one["peak"] < four["peak"] < big["peak"]

# -- the recipe and the command ---------------------------------------------------------------------


def test_vitg14_recipe_prints_sane_numbers(capsys):
    assert cli_main(["plan", "--config", str(VITG), "--gpus", "256", "--gpu-mem-gb", "80", "--gpu-tflops", "312",
                     "--mfu", "0.4"]) == 0
    out = capsys.readouterr().out
    assert "phase base_224" in out and "phase highres_518" in out and "GPU-hours" in out
    cfg = load_config(PretrainConfig, VITG, ["phases=[{name: base, fraction: 1.0, batch_size_per_gpu: 12}]"])
    r = plan(cfg, 256, 80, 312, 0.4)
    ph = r["phases"][0]
    assert ph["global_batch"] == 3072 and r["total_steps"] == 625_000
    # DINOv2 trained this in 22,016 A100-hours: the implied MFU must be a plausible one.
    assert 0.25 < implied_mfu(r["total_flops"], 22_016, 312) < 0.6
    assert ph["memory"]["fused_noac"]["max_batch"] >= 12  # the paper's 12 images per GPU fit in 80 GB
    assert 4e12 < ph["flops"]["model"] / 12 < 6e12  # ~5 TFLOP per image per step
    assert format_report(r).count("\n") > 10


def test_plan_command_rejects_a_bad_config_key(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["plan", "--config", str(VITG), "--gpus", "8", "--gpu-mem-gb", "80", "model.nmae=vit_l14"])
    assert exc.value.code == 2
    assert "nmae" in capsys.readouterr().err
