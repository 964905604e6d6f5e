"""Help in plain words, and the config reference: `dinopipe config --kind X` lists every key of that config
with its default and what it does; each stage's --help points there."""

import dataclasses
import re
import typing

import pytest

from dinopipe.app.cli import SCHEMAS, main
from dinopipe.config import config_reference

COMMANDS = [[], ["models"], ["export"], ["config"], ["pretrain"], ["distill"], ["pipeline"], ["curate"],
            ["curate", "run"], ["curate", "plan"], ["curate", "simulate"], ["curate", "kmeans"], ["eval"],
            ["eval", "knn"], ["eval", "linear"], ["eval", "seg"], ["eval", "depth"], ["eval", "detect"], ["plan"], ["slurm"],
            ["gpu-check"]]
# The `curate` entry point (curation/cli.py) on its own: the step parser and the commands it hands over.
CURATE_COMMANDS = [[], ["run"], ["embed"], ["index"], ["plan"], ["simulate"], ["kmeans"]]
# Source markup a reader of --help should not see: reST literals and roles, markdown code, bold, links, headings.
MARKUP = re.compile(r"``|:(?:func|class|mod|meth|attr|ref|obj|data):|\*\*|`[^`]{1,80}`|\]\(|^#+ ", re.M)


def _help(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a) or "dinopipe")
def test_help_has_no_source_markup(capsys, argv):
    text = _help(capsys, argv)
    assert text.strip(), argv
    assert not MARKUP.findall(text), (argv, MARKUP.findall(text))


@pytest.mark.parametrize("argv", CURATE_COMMANDS, ids=lambda a: " ".join(["curate", *a]))
def test_curate_entry_help_has_no_source_markup(capsys, argv):
    from curation.cli import main as curate_main

    with pytest.raises(SystemExit) as exc:
        curate_main([*argv, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.strip() and not MARKUP.findall(text), (argv, MARKUP.findall(text))


def test_the_help_walk_covers_every_command():
    """A new command or eval task must be added to COMMANDS above (so its --help is checked too)."""
    from dinopipe.app.cli import STAGES
    from dinopipe.eval.cli import build_parser

    top = {a[0] for a in COMMANDS if a}
    assert set(STAGES) | {"models", "export", "config"} <= top
    sub = next(a for a in build_parser()._actions if a.dest == "task")
    assert {a[1] for a in COMMANDS if a[:1] == ["eval"] and len(a) > 1} == set(sub.choices)


def test_the_markup_check_finds_markup():
    for text in ("see ``curate``", "uses :func:`load`", "a **bold** claim", "run `curate plan`", "[docs](x.md)",
                 "## Heading"):
        assert MARKUP.findall(text), text
    assert not MARKUP.findall("curate plan --pool 142M [--gpus 160] (k=v, x*y)")


def test_models_help_has_a_description(capsys):
    assert "backbones dinopipe can build" in _help(capsys, ["models"])


@pytest.mark.parametrize("stage, kind", [("pretrain", "pretrain"), ("distill", "distill"), ("pipeline", "pipeline"),
                                         ("curate", "curation"), ("slurm", "slurm"), ("plan", "pretrain")])
def test_stage_help_points_at_the_config_reference(capsys, stage, kind):
    assert f"dinopipe config --kind {kind}" in " ".join(_help(capsys, [stage]).split())


def _leaf_keys(schema, prefix=""):
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp):
            yield from _leaf_keys(tp, f"{prefix}{f.name}.")
        elif inner and typing.get_origin(tp) is list:
            yield f"{prefix}{f.name}"
            yield from _leaf_keys(inner[0], f"{prefix}{f.name}[].")
        else:
            yield f"{prefix}{f.name}"


@pytest.mark.parametrize("kind", ["pretrain", "distill", "curation", "pipeline", "slurm", "model", "seg", "detect"])
def test_config_reference_lists_every_key_with_its_default(capsys, kind):
    assert main(["config", "--kind", kind]) == 0
    lines = capsys.readouterr().out.splitlines()
    shown = {line.split(" = ", 1)[0] for line in lines if " = " in line and not line.startswith("#")}
    assert shown == set(_leaf_keys(SCHEMAS[kind]()))


def test_reference_shows_defaults_and_the_field_docstring(capsys):
    from dinopipe.ssl.config import PretrainConfig

    rows = {k: (d, doc) for k, d, doc in config_reference(PretrainConfig)}
    assert rows["optim.base_lr"][0] == "0.004" and "sqrt" in rows["optim.base_lr"][1]
    assert rows["model.name"][0] == "vit_test" and rows["model.num_heads"][0] == "null"
    assert main(["config", "--kind", "pretrain"]) == 0
    assert any(line.startswith("optim.base_lr = 0.004") and "base_lr * sqrt" in line
               for line in capsys.readouterr().out.splitlines())


def test_config_with_a_file_still_prints_it_resolved(capsys):
    assert main(["config", "--kind", "pretrain", "--config", "configs/pretrain/quickstart.yaml",
                 "optim.base_lr=0.001"]) == 0
    assert "base_lr: 0.001" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["pretrain", "distill", "curation", "pipeline", "slurm", "model", "seg", "detect"])
def test_every_key_of_every_kind_has_a_one_line_doc(capsys, kind):
    """`dinopipe config --kind X` prints a doc beside every key (a field without an attribute docstring or a
    comment would print bare), and the printed doc is plain words (no source markup)."""
    rows = config_reference(SCHEMAS[kind]())
    bare = [key for key, default, doc in rows if default != "(section)" and not doc.strip()]
    assert not bare, f"keys of --kind {kind} without a doc: {bare}"
    assert main(["config", "--kind", kind]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for key, default, doc in rows:
        if default == "(section)":
            continue
        i = next(i for i, line in enumerate(lines) if line.startswith(f"{key} = "))
        assert doc[:40] in " ".join(lines[i:i + 2]), key  # beside the default, or under it for a long key
    for markup in ("``", ":func:", ":class:", ":mod:", ":meth:"):
        assert markup not in out, (kind, markup)
