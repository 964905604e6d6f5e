"""Malformed input, generated from real photos with fixed seeds: every case is refused or counted with a
reason; none raises out of the reader, hangs, writes outside its output folder or runs anything.

Families: truncated and corrupted images (JPEG/PNG/WebP/GIF/TIFF/BMP of scikit-image photos), decompression
bombs (headers claiming up to 10^5 x 10^5 pixels, and a real zlib bomb), truncated and corrupted tar shards and
tar members that are links or climb out with ``..`` / absolute names (through the source listing, the training
pool index and curation's shard writer), safetensors files with lying headers, corrupt torch / DCP checkpoints,
and YAML configs with tags that construct objects. Each test counts its cases; the totals are printed
(``-s``) and written to ``$DINOPIPE_FUZZ_COUNTS`` when set (docs/reliability.md quotes them).
"""

from __future__ import annotations

import io
import json
import os
import random
import struct
import tarfile
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import dinopipe
from dinopipe.config import ConfigError, load_config
from dinopipe.data.decode import REASONS, TOO_LARGE, safe_decode
from dinopipe.hub import CheckpointError, save_backbone
from dinopipe.models import create_model

SLOW_CASE_S = 10.0  # any single case slower than this is a hang for our purposes
COUNTS: Counter = Counter()
pytestmark = pytest.mark.timeout(240, method="thread")  # a real hang kills the run instead of stalling CI


@pytest.fixture(scope="module")
def photos() -> list[np.ndarray]:
    """Five real photographs (scikit-image), at most 192 px on a side to keep the decode cost small."""
    import skimage.data as skd

    out = []
    for name in ("astronaut", "coffee", "chelsea", "rocket", "camera"):
        arr = getattr(skd, name)()
        img = Image.fromarray(arr).convert("RGB")
        img.thumbnail((192, 192))
        out.append(np.asarray(img))
    return out


