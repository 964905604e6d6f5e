"""COCO-format detection data and its metrics, for ``dinopipe eval detect``.

A set is one COCO instances JSON (``images``, ``annotations`` with ``bbox`` [x, y, w, h] and optional
``segmentation`` polygons / RLE, ``categories``); ``file_name`` is relative to the JSON's folder or to
``--images``. Categories map to contiguous detector labels 1..K (0 is torchvision's background) and back to
their COCO ids in the results. mAP is pycocotools' COCOeval (the ``detect`` extra), never a re-implementation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .data import LabelError


def _pycocotools():
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
        import pycocotools.mask as mask_utils
    except ImportError as exc:  # an optional extra: say how to get it
        raise LabelError("dinopipe eval detect needs pycocotools: pip install 'dinopipe[detect]'") from exc
    return COCO, COCOeval, mask_utils


@dataclass
class CocoSet:
    json_path: Path
    root: Path  # folder file_name is relative to
    coco: object  # pycocotools.coco.COCO
    cat_ids: list[int]  # label i+1 <-> COCO category cat_ids[i]
    image_ids: list[int]

    def __len__(self) -> int:
        return len(self.image_ids)

    def path(self, image_id: int) -> Path:
        return self.root / self.coco.imgs[image_id]["file_name"]


def open_coco(json_path: str | Path, images: Optional[str | Path] = None,
              cat_ids: Optional[list[int]] = None) -> CocoSet:
    """Read and check a COCO JSON (exit-2 errors name the file); ``cat_ids`` pins val to train's categories."""
    COCO, _, _ = _pycocotools()
    json_path = Path(json_path)
    try:
        d = json.loads(json_path.read_text())
    except FileNotFoundError:
        raise LabelError(f"{json_path}: no such COCO JSON") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LabelError(f"{json_path}: not a JSON file ({exc})") from None
    if not isinstance(d, dict) or not all(isinstance(d.get(k), list) for k in ("images", "annotations", "categories")):
        raise LabelError(f"{json_path}: a COCO JSON needs lists 'images', 'annotations' and 'categories'")
    if not d["images"] or not d["categories"]:
        raise LabelError(f"{json_path}: no images or no categories")
    root = Path(images) if images else json_path.parent
    missing = [im["file_name"] for im in d["images"] if not (root / im["file_name"]).is_file()]
    if missing:
        raise LabelError(f"{json_path}: {len(missing)} image file(s) not found under {root}, e.g. {missing[:3]}")
    bad = [a.get("id") for a in d["annotations"] if len(a.get("bbox", [])) != 4 or a["bbox"][2] < 0 or a["bbox"][3] < 0]
    if bad:
        raise LabelError(f"{json_path}: annotation(s) {bad[:3]} without a valid bbox [x, y, w, h]")
    own = sorted(c["id"] for c in d["categories"])
    if cat_ids is not None and not set(own) <= set(cat_ids):
        raise LabelError(f"{json_path}: categories {sorted(set(own) - set(cat_ids))} are not in the train JSON")
    for a in d["annotations"]:
        a.setdefault("area", a["bbox"][2] * a["bbox"][3])
        a.setdefault("iscrowd", 0)
    coco = COCO()
    coco.dataset = d
    coco.createIndex()
    return CocoSet(json_path, root, coco, cat_ids or own, sorted(coco.imgs))


class CocoTrainSet(torch.utils.data.Dataset):
    """(image (3, H, W) in [0, 1], target {boxes xyxy, labels 1..K[, masks (N, H, W) uint8]}), flipped at random."""

    def __init__(self, data: CocoSet, masks: bool = False, flip: bool = True) -> None:
        self.data, self.masks, self.flip = data, masks, flip
        self.label = {c: i + 1 for i, c in enumerate(data.cat_ids)}

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[Tensor, dict]:
        image_id = self.data.image_ids[i]
        img = Image.open(self.data.path(image_id)).convert("RGB")
        x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255
        anns = [a for a in self.data.coco.imgToAnns[image_id] if not a["iscrowd"] and a["bbox"][2] > 1
                and a["bbox"][3] > 1]
        boxes = torch.tensor([[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]]
                              for a in anns], dtype=torch.float32).reshape(-1, 4)
        t = {"boxes": boxes, "labels": torch.tensor([self.label[a["category_id"]] for a in anns], dtype=torch.int64)}
        if self.masks:
            ms = [self.data.coco.annToMask(a) for a in anns]
            t["masks"] = torch.from_numpy(np.stack(ms)) if ms else torch.zeros((0, *x.shape[-2:]), dtype=torch.uint8)
        if self.flip and torch.rand(()) < 0.5:
            W = x.shape[-1]
            x = x.flip(-1)
            t["boxes"] = torch.stack([W - boxes[:, 2], boxes[:, 1], W - boxes[:, 0], boxes[:, 3]], 1)
            if self.masks:
                t["masks"] = t["masks"].flip(-1)
        return x, t


def collate(batch):
    return [b[0] for b in batch], [b[1] for b in batch]


def to_coco_results(image_id: int, det: dict, cat_ids: list[int]) -> list[dict]:
    """torchvision detections (xyxy boxes, labels 1..K, scores[, masks (N, 1, H, W) probabilities]) -> COCO
    results rows (bbox [x, y, w, h]; ``segmentation`` as RLE where masks are given)."""
    boxes = det["boxes"].tolist()
    rows = [{"image_id": int(image_id), "category_id": int(cat_ids[int(lab) - 1]),
             "bbox": [round(b[0], 3), round(b[1], 3), round(b[2] - b[0], 3), round(b[3] - b[1], 3)],
             "score": round(float(s), 5)}
            for b, lab, s in zip(boxes, det["labels"].tolist(), det["scores"].tolist())]
    if "masks" in det:
        _, _, mask_utils = _pycocotools()
        for row, m in zip(rows, det["masks"]):
            rle = mask_utils.encode(np.asfortranarray((m[0] > 0.5).numpy().astype(np.uint8)))
            rle["counts"] = rle["counts"].decode("ascii")
            row["segmentation"] = rle
    return rows


def coco_metrics(gt: CocoSet, results: list[dict], iou_types: tuple[str, ...] = ("bbox",)) -> dict:
    """pycocotools COCOeval: {type}_AP, _AP50, _AP75, _APs, _APm, _APl (0.0 where nothing was predicted)."""
    _, COCOeval, _ = _pycocotools()
    out = {}
    names = ("AP", "AP50", "AP75", "APs", "APm", "APl")
    for kind in iou_types:
        rows = [r for r in results if kind == "bbox" or "segmentation" in r]
        if not rows:
            out.update({f"{kind}_{n}": 0.0 for n in names})
            continue
        # copies (loadRes adds keys); for segm the bbox goes, so areas come from the masks (as detectron2 does)
        dt = gt.coco.loadRes([{k: v for k, v in r.items() if kind == "bbox" or k != "bbox"} for r in rows])
        ev = COCOeval(gt.coco, dt, kind)
        ev.params.imgIds = gt.image_ids
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
        # -1 means "no ground truth in that area range": reported as None, not as a score
        out.update({f"{kind}_{n}": (None if v < 0 else round(float(v), 6)) for n, v in zip(names, ev.stats[:6])})
    return out


__all__ = ["CocoSet", "open_coco", "CocoTrainSet", "collate", "to_coco_results", "coco_metrics"]
