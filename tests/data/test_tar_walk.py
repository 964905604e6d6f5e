"""dinopipe.data.sources.TarWalk: the one tar walker (training pool, curation sources, eval shards)."""

from __future__ import annotations

import io
import tarfile

from dinopipe.data.sources import TarWalk


def _shard(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_members_come_with_offsets_that_read_back_their_bytes(tmp_path):
    shard = tmp_path / "s.tar"
    members = {"a.jpg": b"\xff\xd8jpeg" * 100, "a.cls": b"7", "b.png": b"\x89PNG" * 300}
    _shard(shard, members)
    walk, seen, labels = TarWalk(str(shard)), {}, {}
    for m in walk:
        seen[m.name] = (m.offset_data, m.size)
        if m.name.endswith(".cls"):
            labels[m.name] = walk.read(m)
    raw = shard.read_bytes()
    assert {n: raw[o:o + s] for n, (o, s) in seen.items()} == members
    assert labels == {"a.cls": b"7"} and walk.error is None and not walk.cut_off


def test_damage_is_reported_not_raised(tmp_path):
    shard = tmp_path / "s.tar"
    _shard(shard, {"a.jpg": b"x" * 2000, "b.jpg": b"y" * 2000})
    cut = tmp_path / "cut.tar"
    cut.write_bytes(shard.read_bytes()[:3500])  # inside b.jpg's data (its header ends at 3072)
    walk = TarWalk(str(cut))
    assert [m.name for m in walk] == ["a.jpg", "b.jpg"]  # what precedes the damage is still listed
    assert walk.cut_off and walk.error == "unexpected end of data"
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar at all" * 64)
    walk = TarWalk(str(junk))
    assert list(walk) == [] and walk.error
