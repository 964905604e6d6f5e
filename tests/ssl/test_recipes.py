"""The recipe configs equal the official YAMLs, key by key.

``tests/fixtures/official_recipes.json`` records, for every recipe key dinopipe mirrors, the official value and
the file it comes from (made once by ``tests/fixtures/make_official_recipes.py`` from facebookresearch/dinov2 and
facebookresearch/dinov3 checkouts; rows marked ``code`` name the code line that fixes the value). Each config is
loaded as a run would load it (schema defaults included). A value may differ from the official one only when it is
listed below as a deliberate difference, with its reason, and a listed difference must really differ, so the
list cannot go stale. Every key a recipe YAML sets is either compared or listed as dinopipe's own (paths,
sharding, checkpoint cadence).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dinopipe.config import load_config
from dinopipe.models.registry import model_defaults
from dinopipe.ssl.config import PretrainConfig

ROOT = Path(__file__).resolve().parents[2]
ROWS = json.loads((ROOT / "tests/fixtures/official_recipes.json").read_text())
CONFIGS = sorted({r["config"] for r in ROWS})

DELIBERATE = {
    # DINOv3: the 7B's SSL recipe applied to a ViT-L, shortened to a run one team can afford.
    ("configs/pretrain/vitl16_dinov3.yaml", "train.epochs"): "300 epochs, not the 7B's 1200 (budget)",
    ("configs/pretrain/vitl16_dinov3.yaml", "phases.0.fraction"):
        "the Gram stage starts at epoch 200 of 300, not at 1000 of 1200",
    ("configs/pretrain/vitl16_dinov3.yaml", "gram.first_step"): "Gram from step 200k of the 300k-step run, not 1.01M",
    ("configs/pretrain/vitl16_dinov3.yaml", "dino.local_loss_weight_schedule.warmup_epochs"):
        "the local-crop weight drops as this run's Gram stage starts (epoch 200, not 1000)",
}
"""(config, key) -> why it differs from the official value."""

DINOPIPE_ONLY = {
    "data.paths": "where the curated shards are", "data.num_workers": "loader workers",
    "train.output_dir": "run directory", "train.checkpoint_every": "checkpoint cadence",
    "train.keep_last": "checkpoints kept", "parallel.param_dtype": "FSDP2 mixed precision (DINOv2: fp16/bf16 FSDP1)",
    "parallel.reduce_dtype": "FSDP2 gradient reduction dtype", "parallel.activation_checkpointing": "memory",
    "parallel.head_reduce_dtype": "FSDP2 gradient reduction dtype of the heads (DINOv2: fp32)",
    "parallel.compile": "speed", "model.img_size": "position-embedding grid (the official code uses the global crop size)",
    "phases.0.name": "a label", "phases.0.fraction": "the single 224 px stage",
    "phases.1.name": "a label", "phases.1.fraction": "DINOv3: the Gram stage's share (gram.first_step)",
    "phases.1": "DINOv2 recipes: the 518 px stage",
    "model.name": "(compared where the official YAML names it)",
    "model.pretrained": "the base run to adapt (DINOv3's high-res stage: its resumed checkpoint)",
    "model.drop_path_uniform": "DINOv3 has no such key: every block drops at drop_path_rate",
}


def leaf_keys(d, prefix=""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from leaf_keys(v, f"{prefix}{k}.")
    elif isinstance(d, list) and d and isinstance(d[0], dict):
        for i, v in enumerate(d):
            yield from leaf_keys(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1]


def effective(cfg: PretrainConfig, key: str):
    """The value a run uses: registry defaults fill the model keys the YAML leaves null."""
    obj = cfg
    for part in key.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    if obj is None and key.startswith("model."):
        obj = model_defaults(cfg.model.name).get(key.split(".", 1)[1])
    if hasattr(obj, "value"):  # a Choice
        obj = obj.value
    return list(obj) if isinstance(obj, (list, tuple)) else obj


@pytest.mark.parametrize("config", CONFIGS)
def test_recipe_equals_the_official_yaml(config):
    cfg = load_config(PretrainConfig, str(ROOT / config), [])
    rows = [r for r in ROWS if r["config"] == config]
    mismatched = {r["key"]: (effective(cfg, r["key"]), r["value"], r["official_file"]) for r in rows
                  if effective(cfg, r["key"]) != pytest.approx(r["value"])}
    listed = {k for c, k in DELIBERATE if c == config}
    unexplained = {k: v for k, v in mismatched.items() if k not in listed}
    assert not unexplained, f"{config}: values that differ from the official recipe (ours, official, file): " \
        f"{unexplained}"
    stale = listed - set(mismatched)
    assert not stale, f"{config}: listed as deliberate differences but equal to the official value: {stale}"
    compared = {r["key"] for r in rows}
    written = set(leaf_keys(yaml.safe_load((ROOT / config).read_text())))
    uncovered = {k for k in written - compared
                 if not any(k == o or k.startswith(o + ".") for o in DINOPIPE_ONLY)}
    assert not uncovered, f"{config}: keys neither compared with the official recipe nor dinopipe's own: {uncovered}"
