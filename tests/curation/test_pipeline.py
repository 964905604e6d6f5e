"""End to end on real photos: several sources, planted copies, bad files, an eval set."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile

import numpy as np
import pytest
import webdataset as wds
from tests._photos import bad_file_kinds, encode, make_copy

from curation.config import CurationConfig
from curation.core.status import KEPT
from curation.core.stepfiles import load_step
from curation.pipeline import run_curation, run_steps
from curation.write.shards import build_manifest
from curation.core.status import STATUSES


@pytest.fixture(scope="module")
def inputs(pool_dir, photos, copied, tmp_path_factory):
    """Source 'pool' (folder with copies + bad files), 'web' (tar shard holding copies of pool
    photos and 3 new photos), 'listed' (file list incl. a missing file); eval set = crops of 2."""
    base = tmp_path_factory.mktemp("e2e")
    pool = base / "pool"
    shutil.copytree(pool_dir[0], pool)
    bad = bad_file_kinds(photos["chelsea"])
    for name, (data, _) in bad.items():
        (pool / "bad").mkdir(exist_ok=True)
        (pool / "bad" / name).write_bytes(data)
    names = sorted(photos)
    web = base / "web"
    web.mkdir()
    with tarfile.open(web / "web-000000.tar", "w") as tf:
        for i, name in enumerate([copied[0], copied[1]]):
            _add(tf, f"{i:04d}.jpg", encode(make_copy(photos[name], "combo")))
            _add(tf, f"{i:04d}.json", b"{}")
        _add(tf, "0100.png", bad["zero.jpg"][0])
    listed = base / "listed.txt"
    (base / "extra").mkdir()
    (base / "extra" / "flip.jpg").write_bytes(encode(np.ascontiguousarray(
        photos[names[3]][:, ::-1])))  # a mirrored photo: not a copy by our descriptor
    listed.write_text("extra/flip.jpg\nextra/missing.jpg\n")
    ev = base / "eval"
    ev.mkdir()
    eval_of = [n for n in names if n not in copied][:2]
    for n in eval_of:
        (ev / f"{n}.jpg").write_bytes(encode(make_copy(photos[n], "crop")))
    return {"sources": [str(pool), str(web), str(listed)], "eval": [str(ev)],
            "eval_of": eval_of, "groups": pool_dir[1], "n_bad": len(bad), "base": base}


def _config(sources, out, eval_paths=(), seed_paths=(), **sections) -> CurationConfig:
    """A CurationConfig as `curate run` would load it; ``sections``: {"embed": {"batch_size": 16}, ...}."""
    cfg = CurationConfig()
    cfg.input.paths, cfg.input.eval_paths, cfg.input.seed_paths = list(sources), list(eval_paths), list(seed_paths)
    cfg.output.dir, cfg.progress, cfg.report.enabled = str(out), False, False
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


def _add(tf, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def run(inputs):
    out = inputs["base"] / "out"
    manifest = run_curation(_config(inputs["sources"], out, inputs["eval"],
                                    embed={"num_workers": 2, "batch_size": 16, "shard_size": 25},
                                    write={"shard_size": 10}))
    return out, manifest


def _decisions(out):
    lines = (out / "decisions.tsv").read_text().splitlines()[1:]
    return {l.split("\t")[0]: l.split("\t")[2:] for l in lines}


def test_manifest_adds_up_overall_and_per_source(run, inputs):
    out, m = run
    c = m["counts"]
    n_pool = sum(len(g) for g in inputs["groups"].values()) + inputs["n_bad"]
    assert c["input"] == n_pool + 3 + 2  # web: 2 copies + 1 empty; list: 2 entries
    assert c["input"] == sum(c[s] for s in STATUSES)
    for name, pc in m["per_source"].items():
        assert pc["input"] == sum(pc[s] for s in STATUSES), name
    assert set(m["per_source"]) == {"pool", "web", "listed"}
    assert m["per_source"]["listed"]["unreadable_reasons"] == {"read_error": 1}
    assert m["per_source"]["web"]["unreadable_reasons"] == {"empty": 1}
    assert m["unreadable_reasons"] == {"empty": 2, "truncated": 1, "not_an_image": 1,
                                       "too_large": 1, "read_error": 1}
    assert json.loads((out / "manifest.json").read_text()) == m


def test_copies_are_found_and_one_per_group_kept(run, inputs):
    out, _ = run
    dec = _decisions(out)
    for name, members in inputs["groups"].items():
        ids = [f"pool/{rel}" for rel in members]
        statuses = {i: dec[i][0] for i in ids}
        if name in inputs["eval_of"]:
            assert set(statuses.values()) <= {"decontaminated", "hash_duplicates",
                                              "copy_duplicates"}
            continue
        kept = [i for i, s in statuses.items() if s == "kept"]
        assert kept == [min(ids)], (name, statuses)  # one per group: the smallest id
        assert all(s in ("hash_duplicates", "copy_duplicates") for i, s in statuses.items()
                   if i != kept[0])
        assert all(dec[i][1] == kept[0] for i in ids)  # decisions.tsv names the kept image
    # the tar shard's copies joined their pool originals' groups across sources
    web = {i: v[0] for i, v in dec.items() if i.startswith("web/")}
    assert web == {"web/web-000000.tar/0000.jpg": web["web/web-000000.tar/0000.jpg"],
                   "web/web-000000.tar/0001.jpg": web["web/web-000000.tar/0001.jpg"],
                   "web/web-000000.tar/0100.png": "unreadable"}
    assert {web["web/web-000000.tar/0000.jpg"], web["web/web-000000.tar/0001.jpg"]} <= {
        "hash_duplicates", "copy_duplicates"}
    assert dec["listed/extra/flip.jpg"][0] == "kept"  # a mirror image is a different picture


def test_decontamination_removes_planted_eval_copies(run, inputs):
    out, m = run
    dec = _decisions(out)
    for n in inputs["eval_of"]:
        assert dec[f"pool/{n}.jpg"][0] == "decontaminated"
    assert m["counts"]["decontaminated"] == len(inputs["eval_of"])


def test_shards_read_back_with_webdataset(run, inputs):
    out, m = run
    urls = sorted(str(out / s) for s in m["shards"])
    assert len(urls) == -(-m["counts"]["kept"] // 10)
    seen = []
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        meta = json.loads(sample["json"])
        ext = [k for k in sample if k not in ("json", "__key__", "__url__", "__local_path__")]
        assert len(ext) == 1 and meta["id"].endswith("." + ext[0])
        src = {"pool": inputs["sources"][0]}.get(meta["source"])
        if src:  # original bytes, not re-encoded
            with open(os.path.join(src, meta["id"].split("/", 1)[1]), "rb") as f:
                assert f.read() == sample[ext[0]]
        assert set(meta) >= {"id", "source", "component", "cluster", "nearest_seed",
                             "seed_similarity"}
        seen.append(meta["id"])
    assert len(seen) == m["counts"]["kept"] and seen == sorted(seen)
    assert not list(out.glob("shards/*.tmp*"))


def test_second_run_gives_identical_selection_and_shards(run, inputs):
    out, m = run
    out2 = inputs["base"] / "out2"
    m2 = run_curation(_config(inputs["sources"], out2, inputs["eval"],
                              embed={"num_workers": 0, "batch_size": 7, "shard_size": 1000},
                              write={"shard_size": 10}))
    assert m2["counts"] == m["counts"]
    assert _decisions(out2) == _decisions(out)
    for s in m["shards"]:
        assert (out / s).read_bytes() == (out2 / s).read_bytes()


def test_manifest_that_does_not_add_up_is_caught():
    with pytest.raises(ValueError, match="unknown statuses"):
        build_manifest({"a": "lost"}, {"a": "s"}, {})


def test_seed_retrieval_records_nearest_seed_in_shards(inputs, photos, tmp_path):
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    names = sorted(photos)
    for n in names[5:8]:  # resized copies of three pool photos act as the curated seed set
        (seeds / f"{n}.jpg").write_bytes(encode(make_copy(photos[n], "resize")))
    out = tmp_path / "out"
    m = run_curation(_config(inputs["sources"][:1], out, seed_paths=[str(seeds)],
                             rebalance={"mode": "sample", "k": 1}, embed={"num_workers": 0}))
    assert m["counts"]["kept"] == 3 and m["counts"]["not_selected"] > 20
    metas = [json.loads(s["json"]) for s in
             wds.WebDataset([str(out / s) for s in m["shards"]], shardshuffle=False)]
    for meta in metas:
        stem = meta["nearest_seed"].rsplit("/", 1)[-1][:-4]
        assert meta["seed_similarity"] > 0.9
        assert stem in meta["component"] or meta["id"].endswith(f"{stem}.jpg")


def test_write_on_a_folder_from_before_seed_rows_says_rerun_rebalance(run, inputs, tmp_path):
    """steps/rebalance.npz once stored the nearest seed's name as a string; such a folder gets a clear error naming
    the file and the step to rerun (exit 2), not an internal crash."""
    from dinopipe.config import InputError

    from curation.write.tasks import write_task

    out, _ = run
    old = tmp_path / "old"
    shutil.copytree(out, old)
    path = old / "steps" / "rebalance.npz"  # the format of that time: one .npz, not steps/rebalance/*.npy
    rb = load_step(str(old), "rebalance")
    shutil.rmtree(old / "steps" / "rebalance")
    rb["nearest_seed"] = np.full(len(rb["nearest_seed"]), "", dtype="<U8")
    np.savez(path, **rb)
    with pytest.raises(InputError, match="rebalance.npz.*rerun `curate rebalance`"):
        write_task(str(old), inputs["sources"], 10)


def _to_old_format(out) -> None:
    """Rewrite a folder's steps as a version before issue 30 wrote them: one steps/<step>.npz per step."""
    for step in ("dedup", "decontaminate", "rebalance"):
        arrays = load_step(str(out), step)
        shutil.rmtree(out / "steps" / step)
        np.savez(out / "steps" / f"{step}.npz", **arrays)


