"""Gradients reduced in 16 bits (issue 29): the backbone's reduce-scatter in bf16 and the heads' in fp32, as
DINOv2's config does, against all-fp32 reduction, on 2 gloo ranks for 20 steps of the tiny pretraining run
(bf16 compute, as the recipes). Measured (torch 2.14.1, this test's settings): largest per-step loss difference
0.23% (all-bf16 reduction 0.59%; fp32 instead of bf16 *compute* 1.09%); the exported teachers differ by 3.0% of
the distance the teacher moved from its init over the run (all-bf16 4.0%; fp32 compute 5.8%). The recipes'
defaults (configs/pretrain/*.yaml: reduce_dtype bf16, head_reduce_dtype fp32) rest on this."""

import json

import pytest
import torch
from safetensors.torch import load_file

from dinopipe.config import load_config
from dinopipe.ssl.config import PretrainConfig
from dinopipe.ssl.task import SSLTask
from tests.train.conftest import run_pretrain

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = ["train.epochs=5", "train.checkpoint_every=1000", "parallel.param_dtype=bf16"]  # 5 x 4 = 20 steps


def _losses(run):
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _teacher(run):
    d = run / "export" / "teacher"
    return {f"{f.stem}.{k}": v.float() for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}


def _init_teacher(run):
    cfg = load_config(PretrainConfig, run / "config.yaml", [])
    torch.manual_seed(cfg.train.seed)  # the initial weights of the 2-rank build are those of one process
    t = SSLTask(cfg).teacher
    out = {f"model.{k}": v for k, v in t["backbone"].state_dict().items()}
    out.update({f"heads.{n}.{k}": v for n, m in t.items() if n != "backbone" for k, v in m.state_dict().items()})
    return out


def _dist(a, b, keys):
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in keys) ** 0.5)


def test_bf16_backbone_reduction_stays_within_tolerance_of_fp32(tmp_path, photo_pool):
    ref, half = tmp_path / "fp32", tmp_path / "bf16"
    run_pretrain(ref, photo_pool, *STEPS, "parallel.reduce_dtype=fp32", "parallel.head_reduce_dtype=null", nproc=2)
    run_pretrain(half, photo_pool, *STEPS, "parallel.reduce_dtype=bf16", "parallel.head_reduce_dtype=fp32", nproc=2)
    a, b = _losses(ref), _losses(half)
    assert sorted(a) == sorted(b) == list(range(20))
    rel = [abs(a[s] - b[s]) / abs(a[s]) for s in a]
    assert max(rel) < 0.01, rel  # tolerance 1% per step (measured 0.23%)
    assert max(rel) > 0, "the reduce dtype changed nothing: was the option applied?"
    ta, tb, t0 = _teacher(ref), _teacher(half), _init_teacher(ref)
    keys = sorted(ta)
    assert keys == sorted(tb) and set(keys) <= set(t0)
    moved = _dist(ta, t0, keys)
    assert _dist(ta, tb, keys) < 0.10 * moved, (_dist(ta, tb, keys), moved)  # tolerance 10% (measured 3.0%)
