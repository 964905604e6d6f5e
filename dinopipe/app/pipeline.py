"""dinopipe pipeline --config configs/pipeline/quickstart.yaml [key=value ...]: curate -> pretrain ->
distill -> eval -> report, each stage skipped when its outputs are already complete, so rerunning after a
crash continues where it stopped. With sample.enabled it first builds its own pool from photos shipped in
pip packages (planted near-duplicates, corrupt files, a seed set and a held-out labelled eval set);
otherwise it runs on input.paths and the labelled input.eval_train / input.eval_val folders.

Every stage's config (its YAML and the overrides given here) and every input path is checked before the
first stage starts. Every key and its default: dinopipe config --kind pipeline (and --kind curation,
pretrain, distill for each stage's own keys). Exit codes: 0 done, 2 a mistake in the config or the input,
3 the loss became NaN/inf, 124 preempted (rerun to resume), 1 a bug to report.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..config import ConfigError, save_config
from ..utils.run_layout import TrainLayout


@dataclass
class StageConfig:
    config: str = ""
    """The stage's own YAML (configs/curation|pretrain|distill/...)."""
    overrides: list[str] = field(default_factory=list)
    """key=value overrides for that stage; the pipeline adds the paths that chain the stages."""


@dataclass
class SampleConfig:
    enabled: bool = True
    """true: build a sample pool and labelled eval set from photos shipped in pip packages; false: use input.*."""
    n_images: int = 1500
    """Views of the real photos in the pool (before planted copies and corrupt files)."""
    eval_train_per_class: int = 8
    """Sample eval set: gallery views per photo (class)."""
    eval_val_per_class: int = 4
    """Sample eval set: query views per photo (class)."""
    seed: int = 0
    """Seed of the sample pool's random views and planted duplicates."""


@dataclass
class InputConfig:
    paths: list[str] = field(default_factory=list)
    """Your pool (folders, file lists, shards) when sample.enabled is false."""
    eval_train: Optional[str] = None
    """Labelled folder (class = sub-folder) used as the kNN gallery."""
    eval_val: Optional[str] = None
    """Labelled folder of kNN queries (also decontaminated against)."""


@dataclass
class EvalConfig:
    enabled: bool = True
    """false: no kNN (neither the eval stage nor the teacher's kNN during pretraining)."""
    k: list[int] = field(default_factory=lambda: [10, 20])
    """Neighbour counts of the kNN table (the largest also serves the kNN during pretraining)."""
    img_size: Optional[int] = None
    """Eval resolution (default: what each model was built for)."""


@dataclass
class PipelineConfig:
    output_dir: str = "runs/pipeline"
    """Root of the pipeline's run: data/, curated/, pretrain/, distill/, eval_results.json, report/."""
    sample: SampleConfig = field(default_factory=SampleConfig)
    input: InputConfig = field(default_factory=InputConfig)
    curate: StageConfig = field(default_factory=lambda: StageConfig("configs/curation/quickstart.yaml"))
    pretrain: StageConfig = field(default_factory=lambda: StageConfig("configs/pretrain/quickstart.yaml"))
    distill: StageConfig = field(default_factory=lambda: StageConfig("configs/distill/quickstart.yaml"))
    eval: EvalConfig = field(default_factory=EvalConfig)
    stages: list[str] = field(default_factory=lambda: ["curate", "pretrain", "distill", "eval", "report"])
    """Stages to run, in order: curate, pretrain, distill, eval, report (a complete stage is skipped)."""


STAGES = ("curate", "pretrain", "distill", "eval", "report")


def validate(cfg: PipelineConfig) -> None:
    """Every mistake before any work: the pipeline's own keys, every input path, and each stage's config
    (YAML + overrides, merged and validated as the stage itself will), so nothing runs and nothing is written
    when one of them is wrong."""
    bad = [s for s in cfg.stages if s not in STAGES]
    if bad:
        raise ConfigError(f"stages: unknown {bad}; choose from {list(STAGES)}")
    if not cfg.sample.enabled:
        if not cfg.input.paths:
            raise ConfigError("input.paths: give your images, or set sample.enabled=true")
        for key, paths in (("input.paths", cfg.input.paths), ("input.eval_train", [cfg.input.eval_train]),
                           ("input.eval_val", [cfg.input.eval_val])):
            for path in paths:
                # tar globs / brace ranges are expanded by the stage; the plain paths must exist now
                if path is not None and not any(c in path for c in "*?{[") and not Path(path).exists():
                    raise ConfigError(f"{key}: '{path}' does not exist")
        from curation.cli import check_inputs

        check_inputs(cfg.input.paths)  # a folder without one image: exit 2 now, not an empty dataset later
        # eval_val alone is fine for curation (decontamination reads it); the kNN stage needs both
        if "eval" in cfg.stages and (cfg.input.eval_train is None) != (cfg.input.eval_val is None):
            raise ConfigError("input.eval_train / input.eval_val: the eval stage needs both (the kNN gallery and "
                              "its queries), or neither")
    for name in ("curate", "pretrain", "distill"):
        if name in cfg.stages and not Path(getattr(cfg, name).config).is_file():
            raise ConfigError(f"{name}.config: '{getattr(cfg, name).config}' does not exist")
    _check_stages(cfg)