def test_an_output_folder_with_old_npz_steps_still_writes_the_same_decisions_and_report(run, inputs, tmp_path):
    """A user's folder from before steps/<step>/*.npy: `curate write` and `curate report` read its .npz steps and
    give the same decisions, manifest counts and shards; a step rerun there writes the new layout."""
    from curation.config import WriteConfig
    from curation.write.step import step_write
    from curation.report.step import make_report

    out, manifest = run
    old = tmp_path / "old"
    shutil.copytree(out, old)
    _to_old_format(old)
    for name in ("decisions.tsv", "manifest.json"):
        (old / name).unlink()
    shutil.rmtree(old / "decisions")
    m = step_write(inputs["sources"], str(old), WriteConfig(shard_size=10))
    assert m["counts"] == manifest["counts"] and m["shards"] == manifest["shards"]
    assert (old / "decisions.tsv").read_bytes() == (out / "decisions.tsv").read_bytes()
    for name in m["shards"]:
        assert (old / name).read_bytes() == (out / name).read_bytes()
    assert os.path.exists(make_report(str(old), inputs["sources"], {
        "dedup_threshold": 0.45, "decontam_threshold": 0.6, "hash_max_distance": 4, "k": 8}))
    run_steps(_config(inputs["sources"], old, inputs["eval"], embed={"num_workers": 0}), ["decontaminate"])
    assert not (old / "steps" / "decontaminate.npz").exists()
    assert (old / "steps" / "decontaminate" / "done.json").exists()
    np.testing.assert_array_equal(load_step(str(old), "decontaminate")["status"],
                                  load_step(str(out), "decontaminate")["status"])


