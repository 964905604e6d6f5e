"""Progress in a log file is a line every N seconds with rate and ETA, not thousands of redrawn frames."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from dinopipe.utils.progress import EVERY_ENV, LineProgress, progress

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_line_every_interval_with_rate_and_eta_then_the_final_count():
    out, clock = io.StringIO(), Clock()
    bar = LineProgress(total=1000, desc="embed task 0/4", unit="img", every_s=30, stream=out, clock=clock)
    for _ in range(100):  # 100 updates of 10 images, 1 s apart: lines at 30, 60, 90 s and at close
        clock.t += 1.0
        bar.update(10)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 4, lines
    assert lines[0] == "embed task 0/4: 300/1,000 img (30.0%), 10.0 img/s, ETA 0:01:10"
    assert lines[-1].startswith("embed task 0/4: 1,000/1,000 img (100.0%), 10.0 img/s, done in 0:01:40")


def test_postfix_initial_and_iteration():
    out, clock = io.StringIO(), Clock()
    bar = LineProgress(range(5), desc="train", unit="step", initial=5, every_s=0, stream=out, clock=clock)
    bar.total = 10
    for _ in bar:
        clock.t += 2.0
        bar.set_postfix(loss="1.2500")
    lines = out.getvalue().splitlines()
    assert len(lines) == 5  # every_s=0: each update prints; close adds nothing new
    assert lines[0] == "train: 6/10 step (60.0%), 0.5 step/s, ETA 0:00:08, loss=1.2500"
    assert lines[-1].endswith("done in 0:00:10, loss=1.2500")


def test_terminal_gets_tqdm_a_file_gets_lines_disabled_gets_nothing():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert type(progress(total=3, stream=Tty())).__name__ == "tqdm"
    assert isinstance(progress(total=3, stream=io.StringIO()), LineProgress)
    off = progress([1, 2], disable=True)
    assert list(off) == [1, 2]
    off.update(5)
    off.close()


def test_curate_log_in_a_file_has_lines_not_frames(tmp_path):
    """`curate embed` with its stderr in a file (as under Slurm): each task's progress is whole lines."""
    from tests._photos import write_pool

    pool = tmp_path / "pool"
    write_pool(str(pool), copies_of=[])
    log = tmp_path / "log"
    cfg = ROOT / "configs" / "curation" / "quickstart.yaml"
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "curation.cli", "embed", "--config", str(cfg),
                             f"input.paths=[{pool}]", f"output.dir={tmp_path / 'out'}", "progress=true",
                             "embed.num_workers=0"], stdout=f, stderr=subprocess.STDOUT, timeout=600,
                            env={**os.environ, EVERY_ENV: "3600"}).returncode
    text = log.read_text()
    assert rc == 0, text[-2000:]
    assert "\r" not in text
    done = [line for line in text.splitlines() if line.startswith("embed task") and " img/s" in line]
    assert done and all("(100.0%)" in line and "done in" in line for line in done), text[-2000:]