def _encode(arr: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(arr)
    if fmt == "GIF":
        img = img.convert("P")
    img.save(buf, format=fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return buf.getvalue()


def _mutations(data: bytes, seed: int) -> list[tuple[str, bytes]]:
    """Deterministic damage: cut-offs, flipped bytes, zeroed or shuffled blocks, a replaced header."""
    rng = random.Random(seed)
    n = len(data)
    out = [(f"cut{c}", data[: int(n * c)]) for c in (0.0, 0.01, 0.1, 0.5, 0.9, 0.99)]
    out.append(("cut-1", data[:-1]))
    for flips in (1, 8, 64):
        b = bytearray(data)
        for _ in range(flips):
            b[rng.randrange(n)] = rng.randrange(256)
        out.append((f"flip{flips}", bytes(b)))
    z = bytearray(data)
    start = rng.randrange(n // 2)
    z[start:start + n // 4] = bytes(len(z[start:start + n // 4]))
    out.append(("zero-block", bytes(z)))
    chunks = [data[i:i + n // 4] for i in range(0, n, max(1, n // 4))]
    rng.shuffle(chunks)
    out.append(("shuffled", b"".join(chunks)))
    out.append(("garbage-header", bytes(rng.randrange(256) for _ in range(32)) + data[32:]))
    out.append(("html", b"<html><body>404 Not Found</body></html>"))
    out.append(("doubled", data + data))
    return out


def _decode_case(family: str, data: bytes) -> str:
    t = time.perf_counter()
    img, reason = safe_decode(data)  # must not raise
    took = time.perf_counter() - t
    assert took < SLOW_CASE_S, f"{family}: {took:.1f} s"
    assert (img is None) != (reason is None)
    if img is not None:
        assert img.mode == "RGB" and img.size[0] > 0 and img.size[1] > 0
        return "decoded"
    assert reason in REASONS
    return reason


def test_truncated_and_corrupt_images(photos):
    outcomes = Counter()
    for i, arr in enumerate(photos):
        for j, fmt in enumerate(("JPEG", "PNG", "WEBP", "GIF", "TIFF", "BMP")):
            data = _encode(arr, fmt)
            assert _decode_case(fmt, data) == "decoded"
            for name, bad in _mutations(data, seed=100 * i + j):
                outcomes[_decode_case(f"{fmt}/{name}", bad)] += 1
    COUNTS["images"] += sum(outcomes.values())
    print(f"\nfuzz images: {sum(outcomes.values())} cases {dict(outcomes)}")
    assert outcomes["truncated"] > 0 and outcomes["empty"] > 0 and outcomes["not_an_image"] > 0


# -- decompression bombs ---------------------------------------------------------------------------------------


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def _png_header_claiming(w: int, h: int, idat: bytes = b"") -> bytes:
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat or zlib.compress(b"\0" * 64))
            + _png_chunk(b"IEND", b""))


def _real_png_bomb(side: int) -> bytes:
    """A genuine greyscale PNG of side x side zero pixels: ~side^2 bytes once decoded, ~0.1% of it on disk."""
    comp = zlib.compressobj(9)
    row = b"\0" * (side + 1)  # filter byte + pixels
    idat = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def _bmp_claiming(w: int, h: int) -> bytes:
    info = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + len(info) + 12, 0, 0, 14 + len(info)) + info + b"\0" * 12


def _gif_claiming(w: int, h: int) -> bytes:
    return (b"GIF89a" + struct.pack("<HH", w, h) + b"\x80\x00\x00" + b"\0\0\0\xff\xff\xff"
            + b"\x2c" + struct.pack("<HHHH", 0, 0, w, h) + b"\x00" + b"\x02\x02\x44\x01\x00" + b"\x3b")


def _tiff_claiming(w: int, h: int) -> bytes:
    entries = [(256, 4, 1, w), (257, 4, 1, h), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1), (273, 4, 1, 8),
               (277, 3, 1, 1), (278, 4, 1, h), (279, 4, 1, 16)]
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries) + b"\0\0\0\0"
    return b"II*\x00" + struct.pack("<I", 24) + b"\0" * 16 + ifd


def _jpeg_claiming(photo: np.ndarray, w: int, h: int) -> bytes:
    data = bytearray(_encode(photo, "JPEG"))
    i = data.find(b"\xff\xc0")  # baseline SOF0: length(2) precision(1) height(2) width(2)
    data[i + 5:i + 9] = struct.pack(">HH", h, w)
    return bytes(data)


def test_decompression_bombs_are_counted_too_large(photos):
    cases = {f"png-{w}x{h}": _png_header_claiming(w, h) for w, h in
             [(100_000, 100_000), (2**31 - 1, 1), (1, 2**31 - 1), (20_000, 20_000), (10_001, 10_000)]}
    cases.update({f"bmp-{s}": _bmp_claiming(s, s) for s in (100_000, 30_000)})
    cases.update({f"gif-{s}": _gif_claiming(s, s) for s in (65_535, 20_000)})
    cases.update({f"tiff-{s}": _tiff_claiming(s, s) for s in (100_000, 12_000)})
    cases.update({f"jpeg-{s}": _jpeg_claiming(photos[0], s, s) for s in (65_535, 12_000)})
    cases["ppm-100000"] = b"P6\n100000 100000\n255\n" + b"\0" * 64
    cases["png-zlib-bomb-12000"] = _real_png_bomb(12_000)  # 144 MP of real data in ~150 kB
    outcomes = {name: _decode_case(name, data) for name, data in cases.items()}
    assert all(r == TOO_LARGE for r in outcomes.values()), outcomes
    COUNTS["bombs"] += len(cases)
    print(f"\nfuzz bombs: {len(cases)} cases, all '{TOO_LARGE}'")


# -- tar shards ------------------------------------------------------------------------------------------------


def _add(tf: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mtime = kind, link, 0
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tf.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def _shard(path: Path, photos, evil: list[tuple] = ()) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for i, arr in enumerate(photos):
            _add(tf, f"{i:06d}.jpg", _encode(arr, "JPEG"))
            _add(tf, f"{i:06d}.json", json.dumps({"i": i}).encode())
        for args in evil:
            _add(tf, *args)


def _files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def _read_all(shards: list[Path], out_dir: Path) -> Counter:
    """List, read, decode and index the shards as training and curation do, and write the readable images as
    curation's writer does; returns the outcomes."""
    import warnings

    from curation.write.shards import write_shards
    from dinopipe.data.pool_index import build_index
    from dinopipe.data.sources import MultiSource, TarShardSource

    outcomes = Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # damaged / refused shards warn; the counts are what we check
        for shard in shards:
            src = TarShardSource(str(shard), name="web")
            refs = src.refs()
            for ref in refs:
                t = time.perf_counter()
                img, reason = safe_decode(src.read(ref))
                assert time.perf_counter() - t < SLOW_CASE_S
                outcomes["decoded" if img is not None else reason] += 1
                if "#refused-" in ref.id:
                    assert src.read(ref) is None
                    outcomes["refused-member"] += 1
            build_index(src)  # the training pool's index: one header walk, must not raise
            multi = MultiSource([src])
            ids = [r.id for r in refs]
            write_shards(multi, ids, [{"id": i} for i in ids], str(out_dir / shard.stem), shard_size=4)
    return outcomes


def test_tar_shards_truncated_corrupt_and_escaping(tmp_path, photos, monkeypatch):
    root = tmp_path / "work"
    (root / "in").mkdir(parents=True)
    monkeypatch.chdir(root / "in")  # a relative '../' extraction would land in root
    base = root / "in" / "base.tar"
    _shard(base, photos)
    raw = base.read_bytes()
    shards = []
    rng = random.Random(7)
    for k, cut in enumerate([1, 511, 512, 700, 1024, 1536, len(raw) // 3, len(raw) // 2, len(raw) - 1024,
                             len(raw) - 1]):
        p = root / "in" / f"cut{k}.tar"
        p.write_bytes(raw[:cut])
        shards.append(p)
    for k in range(12):  # flip bytes inside tar headers (the 512-byte blocks before each member)
        b = bytearray(raw)
        header_at = rng.choice([0, 512 * rng.randrange(1, len(raw) // 512)])
        for _ in range(rng.choice([1, 4, 32])):
            b[header_at + rng.randrange(512)] = rng.randrange(256)
        p = root / "in" / f"flip{k}.tar"
        p.write_bytes(bytes(b))
        shards.append(p)
    abs_target = root / "abs_target" / "evil.jpg"
    photo = _encode(photos[0], "JPEG")
    evil = [
        ("../../escape.jpg", photo), ("a/../../../escape2.jpg", photo), (str(abs_target), photo),
        ("link.jpg", b"", tarfile.SYMTYPE, "/etc/passwd"), ("link2.jpg", b"", tarfile.SYMTYPE, "../../escape.jpg"),
        ("hard.jpg", b"", tarfile.LNKTYPE, "000000.jpg"), ("hard2.jpg", b"", tarfile.LNKTYPE, "/etc/passwd"),
        ("fifo.jpg", b"", tarfile.FIFOTYPE), ("dir.jpg", b"", tarfile.DIRTYPE),
        ("C:\\windows\\evil.jpg", photo),
    ]
    p = root / "in" / "evil.tar"
    _shard(p, photos[:2], evil)
    shards.append(p)
    before = _files_under(root)
    outcomes = _read_all(shards, root / "out")
    after = _files_under(root)
    created = sorted(after - before)
    assert all(c.startswith("out/") for c in created), [c for c in created if not c.startswith("out/")]
    assert not abs_target.exists() and not (root / "escape.jpg").exists()
    # The escaping names and the links are refused (counted as unreadable placeholders, never read).
    assert outcomes["refused-member"] == 8, outcomes  # 4 climbing/absolute/drive names, 4 links (fifo, dir: no files)
    written = [m for t in (root / "out" / "evil").glob("*.tar") for m in tarfile.open(t).getnames()]
    assert written and all("/" not in m and ".." not in m for m in written)
    n = len(shards) + len(evil)
    COUNTS["tar"] += n
    print(f"\nfuzz tar: {len(shards)} shards ({len(evil)} hostile members), outcomes {dict(outcomes)}")


# -- safetensors with lying headers, corrupt torch and DCP checkpoints -------------------------------------------


def _st_parts(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def _st_join(header: dict | bytes, body: bytes, length: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + body


def _safetensors_cases(data: bytes) -> list[tuple[str, bytes]]:
    header, body = _st_parts(data)
    names = [k for k in header if k != "__metadata__"]
    first = names[0]
    cases = [("header-len-2^62", _st_join(header, body, 2**62)), ("header-len-past-eof", _st_join(header, body, len(data))),
             ("header-len-0", _st_join(header, body, 0)), ("header-len-short", _st_join(header, body, 7)),
             ("header-not-json", _st_join(b"{not json" + b" " * 40, body)), ("header-list", _st_join(b"[1, 2, 3]", body)),
             ("header-not-utf8", _st_join(b'{"\xff\xfe": 1}', body)), ("empty-file", b""), ("8-bytes", data[:8])]

    def edit(name: str, fn) -> None:
        h = json.loads(json.dumps(header))
        fn(h)
        cases.append((name, _st_join(h, body)))

    edit("offsets-past-eof", lambda h: h[first].update(data_offsets=[0, len(body) + 4096]))
    edit("all-offsets-past-eof", lambda h: [h[k].update(data_offsets=[len(body) + 8, len(body) + 8 + 4 * 64])
                                             for k in names])
    edit("offsets-reversed", lambda h: h[first].update(data_offsets=[8, 0]))
    edit("offsets-negative", lambda h: h[first].update(data_offsets=[-4, 4]))
    edit("dtype-size-wrong", lambda h: h[first].update(dtype="F64"))
    edit("dtype-unknown", lambda h: h[first].update(dtype="X99"))
    edit("shape-huge", lambda h: h[first].update(shape=[2**40, 2**40]))
    edit("shape-negative", lambda h: h[first].update(shape=[-1, 64]))
    edit("overlapping", lambda h: [h[k].update(data_offsets=h[first]["data_offsets"]) for k in names[:3]])
    edit("metadata-not-str", lambda h: h.update(__metadata__={"dinopipe_arch": {"depth": 2}}))
    edit("arch-not-json", lambda h: h.update(__metadata__={**h.get("__metadata__", {}), "dinopipe_arch": "{oops"}))
    edit("arch-lies", lambda h: h.update(__metadata__={**h.get("__metadata__", {}),
                                                       "dinopipe_arch": json.dumps({"depth": 7, "embed_dim": 5})}))
    cases += [(f"cut{c}", data[: int(len(data) * c)]) for c in (0.001, 0.01, 0.3, 0.7, 0.999)]
    return cases


def _load_case(path: Path) -> str:
    t = time.perf_counter()
    try:
        dinopipe.load(path)
        outcome = "loaded"
    except CheckpointError as exc:  # the only exception a reader may raise; it names what it read
        assert str(path) in str(exc) or str(path.parent) in str(exc), str(exc)
        outcome = "refused"
    assert time.perf_counter() - t < SLOW_CASE_S
    return outcome


def test_lying_safetensors_and_corrupt_checkpoints(tmp_path, marker_free):
    import torch.distributed.checkpoint as dcp

    from tests._dinov2_reference import official_keys

    model = create_model("vit_test")
    save_backbone(model, tmp_path / "good")
    data = (tmp_path / "good" / "model.safetensors").read_bytes()
    outcomes = Counter()
    for k, (name, bad) in enumerate(_safetensors_cases(data)):
        f = tmp_path / f"st{k}.safetensors"
        f.write_bytes(bad)
        outcomes[f"safetensors:{_load_case(f)}"] += 1
        folder = tmp_path / f"stdir{k}"  # the same bytes as an export folder's model.safetensors
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(bad)
        (folder / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
        outcomes[f"export-folder:{_load_case(folder)}"] += 1
    pth = tmp_path / "good.pth"
    torch.save(official_keys(64, 1, grid=2), pth)
    for k, (name, bad) in enumerate(_mutations(pth.read_bytes(), seed=11)):
        f = tmp_path / f"pth{k}.pth"
        f.write_bytes(bad)
        outcomes[f"pth:{_load_case(f)}"] += 1
    ckpt = tmp_path / "dcp"
    dcp.save({"teacher": {"model": {"backbone": model.state_dict()}}}, checkpoint_id=str(ckpt), no_dist=True)
    meta, distcp = (ckpt / ".metadata").read_bytes(), next(ckpt.glob("*.distcp")).read_bytes()
    for which, original in ((".metadata", meta), ("distcp", distcp)):
        for k, (name, bad) in enumerate(_mutations(original, seed=13)):
            d = tmp_path / f"dcp-{which.strip('.')}-{k}"
            d.mkdir()
            (d / ".metadata").write_bytes(bad if which == ".metadata" else meta)
            (d / next(ckpt.glob("*.distcp")).name).write_bytes(bad if which == "distcp" else distcp)
            outcomes[f"dcp-{which.strip('.')}:{_load_case(d)}"] += 1
    n = sum(outcomes.values())
    COUNTS["checkpoints"] += n
    print(f"\nfuzz checkpoints: {n} cases {dict(sorted(outcomes.items()))}")
    assert outcomes["safetensors:refused"] >= 20 and outcomes["dcp-metadata:refused"] >= 10


@pytest.fixture
def marker_free(tmp_path):
    m = tmp_path / "PWNED"
    yield m
    assert not m.exists()


# -- configs ---------------------------------------------------------------------------------------------------


def _yaml_cases(marker: Path) -> list[tuple[str, str]]:
    cmd = f"touch {marker}"
    laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefg", "bcdefgh"))
    return [
        ("apply", f"model:\n  name: !!python/object/apply:os.system ['{cmd}']\n"),
        ("apply-top", f"!!python/object/apply:os.system ['{cmd}']\n"),
        ("new", f"model: !!python/object/new:os.system ['{cmd}']\n"),
        ("name", "model:\n  name: !!python/name:os.system\n"),
        ("module", "model:\n  name: !!python/module:os\n"),
        ("object", "model: !!python/object:collections.OrderedDict {}\n"),
        ("subprocess", f"train: !!python/object/apply:subprocess.check_output [['sh', '-c', '{cmd}']]\n"),
        ("tuple", "model:\n  name: !!python/tuple [a, b]\n"),
        ("billion-laughs", laughs),
        ("deep-nesting", "model: " + "[" * 5000 + "]" * 5000 + "\n"),
        ("binary", "model:\n  name: !!binary aGVsbG8=\n"),
        ("not-a-mapping", "- a\n- b\n"),
        ("tab-indent", "model:\n\tname: x\n"),
        ("bad-utf8", "model:\n  name: \udcff\n"),
    ]


def test_yaml_configs_that_construct_objects_are_refused(tmp_path, marker_free):
    from dinopipe.app.cli import main as cli_main
    from dinopipe.ssl.config import PretrainConfig

    cases = _yaml_cases(marker_free)
    for k, (name, text) in enumerate(cases):
        f = tmp_path / f"c{k}.yaml"
        f.write_bytes(text.encode("utf-8", "surrogateescape"))
        t = time.perf_counter()
        with pytest.raises(ConfigError):
            load_config(PretrainConfig, f)
        assert time.perf_counter() - t < SLOW_CASE_S, name
    overrides = [f"model.name=!!python/object/apply:os.system ['touch {marker_free}']",
                 "model.name=!!python/name:os.system", f"train=!!python/object/new:os.system ['touch {marker_free}']"]
    for item in overrides:
        with pytest.raises(ConfigError):
            load_config(PretrainConfig, None, [item])
    with pytest.raises(SystemExit) as exit_:  # the command line: exit 2, before anything is written
        cli_main(["config", "--kind", "model", "--config", str(tmp_path / "c0.yaml")])
    assert exit_.value.code == 2
    COUNTS["yaml"] += len(cases) + len(overrides) + 1
    print(f"\nfuzz yaml: {len(cases) + len(overrides) + 1} cases, all refused")


def test_zz_count(capsys):
    """Runs last in this file: the total the reliability page quotes."""
    total = sum(COUNTS.values())
    line = f"fuzz total: {total} cases " + json.dumps(dict(sorted(COUNTS.items())))
    with capsys.disabled():
        print("\n" + line)
    if os.environ.get("DINOPIPE_FUZZ_COUNTS"):
        Path(os.environ["DINOPIPE_FUZZ_COUNTS"]).write_text(json.dumps({"total": total, **COUNTS}) + "\n")
    if len(COUNTS) == 5:  # the whole file ran
        assert total > 500

