"""Curating a 4-band pool (16-bit TIFF and float .npy tiles rendered from real photos, planted copies in the
other format and at another size): the embedder runs the 4-channel backbone on the bands, hash and copy
verification see the documented RGB rendering, the shards keep the original files, and a tile with the wrong
band count is counted as unreadable."""

import tarfile

import numpy as np
import pytest
from PIL import Image

import dinopipe.hub
from curation.config import CurationConfig
from curation.embed.embedder import build_embedder
from curation.pipeline import run_curation
from dinopipe.data.samples_nch import bands, encode_tile
from dinopipe.models import create_model
from dinopipe.models.channels import expand_patch_embed
from dinopipe.utils.norm import set_input_norm
from tests._photos import real_photos

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("bands")
    src = root / "pool"
    src.mkdir()
    photos = sorted(real_photos().items())[:16]
    copies = {}
    for k, (name, arr) in enumerate(photos):
        v = np.asarray(Image.fromarray(arr).resize((128, 128), Image.BICUBIC))
        fmt, other = ("tiff16", "npy") if k % 2 else ("npy", "tiff16")
        ext = {"tiff16": "tif", "npy": "npy"}
        (src / f"{name}.{ext[fmt]}").write_bytes(encode_tile(bands(v, 4), fmt))
        if k < 4:  # resized, 2 px cropped, written in the other format
            c = np.asarray(Image.fromarray(arr).resize((100, 100), Image.BILINEAR))[2:-2, 2:-2]
            copy = f"{name}_copy.{ext[other]}"
            (src / copy).write_bytes(encode_tile(bands(c, 4), other))
            copies[f"pool/{copy}"] = f"pool/{name}.{ext[fmt]}"
    (src / "three_bands.npy").write_bytes(encode_tile(bands(photos[0][1][:96, :96], 3), "npy"))
    torch_model = expand_patch_embed(create_model("vit_test", img_size=56).eval(), 4)
    set_input_norm(torch_model, [0.45, 0.4, 0.38, 0.41], [0.27, 0.26, 0.26, 0.25])
    model = dinopipe.hub.save_backbone(torch_model, root / "model4")
    return src, copies, model, root


def test_embedder_takes_the_bands(pool):
    src, _, model, _ = pool
    emb = build_embedder(str(model), image_size=56, device="cpu")
    assert emb.channels == 4 and emb.transform.channels == 4
    from dinopipe.data.channels import decode_channels

    x = emb.transform(decode_channels(next(src.glob("*.tif")).read_bytes(), 4)[0])
    assert tuple(x.shape) == (4, 56, 56)
    assert tuple(emb(x[None]).shape) == (1, 64)


def test_curate_run_on_a_four_band_pool(pool):
    src, copies, model, root = pool
    cfg = CurationConfig()
    cfg.input.paths = [str(src)]
    cfg.output.dir, cfg.progress, cfg.report.enabled = str(root / "out"), False, False
    cfg.embed.model, cfg.embed.image_size, cfg.embed.device, cfg.embed.num_workers = str(model), 56, "cpu", 0
    cfg.embed.shard_size, cfg.dedup.k, cfg.rebalance.mode = 100, 8, "none"
    manifest = run_curation(cfg)
    counts = manifest["counts"]
    assert counts["input"] == 21 and counts["unreadable"] == 1  # the 3-band tile
    assert counts["hash_duplicates"] + counts["copy_duplicates"] == len(copies) and counts["kept"] == 16
    rows = [line.split("\t") for line in (root / "out" / "decisions.tsv").read_text().splitlines()[1:]]
    removed = {r[0]: r[3] for r in rows if r[2] in ("hash_duplicates", "copy_duplicates")}
    assert removed == copies  # each copy removed as a copy of its own original, nothing else
    assert {r[3] for r in rows if r[2] == "unreadable"} == {"wrong_channels"}
    originals = {p.read_bytes() for p in src.iterdir()}
    with tarfile.open(next((root / "out" / "shards").glob("*.tar"))) as tar:
        members = [m for m in tar.getmembers() if m.name.endswith((".tif", ".npy"))]
        assert members and all(tar.extractfile(m).read() in originals for m in members)