def test_a_step_folder_without_its_done_marker_is_not_read(run, tmp_path):
    """A step killed while writing its arrays leaves no done.json: readers say to run the step, never read half."""
    out, _ = run
    half = tmp_path / "half"
    shutil.copytree(out, half)
    os.remove(half / "steps" / "rebalance" / "done.json")
    with pytest.raises(FileNotFoundError, match="rebalance.*run the 'rebalance' step first"):
        load_step(str(half), "rebalance")
    mapped = load_step(str(out), "rebalance", mmap=True)
    assert all(isinstance(a, np.memmap) for a in mapped.values())
    assert mapped["status"].dtype == np.int8 and set(mapped) == {"status", "cluster", "nearest_seed", "seed_sim"}


def test_kept_rows_found_from_block_counts_are_the_kept_rows(run):
    """write_selection's per-block kept counts give every shard's kept rows as np.flatnonzero over the whole
    status array would, for any block size; its digest does not depend on the block size."""
    from curation.write.tasks import write_selection

    out, manifest = run
    status = load_step(str(out), "rebalance")["status"]
    kept = np.flatnonzero(status == KEPT)
    sels = [write_selection(str(out), 10, block) for block in (1, 3, 7, 64, 1 << 16)]
    assert {s.digest for s in sels} == {sels[0].digest} and sels[0].n_kept == len(kept) == manifest["counts"]["kept"]
    for sel in sels:
        for start, stop in ((0, 10), (3, 17), (len(kept) - 4, len(kept)), (0, len(kept)), (5, 5)):
            np.testing.assert_array_equal(sel.rows(status, start, stop), kept[start:stop])

