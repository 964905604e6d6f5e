"""String choices are enums: a bad value is rejected while merging (exit 2 naming the key and the allowed values,
nothing written), lowercase strings still work everywhere, and the saved config shows plain strings."""

import pickle
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from curation.config import CurationConfig, IndexKind, KMeansInit, RebalanceMode
from dinopipe.config import AttnBackend, FFN, ConfigError, check_choices, load_config, save_config
from dinopipe.ssl.config import PretrainConfig
from dinopipe.ssl.distill_config import DistillConfig

REPO = Path(__file__).resolve().parents[1]


def test_config_enums_match_the_code_that_uses_them():
    import curation.config as cc
    from curation.kmeans import hierarchical
    from curation.knn import index
    from curation.rebalance import modes
    from dinopipe.models.attention import BACKENDS
    from dinopipe.models.registry import FFN_LAYERS

    assert [m.value for m in AttnBackend] == list(BACKENDS)
    assert {m.value for m in FFN} == set(FFN_LAYERS)
    # curation's lists live in its config (which imports no step); the engines read that one list
    assert index.KINDS is cc.KINDS and modes.MODES is cc.MODES and hierarchical.INITS is cc.INITS
    assert [m.value for m in IndexKind] == list(cc.KINDS)
    assert [m.value for m in RebalanceMode] == list(cc.MODES)
    assert [m.value for m in KMeansInit] == list(cc.INITS)


@pytest.mark.parametrize("schema, override, allowed", [
    (PretrainConfig, "teacher.centering=center", "centering, sinkhorn_knopp"),
    (PretrainConfig, "model.attn_backend=flash", "auto, sdpa, xformers, math"),
    (PretrainConfig, "train.device=gpu", "auto, cpu, cuda"),
    (DistillConfig, "mode=kd", "auto, ssl, feature"),
    (DistillConfig, "feature.loss=l2", "cosine, smooth_l1"),
    (CurationConfig, "rebalance.mode=random", "none, sample, cluster, hierarchical"),
    (CurationConfig, "dedup.index=hnsw", "auto, flat, ivf, ivf_sq8, ivf_pq"),
])
def test_bad_choice_names_the_key_and_the_allowed_values(schema, override, allowed):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        load_config(schema, None, [override])
    msg = str(e.value)
    assert f"key '{key}'" in msg and f"'{value}'" in msg and allowed in msg, msg


def test_bad_choice_in_a_yaml_file_names_the_file_and_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rebalance:\n  mode: clusters\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: key 'rebalance\.mode': .*'clusters'.*hierarchical"):
        load_config(CurationConfig, p)


def test_lowercase_strings_work_and_the_saved_config_shows_them(tmp_path):
    cfg = load_config(CurationConfig, None, ["rebalance.mode=hierarchical", "rebalance.kmeans_init=kmeans++",
                                             "dedup.index=ivf_pq"])
    m = cfg.rebalance.mode
    assert m is RebalanceMode.hierarchical and m == "hierarchical" and m != "none"
    assert m in ("sample", "hierarchical") and {"hierarchical": 1}[m] == 1  # equal and same hash as the string
    assert f"{m}" == str(m) == "hierarchical" and f"{cfg.dedup.index:>7}" == " ivf_pq"
    assert pickle.loads(pickle.dumps(cfg.rebalance.kmeans_init)) is KMeansInit["kmeans++"]  # DataLoader workers
    text = save_config(cfg, tmp_path).read_text()
    assert "mode: hierarchical\n" in text and "kmeans_init: kmeans++\n" in text and "Rebalance" not in text
    again = load_config(CurationConfig, tmp_path / "config.yaml")  # the saved config loads back as it was
    assert OmegaConf.to_yaml(OmegaConf.structured(again)) == OmegaConf.to_yaml(OmegaConf.structured(cfg))


def test_model_code_gets_plain_strings():
    kw = load_config(PretrainConfig, None, ["model.attn_backend=sdpa", "model.ffn=swiglu"]).model.create_kwargs()
    assert type(kw["attn_backend"]) is str and type(kw["ffn"]) is str and kw["ffn"] == "swiglu"


def test_a_config_built_in_python_is_checked_too():
    cfg = DistillConfig()
    cfg.mode = "feature"  # a plain string becomes the member
    check_choices(cfg)
    assert cfg.mode is type(DistillConfig().mode).feature
    cfg.students[0].model.attn_backend = "flash"  # inside a list of sections
    with pytest.raises(ConfigError, match=r"key 'students\.0\.model\.attn_backend': invalid value 'flash'"):
        check_choices(cfg)


@pytest.mark.parametrize("stage", ["pretrain", "curate"])
def test_bad_choice_on_the_command_line_exits_2_before_writing(tmp_path, capsys, stage):
    from dinopipe.app.cli import main

    out = tmp_path / "out"
    pool = tmp_path / "pool"
    pool.mkdir()
    if stage == "pretrain":
        argv = ["pretrain", "--config", str(REPO / "configs/pretrain/quickstart.yaml"), f"data.paths=[{pool}]",
                f"train.output_dir={out}", "teacher.centering=sinkhorn"]
        key = "teacher.centering"
    else:
        argv = ["curate", "run", "--config", str(REPO / "configs/curation/quickstart.yaml"),
                f"input.paths=[{pool}]", f"output.dir={out}", "dedup.grouping=chain"]
        key = "dedup.grouping"
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"key '{key}'" in err and "expected one of" in err, err
    assert not out.exists()


@pytest.mark.parametrize("override, key", [
    ("train.log_every=0", "train.log_every"),  # the loop's `step % log_every` would divide by zero mid-run
    ("train.epoch_length=0", "train.epoch_length"),
    ("crops.local_crops_scale=[0.5,0.1]", "crops.local_crops_scale"),
    ("teacher.teacher_temp=0", "teacher.teacher_temp"),
    ("ibot.mask_sample_probability=1.5", "ibot.mask_sample_probability"),
    ("phases=[{name: a, fraction: 0.0}, {name: b, fraction: 1.0}]", "phases.0.fraction"),
    ("phases=[{name: a, fraction: 1.0, global_crops_size: 60}]", "phases.0.global_crops_size"),  # vit_test: 14 px
    ("model.name=vit_tset", "model.name"),
])
def test_pretrain_value_mistakes_exit_2_naming_the_key_before_writing(tmp_path, capsys, override, key):
    from dinopipe.train.pretrain import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["--config", str(REPO / "configs/pretrain/quickstart.yaml"), f"data.paths=[{tmp_path}]",
              f"train.output_dir={out}", "model.name=vit_test", override])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"config error: {key}" in err, err
    assert not out.exists()


def test_pipeline_checks_every_stage_config_before_running_any(tmp_path, capsys):
    """A bad choice in `pretrain.overrides` exits 2 at once, not after curation ran for minutes."""
    from dinopipe.app.cli import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["pipeline", "--config", str(REPO / "configs/pipeline/quickstart.yaml"), f"output_dir={out}",
              "pretrain.overrides=[teacher.centering=sk]"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "pretrain: override 'teacher.centering=sk': key 'teacher.centering'" in err, err
    assert not out.exists()
