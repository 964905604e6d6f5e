"""`dinopipe plan` on DINOv3 backbones: storage tokens counted as tokens, RoPE's tables in the activation
bytes (checked against what autograd saves), FLOPs against torch's counter, released sizes on the meta device."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dinopipe.app.cli import main as cli_main
from dinopipe.config import load_config
from dinopipe.models import create_model
from dinopipe.plan import block_saved_bytes, crop_forward_flops, describe, param_counts, rope_table_bytes, tokens
from dinopipe.ssl.config import PretrainConfig

from tests.test_plan import VITG, saved_bytes


def arch_of(*overrides):
    return describe(load_config(PretrainConfig, None, list(overrides)))[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attn", ["sdpa", "math"])
def test_block_activation_bytes_with_rope_equal_what_autograd_saves(attn, dtype):
    arch = arch_of("model.name=vit_test_dinov3", f"model.attn_backend={attn}", "model.init_values=1e-5")
    assert arch.rope and arch.num_register_tokens == 4
    torch.manual_seed(0)
    model = create_model("vit_test_dinov3", attn_backend=attn).train().to(dtype)
    grids = [(4, (4, 4)), (8, (2, 3))]  # a global and a local crop group
    groups = [(b, 1 + 4 + h * w) for b, (h, w) in grids]
    assert groups[0][1] == tokens(arch, 64)  # class + 4 storage tokens + patches, no position slot
    ropes = [model.rope_embed(h, w) for _, (h, w) in grids]
    xs = [torch.randn(b, n, arch.dim, dtype=dtype, requires_grad=True) for b, n in groups]
    blk = model.blocks[0]
    measured, _ = saved_bytes(lambda: blk(xs, rope=ropes), exclude=list(blk.parameters()))
    c = torch.finfo(dtype).bits // 8
    expected = block_saved_bytes(arch, groups, c, "math" if attn == "math" else "fused", stat_bytes=c)
    # the fp32 (sin, cos) tables: 2 x patches x head_dim x 4 bytes per group, shared by all blocks
    assert rope_table_bytes(arch, groups) == 2 * (16 + 6) * 32 * 4
    assert measured == expected + rope_table_bytes(arch, groups)


def test_forward_flops_match_torch_flop_counter():
    model = create_model("vit_test_dinov3", attn_backend="math").eval()
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    assert crop_forward_flops(arch_of("model.name=vit_test_dinov3"), 224) == pytest.approx(fc.get_total_flops(), rel=0.02)


def test_plan_command_on_a_released_dinov3_size(capsys):
    arch = arch_of("model.name=vit_7b16_dinov3")
    assert param_counts(arch, [])["backbone"] == 6_716_043_264 and tokens(arch, 256) == 1 + 4 + 256
    # the ViT-g/14 recipe's crops made multiples of 16 (plan runs pretrain's config checks: 98 px is refused)
    assert cli_main(["plan", "--gpus", "8", "--gpu-mem-gb", "80", "--config", str(VITG), "model.name=vit_l16_dinov3",
                     "phases=[{name: base_224, fraction: 0.984, global_crops_size: 224, local_crops_size: 96, "
                     "batch_size_per_gpu: 12}, {name: highres_512, fraction: 0.016, global_crops_size: 512, "
                     "local_crops_size: 96, batch_size_per_gpu: 4, lr_scale: 0.25, warmup_fraction: 0.1}]"]) == 0
    out = capsys.readouterr().out
    assert "backbone 303.2M" in out and "224 px (201 tokens)" in out