def _chained(cfg: PipelineConfig) -> dict[str, list[str]]:
    """The keys the pipeline sets itself to chain the stages; paths that do not exist yet (the sample pool,
    the curated shards, the teacher) are checked as '.'."""
    pool = cfg.input.paths if not cfg.sample.enabled else ["."]
    curate = [f"input.paths={_list(pool)}", "output.dir=."]
    if not cfg.sample.enabled and cfg.input.eval_val:
        curate.append(f"input.eval_paths=[{cfg.input.eval_val}]")
    return {"curate": curate, "pretrain": ["data.paths=[.]", "train.output_dir=."],
            "distill": ["teacher_model.path=.", "data.paths=[.]", "train.output_dir=."]}


def _check_stages(cfg: PipelineConfig) -> None:
    """Merge each stage's YAML and overrides and run its own validation now, so a mistyped key, a bad choice
    or a bad value (`pretrain.overrides=[optim.base_lr=-1]`) exits 2 before curation has run for minutes.
    The distillation checks that need the teacher's files run again when that stage starts."""
    from curation.config import CurationConfig
    from curation.config import validate as validate_curation

    from ..config import load_config
    from ..train.distill import check_students
    from ..ssl.config import PretrainConfig
    from ..ssl.distill_config import DistillConfig
    from ..ssl.distill_config import resolve_mode
    from ..ssl.distill_config import validate as validate_distill
    from ..train.checks import validate_pretrain

    def distill_fields(c: DistillConfig) -> None:
        validate_distill(c)
        check_students(c)  # names (registry ViT or timm:NAME), crops against each student
        resolve_mode(c, has_heads=True)  # the pipeline's teacher is a pretraining run: it exports its heads

    checks = {"curate": (CurationConfig, lambda c: validate_curation(c, "run")),
              "pretrain": (PretrainConfig, validate_pretrain), "distill": (DistillConfig, distill_fields)}
    chained = _chained(cfg)
    for name, (schema, check) in checks.items():
        if name in cfg.stages:
            stage = getattr(cfg, name)
            try:
                check(load_config(schema, stage.config, [*stage.overrides, *chained[name]]))
            except ConfigError as exc:
                raise ConfigError(f"{name}: {exc}") from None


class Paths:
    def __init__(self, cfg: PipelineConfig) -> None:
        root = Path(cfg.output_dir)
        self.root, self.curated, self.pretrain = root, root / "curated", root / "pretrain"
        self.distill, self.eval, self.report = root / "distill", root / "eval_results.json", root / "report"
        self.pool = [str(root / "data" / "pool")] if cfg.sample.enabled else list(cfg.input.paths)
        self.seeds = [str(root / "data" / "seeds")] if cfg.sample.enabled else []
        self.eval_train = str(root / "data" / "eval" / "train") if cfg.sample.enabled else cfg.input.eval_train
        self.eval_val = str(root / "data" / "eval" / "val") if cfg.sample.enabled else cfg.input.eval_val


def _list(items: Sequence[str]) -> str:
    return "[" + ",".join(items) + "]"


def _stage(main: Callable[[list[str]], int], stage: StageConfig, extra: list[str]) -> int:
    # The pipeline's chaining paths come last so they win over the stage's own overrides.
    return main(["--config", stage.config, *stage.overrides, *extra])


def run_curate(cfg: PipelineConfig, p: Paths) -> int:
    from curation.cli import main

    extra = [f"input.paths={_list(p.pool)}", f"output.dir={p.curated}"]
    if p.eval_val:
        extra.append(f"input.eval_paths=[{p.eval_val}]")
    if p.seeds:
        extra.append(f"input.seed_paths={_list(p.seeds)}")
    return main(["run", "--config", cfg.curate.config, *cfg.curate.overrides, *extra])


def knn_probe_overrides(cfg: PipelineConfig, p: Paths) -> list[str]:
    """The teacher's kNN during pretraining on the pipeline's held-out set (the report plots it beside the
    losses); the stage's own overrides come after these, so pretrain.overrides=[knn.points=...] wins."""
    if not (cfg.eval.enabled and p.eval_train and p.eval_val):
        return []
    out = [f"knn.train={p.eval_train}", f"knn.val={p.eval_val}", f"knn.k={max(cfg.eval.k)}"]
    if cfg.eval.img_size:
        out.append(f"knn.img_size={cfg.eval.img_size}")
    return out


