"""Labelled image sets for evaluation: class sub-folders, or webdataset shards with a label per sample.

- A folder whose sub-folders are the classes (``train/cat/1.jpg``; ImageFolder's convention). Images deeper
  down count for their top-level sub-folder; images lying directly in the root have no class and are refused.
- Webdataset ``.tar`` shards (a shard, a glob, or a folder of shards): each image member's sample carries its
  label in a ``.json`` member (key ``label`` or ``cls``) or in a ``.cls`` / ``.label`` text member, joined by
  the webdataset key (member path up to the first dot of its file name).

Class names are strings; integer labels sort numerically. ``val`` is indexed with ``train``'s classes so the
indices agree (a val class never seen in training is refused: no method could predict it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..data.sources import IMAGE_EXTENSIONS, FolderSource, ImageRef, TarShardSource, TarWalk, extension_of

LABEL_JSON_KEYS = ("label", "cls")
LABEL_MEMBER_EXTS = ("cls", "label")


class LabelError(ValueError):
    """A labelled source that cannot be used; the message says what is wrong and how to fix it."""


@dataclass
class LabelledImages:
    """Images (by reference, read on demand), their class indices and the class names."""

    refs: list[ImageRef]
    labels: list[int]
    classes: list[str]
    read: Callable[[ImageRef], Optional[bytes]]
    source: str

    def __len__(self) -> int:
        return len(self.refs)


def _class_sort_key(name: str):
    return (0, int(name), "") if name.lstrip("-").isdigit() else (1, 0, name)


def _index(names: Sequence[str], classes: Optional[Sequence[str]], source: str) -> tuple[list[int], list[str]]:
    if classes is None:
        classes = sorted(set(names), key=_class_sort_key)
    lookup = {c: i for i, c in enumerate(classes)}
    unknown = sorted(set(names) - set(lookup), key=_class_sort_key)
    if unknown:
        raise LabelError(f"{source}: classes {unknown[:10]} do not occur in the training set "
                         f"({len(classes)} classes); train and val must share their class names")
    return [lookup[n] for n in names], list(classes)


def _folder(root: Path, classes: Optional[Sequence[str]]) -> LabelledImages:
    src = FolderSource(root)
    refs, names = [], []
    loose = 0
    for ref in src.refs():
        rel = ref.id.split("/", 1)[1]
        if "/" not in rel:
            loose += 1
            continue
        refs.append(ref)
        names.append(rel.split("/", 1)[0])
    if not refs:
        hint = f" ({loose} images lie directly in it)" if loose else ""
        raise LabelError(f"{root}: no images in class sub-folders{hint}; expected {root}/<class>/<image>")
    if loose:
        raise LabelError(f"{root}: {loose} images lie directly in the folder, outside any class sub-folder; "
                         f"move them into {root}/<class>/ or remove them")
    labels, cls = _index(names, classes, str(root))
    return LabelledImages(refs, labels, cls, src.read, str(root))


def _label_from_member(data: Optional[bytes], ext: str) -> Optional[str]:
    if data is None:
        return None
    text = data.decode("utf-8", errors="replace").strip()
    if ext == "json":
        try:
            meta = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(meta, dict):
            return None
        value = next((meta[k] for k in LABEL_JSON_KEYS if k in meta), None)
        return None if value is None else str(value)
    return text or None


def _shards(spec: str, classes: Optional[Sequence[str]]) -> LabelledImages:
    try:
        src = TarShardSource(spec)
    except (FileNotFoundError, ValueError) as exc:  # missing or compressed shards
        raise LabelError(str(exc)) from None
    refs, names, missing = [], [], 0
    for shard in src.shards:
        images: dict[str, ImageRef] = {}
        labels: dict[str, str] = {}
        walk = TarWalk(shard)
        for m in walk:
            d, base = os.path.split(m.name)
            stem, _, ext = base.partition(".")
            key, ext = f"{d}/{stem}" if d else stem, ext.lower()
            last = extension_of(base)
            if last in IMAGE_EXTENSIONS:
                images[key] = ImageRef(f"{src.name}/{Path(shard).name}/{m.name}", src.name,
                                       (shard, m.offset_data, m.size))
            elif ext in ("json",) + LABEL_MEMBER_EXTS:
                label = _label_from_member(walk.read(m), ext)
                if label is not None and (ext != "json" or key not in labels):
                    labels[key] = label
        if walk.error:  # (a cut-off last image is read short and counted unreadable, as in training)
            raise LabelError(f"{shard}: cannot read the tar shard ({walk.error}); re-create or re-download it")
        for key, ref in images.items():
            if key in labels:
                refs.append(ref)
                names.append(labels[key])
            else:
                missing += 1
    if not refs:
        raise LabelError(f"{spec}: no image in the shards has a label; give each sample a .json member with a "
                         f"'label' (or 'cls') field, or a .cls member")
    if missing:
        raise LabelError(f"{spec}: {missing} images have no label (no .json with 'label'/'cls' and no .cls "
                         f"member under the same key)")
    labels_idx, cls = _index(names, classes, spec)
    return LabelledImages(refs, labels_idx, cls, src.read, spec)


def open_labelled(spec: str | os.PathLike, classes: Optional[Sequence[str]] = None) -> LabelledImages:
    """A class-folder tree or webdataset shards (``.tar`` file, glob, or folder of ``.tar`` files)."""
    s = str(spec)
    p = Path(s)
    if any(c in s for c in "*?[") or s.endswith(".tar"):
        return _shards(s, classes)
    if p.is_dir():
        if any(p.glob("*.tar")) and not any(q.is_dir() for q in p.iterdir()):
            return _shards(s, classes)
        return _folder(p, classes)
    raise LabelError(f"'{s}' does not exist or is neither a folder of class sub-folders nor .tar shards")


__all__ = ["LabelledImages", "LabelError", "open_labelled"]
