"""The traced dry run (``dinopipe plan --trace``): the real SSLTask step (student + heads, EMA teacher, losses,
FSDP2 as configured) run as rank 0 of W ranks in one process under fake tensors and torch's fake process
group. Pins the trace to a real 2-rank gloo run of the same step, the analytic planner to the trace's peak
memory (within 10%) for vit_s14 and vit_l14 at W = 8 and with ``train.accumulate``, and checks the collectives
FSDP2 issues per step against the model's own sizes. Fake tensors cost no compute, so this runs in CI at the
recipes' real widths."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dinopipe.config import load_config
from dinopipe.plan import describe
from dinopipe.plan.trace import trace
from dinopipe.ssl.config import PretrainConfig

# The recipes' parallel settings (bf16 FSDP2 mixed precision, fp32 reduce, activation checkpointing).
RECIPE = ["data.paths=[x]", "parallel.param_dtype=bf16", "parallel.reduce_dtype=fp32",
          "parallel.activation_checkpointing=true", "parallel.compile=true"]
PHASE = "phases=[{{name: base, fraction: 1.0, global_crops_size: 224, local_crops_size: 98, batch_size_per_gpu: {b}}}]"


def _cfg(model: str, b: int):
    return load_config(PretrainConfig, None, [*RECIPE, f"model.name={model}", PHASE.format(b=b)])


# planner / trace measured (torch 2.14.1): vit_s14 b=64 1.012, vit_l14 b=16 1.047 (docs/training-scale.md).
@pytest.mark.slow
@pytest.mark.parametrize("model,b,tol", [("vit_s14", 64, 0.10), ("vit_l14", 16, 0.10)])
def test_planner_peak_memory_agrees_with_the_traced_real_step(model, b, tol):
    cfg = _cfg(model, b)
    t = trace(cfg, world_size=8, steps=2, comm_debug=False)
    assert t.world_size == 8 and t.batch_per_rank == b
    assert 1 - tol <= t.planner_ratio <= 1 + tol, t.report()
    # FSDP2 gathers every parameter of the student (forward + AC recompute in backward) and the teacher once per
    # step, in bf16; it reduce-scatters the student's gradients once, in fp32 (reduce_dtype).
    arch, heads = describe(cfg)
    student = sum(arch.block_params) + arch.root_params + sum(h.params for h in heads)
    gathered = t.collective_bytes_per_step["all_gather"]
    assert 2 * student * 2 <= gathered <= 4 * student * 2 * 1.01, t.report()
    scattered = t.collective_bytes_per_step["reduce_scatter"]
    assert scattered == pytest.approx(4 * student, rel=0.03), t.report()  # + FSDP2 padding to W rows


@pytest.mark.slow
def test_trace_peak_equals_a_real_two_rank_gloo_run(tmp_path):
    """The same step really run by 2 gloo ranks (real tensors, FSDPMemTracker in real mode) peaks where the trace
    says (the trace once also counted DTensor sharding propagation's global-shape fake tensors: the full size of
    every parameter in the foreach AdamW ops, a batch-independent term of GiBs at W=256)."""
    overrides = [*RECIPE, "parallel.compile=false", "model.name=vit_test", "dino.head.n_prototypes=1024",
                 "dino.head.hidden_dim=256", "dino.head.bottleneck_dim=64", PHASE.format(b=2)]
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "real.json"
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    str(repo / "tests" / "train" / "_trace_real_worker.py"), str(out), *overrides],
                   check=True, env=env, capture_output=True, timeout=600)
    real = json.loads(out.read_text())["peak"]
    traced = trace(load_config(PretrainConfig, None, overrides), world_size=2, steps=2, comm_debug=False)
    assert traced.peak_bytes == pytest.approx(real, rel=0.01), (real, traced.report())


@pytest.mark.slow
def test_trace_and_planner_know_gradient_accumulation():
    """train.accumulate=K: one micro-batch's activations, the teacher targets of all K (computed first, over
    their union), gradients held across micro-batches. The trace runs the K micro-batches; the planner agrees."""
    def cfg(k):
        return load_config(PretrainConfig, None, [*RECIPE, "model.name=vit_s14", PHASE.format(b=8),
                                                  f"train.accumulate={k}"])

    one, two = (trace(cfg(k), world_size=8, steps=2, comm_debug=False) for k in (1, 2))
    assert two.accumulate == 2 and two.batch_per_rank == 8
    assert one.peak_bytes < two.peak_bytes, (one.report(), two.report())  # the targets of both micro-batches
    for t in (one, two):
        assert 0.9 <= t.planner_ratio <= 1.1, t.report()
    # both micro-batches reduce-scatter their gradients into the sharded ones
    assert two.collective_calls_per_step["reduce_scatter"] == 2 * one.collective_calls_per_step["reduce_scatter"]


@pytest.mark.slow
def test_planner_agrees_where_the_peak_is_the_gram_teachers_forward():
    """DINOv3 7B width (4096, SwiGLU, RoPE, 262k-prototype heads) with 2 blocks, Gram teacher on 512 px crops, 16
    images per rank, W = 8: the peak falls inside the Gram teacher's no-grad forward, after the student's forward,
    with one Gram block gathered. FSDP2 holds that block twice there (its unsharded parameters and its all-gather
    output, whose free it defers in forward), which the planner counts, along with the block's per-op working set
    (RoPE temporaries, SwiGLU hidden) and the batch; the Gram loss's own tensors do not exist yet."""
    cfg = load_config(PretrainConfig, Path(__file__).resolve().parents[1] / "configs/pretrain/vit7b16_dinov3.yaml",
                      ["model.depth=2", "data.paths=[x]"])
    t = trace(cfg, world_size=8, steps=2, phase="gram_256", comm_debug=False)
    arch, _ = describe(cfg)
    block_bf16 = arch.block_params[0] * 2
    by = {k.rsplit(".", 1)[-1]: v for k, v in t.peak_by_category.items()}
    assert by["UNSHARDED_PARAM"] == pytest.approx(block_bf16, rel=0.01), t.report()
    assert by["ALL_GATHER"] == pytest.approx(block_bf16, rel=0.01), t.report()
    assert by["REDUCE_SCATTER"] == 0 and by["TEMP"] == 0, t.report()  # in forward, not backward
    assert 0.9 <= t.planner_ratio <= 1.1, t.report()