def run_pretrain(cfg: PipelineConfig, p: Paths) -> int:
    from ..train.pretrain import main

    return main(["--config", cfg.pretrain.config, *knn_probe_overrides(cfg, p), *cfg.pretrain.overrides,
                 f"data.paths=[{p.curated / 'shards'}]", f"train.output_dir={p.pretrain}"])


def run_distill(cfg: PipelineConfig, p: Paths) -> int:
    from ..train.distill import main

    return _stage(main, cfg.distill, [f"teacher_model.path={p.pretrain}", f"data.paths=[{p.curated / 'shards'}]",
                                      f"train.output_dir={p.distill}"])


def _students(p: Paths) -> dict[str, Path]:
    exp = TrainLayout(p.distill).export()
    return {d.name: d for d in sorted(exp.iterdir()) if (d / "model.safetensors").is_file()} if exp.is_dir() else {}


def run_eval(cfg: PipelineConfig, p: Paths) -> int:
    """kNN on the held-out set: each trained model against a random init of its own architecture."""
    from ..eval import extract_features, knn_classify, open_labelled
    from ..hub import load
    from ..models import random_init_like
    from .pipeline_report import RANDOM_TEACHER, binomial_se

    if not (p.eval_train and p.eval_val):
        print("eval: no labelled eval set (input.eval_train / input.eval_val); skipped")
        return 0
    train = open_labelled(p.eval_train)
    val = open_labelled(p.eval_val, classes=train.classes)
    teacher = load(p.pretrain)
    students = {f"student {n}": load(d) for n, d in _students(p).items()}

    models = {RANDOM_TEACHER: random_init_like(teacher), "teacher": teacher}
    for name, model in students.items():
        # Each student is compared with a random net of its own (smaller) architecture.
        models[f"random init ({name} arch)"] = random_init_like(model)
        models[name] = model
    results, se = {}, {}
    for name, model in models.items():
        kw = {"img_size": cfg.eval.img_size, "num_workers": 0, "device": "cpu"}
        ft, fv = extract_features(model, train, **kw), extract_features(model, val, **kw)
        res = knn_classify(ft.feats, ft.labels, fv.feats, fv.labels, ks=cfg.eval.k, num_classes=len(train.classes))
        results[name] = {str(k): v["top1"] for k, v in res.items()}
        se[name] = {k: binomial_se(v, len(fv.labels)) for k, v in results[name].items()}
        print(f"eval: {name:34s} " + "  ".join(f"k={k} top-1 {v:.3f} ± {se[name][k]:.3f}"
                                                for k, v in results[name].items()))
    out = {"classes": len(train.classes), "train": len(train), "val": len(val), "knn_top1": results,
           "knn_top1_se": se}
    p.eval.write_text(json.dumps(out, indent=2))
    return 0


def _done(stage: str, p: Paths) -> bool:
    if stage == "curate":
        return (p.curated / "manifest.json").is_file()
    if stage == "pretrain":
        return (TrainLayout(p.pretrain).export("teacher") / "model.safetensors").is_file()
    if stage == "distill":
        return bool(_students(p))
    if stage == "eval":
        return p.eval.is_file()
    return False  # the report is cheap: always rewritten


def run(cfg: PipelineConfig) -> int:
    from ..data.samples import build_eval_set, build_sample_pool, build_seed_set
    from .pipeline_report import summary_lines, write_report

    p = Paths(cfg)
    save_config(cfg, p.root, name="pipeline.yaml")
    if cfg.sample.enabled:
        s = cfg.sample
        info = build_sample_pool(p.root / "data", s.n_images, seed=s.seed)
        build_eval_set(p.root / "data", s.eval_train_per_class, s.eval_val_per_class)
        build_seed_set(p.root / "data")
        print(f"sample pool: {info['dir']}" + (" (reused)" if info.get("reused") else ""))
    runners = {"curate": run_curate, "pretrain": run_pretrain, "distill": run_distill, "eval": run_eval}
    timings = {}
    for stage in cfg.stages:
        if stage == "report":
            continue
        if stage == "eval" and not cfg.eval.enabled:
            print("== eval: eval.enabled=false, skipped")
            continue
        if _done(stage, p):
            print(f"== {stage}: outputs complete, skipped")
            continue
        print(f"== {stage}", flush=True)
        t0 = time.time()
        rc = runners[stage](cfg, p)
        timings[stage] = round(time.time() - t0, 1)
        if rc != 0:
            print(f"pipeline: stage '{stage}' failed (exit {rc}); fix it and rerun the same command to continue",
                  file=sys.stderr)
            return rc
    if "report" in cfg.stages:
        report = write_report(p, timings)
        if p.eval.is_file():
            ev = json.loads(p.eval.read_text())
            print("\n".join(summary_lines(ev, max(int(k) for k in next(iter(ev["knn_top1"].values()))))))
        print(f"report: {report}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..train.builders import stage_main

    return stage_main("pipeline", PipelineConfig, validate, run, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
