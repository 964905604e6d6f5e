"""Loading backbones from anywhere (the writers are in ``dinopipe.export`` and re-exported here).

``load()`` accepts: a dinopipe export folder or run directory (pretraining: the teacher; distillation: the
student you name), a run's DCP checkpoint folder (``RUN/checkpoints/step_N``, read in one process without
torch.distributed being initialised), a ``.safetensors`` file, an official DINOv2 or DINOv3 ``.pth`` (hub or
training checkpoint), a timm DINOv2/DINOv3 state dict or timm ``local-dir`` folder, a Hugging Face
``Dinov2Model`` / ``Dinov2WithRegistersModel`` / ``DINOv3ViTModel`` folder, or a registry name (random init).
Nothing is unpickled: each format has a pure reader (``dinopipe/export/readers.py``, chosen by what the path
holds) that reads safetensors, ``torch.load(weights_only=True)`` (memory-mapped) or DCP metadata through a
restricted unpickler (``dinopipe/utils/safe_load.py``); a file that needs arbitrary objects is refused with
:class:`UnsafeCheckpointError`, naming it, because unpickling can run code.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn

from .export import (  # noqa: F401
    ARCH_METADATA_KEY,
    CONFIG_NAME,
    EXPORT_FORMAT,
    EXPORTERS,
    HEADS_NAME,
    IMAGENET_MEAN,
    IMAGENET_STD,
    WEIGHTS_NAME,
    export,
    export_arch,
    export_dinov2,
    export_dinov3,
    export_hf,
    export_timm,
    save_backbone,
    save_heads,
)
from .models.convert import (  # noqa: F401  (reachable as hub.*)
    convert_checkpoint,
    infer_arch,
    timm_model_args,
    to_dinov2,
    to_timm,
)
from .models.convert_dinov3 import (  # noqa: F401
    timm_dinov3_model_args,
    to_official_dinov3,
    to_timm_dinov3,
)
from .export import readers
from .export.readers import HF_MODEL_TYPES, read_dcp_backbone, read_weights_file
from .models.registry import build_vit, list_models, model_defaults
from .models.timm_backbone import from_timm_keys, is_timm_name
from .models.vit import DinoVisionTransformer
from .utils.lazy_rows import lazy_cat
from .utils.norm import in_channels, set_input_norm
from .utils.safe_load import CheckpointError, UnsafeCheckpointError, read_safetensors, read_safetensors_header
from .utils.storage import is_url
from .utils.run_layout import TrainLayout

log = logging.getLogger(__name__)


# -- reading: one reader per format (dinopipe/export/readers.py), none of which unpickles --------------------


def read_checkpoint(path: str | Path) -> tuple[Any, Optional[dict]]:
    """(raw object, arch dict if the file carries one) from a .safetensors or torch file (weights_only=True)."""
    return read_weights_file(Path(path))


def _read_backbone(path: Path, num_heads: Optional[int], which: Optional[str]
                   ) -> tuple[dict, dict, Path, Optional[int]]:
    """(canonical state dict, architecture kwargs the file records or its shapes imply, file read, head count
    given or found in a timm folder's config). Nothing is converted or read in full here: files are memory-mapped,
    packed tensors (q/k/v, SwiGLU halves) and a DCP folder's large tensors are :class:`LazyRows` that read only
    the rows asked for, so a rank copying its shard (``train/meta_init.py``) reads 1/W of each, and reading the
    architecture costs no weights."""
    found = readers.read(path, which, lazy=True)
    num_heads = num_heads or found.num_heads
    hf_cfg = found.hf_config if found.hf_config.get("model_type") in HF_MODEL_TYPES else {}
    if (found.arch or {}).get("family") == "timm":  # a timm student: timm's own keys, nothing to convert
        return from_timm_keys(dict(found.obj)), dict(found.arch), found.file, None
    try:
        # a recorded architecture tells the head count the shapes cannot
        heads = num_heads or (found.arch or {}).get("num_heads")
        sd, inferred = convert_checkpoint(found.obj, num_heads=heads, hf_config=hf_cfg or None, cat=lazy_cat)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{found.file}: {exc}") from None
    return sd, dict(found.arch or inferred), found.file, num_heads


def local_path(path_or_name: str | Path, which: Optional[str] = None) -> Path:
    """``path_or_name`` as a local path; a bucket URL (``s3://...``) is fetched first into a local cache folder
    (dinopipe/export/remote.py: only what reading needs, under the store's fault rule) and read from there."""
    if is_url(str(path_or_name)):
        from .export.remote import fetch

        return fetch(str(path_or_name), which)
    return Path(path_or_name)


def load(
    path_or_name: str | Path,
    arch: Optional[Mapping[str, Any]] = None,
    device: str | torch.device = "cpu",
    num_heads: Optional[int] = None,
    strict: bool = True,
    which: Optional[str] = None,
    **overrides: Any,
) -> DinoVisionTransformer:
    """A ready backbone in eval mode.

    ``arch`` (constructor kwargs) overrides what the file says or what shapes imply; ``num_heads`` is needed
    only for foreign files whose head count neither the file nor a config tells. ``which`` picks a backbone
    of a run: 'teacher' (default) or 'student' of a pretraining run, a student's name in a distillation run
    (its EMA, as exported; 'student.NAME' for the raw student in a DCP checkpoint). ``overrides`` (e.g.
    ``attn_backend='sdpa'``, ``drop_path_rate``) change run-time behaviour, not weights.
    """
    name = str(path_or_name)
    if _is_head_folder(Path(name)):  # backbone + a trained dense head: a model that predicts
        import importlib  # the eval layer's loader, resolved at call time (hub stays below eval, as an entry point)

        return importlib.import_module("dinopipe.eval.head_io").load_head_model(name, device=device)
    if (name in list_models() or is_timm_name(name)) and not Path(name).exists():
        from .models.registry import create_model

        log.warning("dinopipe.load('%s'): a registry name, so the weights are randomly initialised", name)
        try:
            return create_model(name, **overrides).to(device).eval()
        except ValueError as exc:  # an unknown timm:NAME
            raise CheckpointError(str(exc)) from None
    with torch.device("cpu"):  # the file's tensors are real even while a caller builds on meta (train/meta_init.py)
        sd, kwargs, file, num_heads = _read_backbone(local_path(path_or_name, which), num_heads, which)
    kwargs.update(arch or {})
    if num_heads:
        kwargs["num_heads"] = num_heads
    kwargs.update(overrides)
    try:  # what a file records is input too: a forged architecture is the file's error, not a crash
        model = build_vit(**kwargs)
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{file}: cannot build the architecture it records or implies ({exc})") from None
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError as exc:  # shapes that do not fit (strict=False still checks them)
        raise CheckpointError(f"{file}: weights do not fit the architecture {kwargs}: "
                              f"{str(exc).splitlines()[-1].strip()[:300]}") from None
    missing = [k for k in missing if k != "mask_token"]  # timm files carry none; it only matters for iBOT
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{file}: weights do not fit the architecture {kwargs}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    _recorded_norm(model, Path(file))
    return model.to(device).eval()


def _is_head_folder(path: Path) -> bool:
    """A folder ``dinopipe.eval.head_io.save_head`` wrote (config.json format ``dinopipe-head/N``)."""
    try:
        cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and str(cfg.get("format", "")).startswith("dinopipe-head/")


def _recorded_norm(model: nn.Module, file: Path) -> None:
    """An export's per-channel statistics onto the model (a dinopipe folder's config.json mean / std, a timm
    folder's pretrained_cfg, a Hugging Face folder's preprocessor_config.json), so exports made from it and
    evals of it use them (utils/norm.py:input_norm)."""
    folder = file if file.is_dir() else file.parent
    mean, std = None, None
    for name, keys in ((CONFIG_NAME, None), ("preprocessor_config.json", ("image_mean", "image_std"))):
        try:
            cfg = json.loads((folder / name).read_text()) if (folder / name).is_file() else {}
        except (OSError, ValueError):
            continue
        if not isinstance(cfg, dict):
            continue
        if keys is not None:  # a Hugging Face folder's preprocessor
            mean, std = cfg.get(keys[0]), cfg.get(keys[1])
        elif cfg.get("format") == EXPORT_FORMAT:  # a dinopipe folder
            mean, std = cfg.get("mean"), cfg.get("std")
        elif isinstance(cfg.get("pretrained_cfg"), dict):  # a timm folder
            mean, std = cfg["pretrained_cfg"].get("mean"), cfg["pretrained_cfg"].get("std")
        if mean is not None:
            break
    n = in_channels(model)
    if isinstance(mean, list) and isinstance(std, list) and len(mean) == len(std) == n:
        try:
            set_input_norm(model, mean, std)
        except (TypeError, ValueError):  # not numbers: the file's problem, ignore the record
            pass


def _heads_file(path: Path) -> Optional[Path]:
    for cand in (TrainLayout(path).export("teacher") / HEADS_NAME, path / HEADS_NAME):
        if cand.is_file():
            return cand
    return None


def has_heads(path: str | Path) -> bool:
    """Whether a pretraining run / export carries its DINO heads (file metadata only, nothing is loaded)."""
    path = Path(path)
    return path.is_dir() and _heads_file(path) is not None


def load_heads(path: str | Path) -> dict[str, dict[str, Tensor]]:
    """{'dino_head': sd, 'ibot_head': sd} exported next to a pretraining run's teacher, or its EMA teacher's heads
    in a DCP checkpoint folder ({} for a bare backbone)."""
    path = Path(path)
    hf = _heads_file(path) if path.is_dir() else None
    if hf is None:
        if not (path / ".metadata").is_file():
            return {}
        with torch.device("cpu"):  # real tensors even under a meta default device (train/meta_init.py)
            return _dcp_heads(path)
    sd, _ = read_safetensors(hf)
    heads = {}
    for name in ("dino_head", "ibot_head"):
        part = {k[len(name) + 1:]: v for k, v in sd.items() if k.startswith(name + ".")}
        if part:
            heads[name] = part
    return heads


def _dcp_heads(path: Path) -> dict[str, dict[str, Tensor]]:
    """The EMA teacher's heads in a pretraining run's DCP checkpoint (RUN/checkpoints/step_N), read without a
    process group or unpickling ({} when it holds none, e.g. a distillation checkpoint)."""
    from .utils import safe_dcp
    from .utils.safe_load import read_dcp_metadata

    md = read_dcp_metadata(path)
    heads = {}
    for name in ("dino_head", "ibot_head"):
        prefix = f"teacher.model.{name}."
        keys = {k for k in md.state_dict_metadata if k.startswith(prefix)}
        if keys:
            heads[name] = {k[len(prefix):]: v for k, v in safe_dcp.read_tensors(path, keys, md=md).items()}
    return heads


def backbone_arch(path_or_name: str | Path, num_heads: Optional[int] = None, which: Optional[str] = None
                  ) -> dict[str, Any]:
    """The architecture kwargs ``load`` would build (patch size, width, ...) without building the model."""
    name = str(path_or_name)
    if name in list_models() and not Path(name).exists():
        return model_defaults(name)
    path_or_name = local_path(path_or_name, which)
    file_arch = readers.recorded_arch(path_or_name, which)  # an export folder records it: skip the weights
    if file_arch:
        return {**file_arch, **({"num_heads": num_heads} if num_heads else {})}
    _, kwargs, _, num_heads = _read_backbone(path_or_name, num_heads, which)
    if num_heads:
        kwargs["num_heads"] = num_heads
    return kwargs


def check_backbone_file(path_or_name: str | Path, num_heads: Optional[int] = None, which: Optional[str] = None
                        ) -> dict[str, Any]:
    """What a training stage checks on every rank before its process group starts or anything is written: the
    path exists, is a format dinopipe reads (none of which unpickles), its architecture is known, and the
    headers of an export folder's weight files are sound (sizes that fit the file). Returns the architecture
    kwargs. An export folder's weights are not read here (headers only); other files are opened memory-mapped and
    their keys converted lazily (packed tensors and a DCP folder's large tensors are ``LazyRows``, nothing is
    read), as ``backbone_arch`` does. Raises :class:`CheckpointError` naming the file."""
    p = local_path(path_or_name, which)
    arch = backbone_arch(p, num_heads, which)
    if p.exists() and readers.recorded_arch(p, which):
        probe = readers.Probe(readers.locate(p, which), which)
        for f in probe.files or []:
            if not f.is_file():
                raise CheckpointError(f"{f}: missing (the export folder {probe.path} lists it)")
            if f.suffix == ".safetensors":
                read_safetensors_header(f)
    return arch


# Writers live in dinopipe/export (imported above, so ``hub.save_backbone``, ``hub.export(...)`` keep working).
__all__ = [
    "load", "local_path", "load_heads", "has_heads", "backbone_arch", "check_backbone_file",
    "read_checkpoint", "read_dcp_backbone", "CheckpointError",
    "UnsafeCheckpointError",
    "save_backbone", "save_heads", "export", "export_arch", "export_timm", "export_dinov2", "export_dinov3",
    "export_hf",
]
