"""Shared fixtures: a pool of real photos with planted copies, and its descriptors."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests._photos import COPY_KINDS, encode, make_copy, real_photos, write_pool

CLUSTER = Path(__file__).resolve().parents[2] / "slurm" / "local_cluster.sh"
N_COPIED = 8  # photos that get planted copies (4 kinds each)


@pytest.fixture(scope="session")
def photos() -> dict[str, np.ndarray]:
    p = real_photos()
    assert len(p) >= 30, f"only {len(p)} real photos load offline; tests need >= 30"
    return p


@pytest.fixture(scope="session")
def copied(photos) -> list[str]:
    # spread over the list: textures (brick), greyscale, colour photos, crops of big ones
    names = sorted(photos)
    return names[:: max(1, len(names) // N_COPIED)][:N_COPIED]


@pytest.fixture(scope="session")
def pool_dir(tmp_path_factory, photos, copied) -> tuple[Path, dict[str, list[str]]]:
    """Folder 'pool' with every photo as <name>.jpg and copies under copies/; plus the groups."""
    root = tmp_path_factory.mktemp("curation") / "pool"
    groups = write_pool(str(root), copies_of=copied, photos=photos)
    return root, groups


@pytest.fixture(scope="session")
def labelled_images(photos):
    """(PIL images, photo label per image, copy kind per image ('' for originals))."""
    imgs, labels, kinds = [], [], []
    for i, name in enumerate(sorted(photos)):
        arr = photos[name]
        for kind in ("",) + COPY_KINDS:
            a = arr if not kind else make_copy(arr, kind)
            imgs.append(Image.open(io.BytesIO(encode(a, quality=90))).convert("RGB"))
            labels.append(i)
            kinds.append(kind)
    return imgs, np.array(labels), np.array(kinds)


def fake_sbatch(tmp_path: Path, reply_suffix: str = "") -> tuple[Path, dict[str, str]]:
    """A stand-in ``sbatch`` on PATH that appends its arguments to a log and answers job ids 1001, 1002, ...
    (``reply_suffix``: e.g. ``;cluster``, as ``--parsable`` prints on a multi-cluster site). Returns (log, env)."""
    log = tmp_path / "sbatch.log"
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/bash\necho "$@" >> {log}\nn=$(wc -l < {log}); echo "$((1000 + n)){reply_suffix}"\n')
    fake.chmod(0o755)
    return log, dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}")


@pytest.fixture(scope="module")
def slurm():
    """The local Slurm of slurm/local_cluster.sh, started unless it runs (left running afterwards); skipped
    with the reason where it cannot start (DINOPIPE_REQUIRE_SLURM=1: a failure). Yields the list the test
    appends its job ids to (cancelled at the end)."""
    up = subprocess.run([str(CLUSTER), "status"], capture_output=True).returncode == 0
    if not up:
        r = subprocess.run([str(CLUSTER), "start"], capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            reason = f"Slurm could not be started here: {(r.stderr or r.stdout).strip()[-500:]}"
            if os.environ.get("DINOPIPE_REQUIRE_SLURM") == "1":
                pytest.fail(reason)
            pytest.skip(reason)
    jobs: list[str] = []
    yield jobs
    if jobs:  # never stop the daemons: other people's jobs may be running
        subprocess.run(["scancel", *jobs], capture_output=True)
