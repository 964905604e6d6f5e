"""Config spine: defaults <- YAML <- overrides; mistakes name the key and where it came from, exit 2."""

import re
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from omegaconf import OmegaConf

from dinopipe.config import ConfigError, ModelConfig, load_config, save_config


@dataclass
class Train:
    batch_size: int = 32
    lr: float = 1e-3


@dataclass
class Schema:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: Train = field(default_factory=Train)


def write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_merge_order_defaults_file_overrides(tmp_path):
    p = write(tmp_path, "train:\n  batch_size: 64\n  lr: 0.5\nmodel:\n  name: vit_s14\n")
    cfg = load_config(Schema, p, ["train.lr=0.25"])
    assert cfg.train.batch_size == 64  # from the file
    assert cfg.train.lr == 0.25  # override beats file
    assert cfg.model.name == "vit_s14"
    assert cfg.model.attn_backend == "auto"  # default kept


def test_unknown_key_in_file_names_key_and_file(tmp_path):
    p = write(tmp_path, "train:\n  batch_sise: 64\n")
    with pytest.raises(ConfigError) as e:
        load_config(Schema, p)
    assert "batch_sise" in str(e.value) and str(p) in str(e.value)


def test_wrong_type_in_override_names_override():
    with pytest.raises(ConfigError) as e:
        load_config(Schema, None, ["train.batch_size=sixty"])
    msg = str(e.value)
    assert "train.batch_size=sixty" in msg and "batch_size" in msg


def test_unknown_override_key():
    with pytest.raises(ConfigError, match="optim"):
        load_config(Schema, None, ["optim.lr=1"])


def test_override_without_equals_is_explained():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(Schema, None, ["train.lr"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Schema, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="YAML"):
        load_config(Schema, write(tmp_path, "train: [unclosed\n"))


def test_resolved_config_saved_and_reloadable(tmp_path):
    cfg = load_config(Schema, None, ["train.batch_size=7"])
    out = save_config(cfg, tmp_path / "run")
    again = load_config(Schema, out)
    assert again == cfg
    assert again.train.batch_size == 7


def test_cli_exits_2_with_one_line_naming_the_key(tmp_path):
    p = write(tmp_path, "drop_path_rat: 0.4\n")
    r = subprocess.run([sys.executable, "-m", "dinopipe.app.cli", "config", "--kind", "model", "--config", str(p)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "drop_path_rat" in lines[0] and str(p) in lines[0]


def test_cli_prints_resolved_config():
    r = subprocess.run([sys.executable, "-m", "dinopipe.app.cli", "config", "--kind", "model", "name=vit_b14"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert OmegaConf.create(r.stdout).name == "vit_b14"


def test_override_value_that_is_not_yaml_names_the_override():
    # A nested flow mapping without spaces after the colons is a YAML scanner error, not an omegaconf one.
    for bad in ("train={lr:{a:1}}", "train.lr=[unclosed"):
        with pytest.raises(ConfigError, match="override '" + re.escape(bad) + "'.*YAML"):
            load_config(Schema, None, [bad])
