"""No permission is read back from a folder (issue 38): an output folder someone hands over, whose
``copy_model.json`` says its TorchScript copy model is trusted, runs no code unless *this* invocation says
``dedup.trust_code=true``. The model prints a marker from its forward (TorchScript's own ``print``, so the C++
runtime writes it to the process's stdout): a command that ran it shows the marker."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

MARKER = "MARKER-THE-FOLDER-MODEL-RAN"


class _Marks(torch.nn.Module):
    """Stands in for a copy model from someone else: any code at all runs in its forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 16, 8, stride=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("MARKER-THE-FOLDER-MODEL-RAN")  # TorchScript takes no global: MARKER spelt out
        return torch.nn.functional.adaptive_avg_pool2d(torch.relu(self.conv(x)), 1).flatten(1)


def _listing(root) -> dict[str, float]:
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, fs in os.walk(root) for f in fs}


@pytest.fixture(scope="module")
def handed_over(pool_dir, tmp_path_factory):
    """A folder embedded (by its author, with the opt-in) with a marker-printing TorchScript copy model, then
    its copy_model.json rewritten to claim the opt-in, as an old or crafted folder would."""
    from curation.config import DedupConfig, EmbedConfig
    from curation.dedup.step import step_dedup
    from curation.embed.step import step_embed

    tmp = tmp_path_factory.mktemp("handed")
    model = tmp / "copy.torchscript.pt"
    with warnings.catch_warnings():  # "jit is deprecated": copy models ship as TorchScript
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(torch.jit.script(_Marks().eval()), str(model))
    root, _ = pool_dir
    out = tmp / "out"
    step_embed([str(root)], str(out), EmbedConfig(batch_size=16, num_workers=0),
               dedup=DedupConfig(model=str(model), image_size=64, trust_code=True), progress=False)
    step_dedup(str(out), progress=False, sources=[str(root)])
    rec = json.loads((out / "copy_model.json").read_text())
    assert "trust_code" not in rec and rec["trust_code_given"] is True  # provenance, under a name never read
    (out / "copy_model.json").write_text(json.dumps({**rec, "trust_code": True}))  # the crafted claim
    return root, out


# every command that embeds images with the folder's copy model (pool, eval or seed images)
COMMANDS = [
    ("decontaminate", ["input.eval_paths=[{root}]"]),
    ("index", ["input.eval_paths=[{root}]"]),
    ("rebalance", ["input.seed_paths=[{root}]", "rebalance.mode=sample"]),
    ("embed", []),
    ("run", ["input.eval_paths=[{root}]"]),
]


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")
@pytest.mark.parametrize("command,extra", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_a_handed_over_folder_runs_no_code_without_the_flag(handed_over, capfd, command, extra):
    from curation.cli import main

    root, out = handed_over
    before = _listing(out)
    argv = [command, f"input.paths=[{root}]", f"output.dir={out}", "embed.num_workers=0", "progress=false",
            *[e.format(root=root) for e in extra]]
    capfd.readouterr()
    rc = main(argv)
    got = capfd.readouterr()
    assert rc == 2
    assert MARKER not in got.out + got.err  # no code of the folder's model ran
    assert "dedup.trust_code=true" in got.err and "copy.torchscript.pt" in got.err
    assert "Traceback" not in got.err
    assert _listing(out) == before  # refused before anything was written


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")
def test_the_flag_on_this_invocation_runs_it(handed_over, capfd):
    """The control: the same folder with the opt-in given on the command line runs the model (so the test above
    would see the marker if the folder's own claim were honoured)."""
    from curation.cli import main

    root, out = handed_over
    capfd.readouterr()
    rc = main(["decontaminate", f"input.paths=[{root}]", f"output.dir={out}", "embed.num_workers=0",
               "progress=false", f"input.eval_paths=[{root}]", "dedup.trust_code=true"])
    got = capfd.readouterr()
    assert rc == 0, got.err
    assert MARKER in got.out
