"""`curate run` with input.paths and output.dir in a bucket decides exactly as the same pool on local disk."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

from tests.storage.conftest import PLANTED_SECRET

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "curation" / "quickstart.yaml")


def _kept(out: Path) -> dict[str, bytes]:
    """Member name -> bytes of every image in the output shards (the metadata names the source path: differs)."""
    kept = {}
    for shard in sorted((out / "shards").glob("*.tar")):
        with tarfile.open(shard) as t:
            for m in t.getmembers():
                if m.isfile() and not m.name.endswith(".json"):
                    kept[m.name] = t.extractfile(m).read()
    return kept


def test_curation_from_a_bucket_decides_as_on_disk_and_publishes_its_output(s3, tmp_path, monkeypatch, capsys):
    from tests._photos import real_photos, write_pool

    from curation.cli import main

    photos = real_photos()
    names = sorted(photos)
    pool = tmp_path / "photos"
    write_pool(str(pool), copies_of=names[::9][:3], photos=photos)
    url = upload_tree(s3, pool, "photos")
    monkeypatch.setenv("DINOPIPE_SCRATCH", str(tmp_path / "scratch"))
    common = ["--config", QUICKSTART, "progress=false", "embed.model=vit_test"]
    torch.manual_seed(0)  # vit_test's random weights: the same in both runs
    assert main(["run", *common, f"input.paths=[{pool}]", f"output.dir={tmp_path / 'local_out'}"]) == 0
    torch.manual_seed(0)
    assert main(["run", *common, f"input.paths=[{url}]", "output.dir=s3://pool/curated"]) == 0
    err = capsys.readouterr().err
    assert PLANTED_SECRET not in err

    got = tmp_path / "from_bucket"
    s3.client().get("pool/curated/", str(got) + "/", recursive=True)
    assert (got / "_COMPLETE").is_file()  # the marker, uploaded last
    want_m = json.loads((tmp_path / "local_out" / "manifest.json").read_text())
    got_m = json.loads((got / "manifest.json").read_text())
    assert got_m["counts"] == want_m["counts"] and want_m["counts"]["hash_duplicates"] + \
        want_m["counts"]["copy_duplicates"] > 0
    assert _kept(got) == _kept(tmp_path / "local_out")  # the same images kept, byte for byte
    local_tsv = (tmp_path / "local_out" / "decisions.tsv").read_text()
    assert (got / "decisions.tsv").read_text() == local_tsv  # every image's decision
    for step in ("embeddings/model/part-00000-00000.npy", "embeddings/descriptor/part-00000-00000.npy"):
        assert (got / step).read_bytes() == (tmp_path / "local_out" / step).read_bytes(), step
    for f in got.rglob("*"):
        if f.is_file():
            assert PLANTED_SECRET.encode() not in f.read_bytes(), f


def upload_tree(s3, root: Path, prefix: str) -> str:
    client = s3.client()
    for f in sorted(root.rglob("*")):
        if f.is_file():
            client.put_file(str(f), f"pool/{prefix}/{f.relative_to(root).as_posix()}")
    return f"s3://pool/{prefix}"

