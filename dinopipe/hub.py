"""Loading backbones from anywhere (the writers are in ``dinopipe.export`` and re-exported here).

``load()`` accepts: a dinopipe export folder or run directory (pretraining: the teacher; distillation: the
student you name), a run's DCP checkpoint folder (``RUN/checkpoints/step_N``, read in one process without
torch.distributed being initialised), a ``.safetensors`` file, an official DINOv2 or DINOv3 ``.pth`` (hub or
training checkpoint), a timm DINOv2/DINOv3 state dict or timm ``local-dir`` folder, a Hugging Face
``Dinov2Model`` / ``Dinov2WithRegistersModel`` / ``DINOv3ViTModel`` folder, or a registry name (random init).
Files are read with ``torch.load(weights_only=True)`` or safetensors: a checkpoint that needs arbitrary
pickled objects is refused, because unpickling can run code.
"""

from __future__ import annotations

import json
import logging
import pickle
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from safetensors.torch import load_file, safe_open
from torch import Tensor

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
    read_sidecar,
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
from .models.registry import build_vit, list_models, model_defaults
from .models.vit import DinoVisionTransformer

log = logging.getLogger(__name__)



class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message says why and what to do."""


# -- reading ------------------------------------------------------------------------------------------


def read_checkpoint(path: str | Path) -> tuple[Any, Optional[dict]]:
    """(raw object, arch dict if the file carries one) from a .safetensors or torch file."""
    path = Path(path)
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        arch = json.loads(meta[ARCH_METADATA_KEY]) if ARCH_METADATA_KEY in meta else None
        return load_file(str(path)), arch
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: refusing to load a checkpoint that needs arbitrary pickled objects (unpickling can run "
            f"code). If you trust the file, re-save only its tensors: torch.save(ckpt['model'], 'weights.pth'). "
            f"Detail: {str(exc).splitlines()[0]}"
        ) from None
    arch = obj.get("arch") if isinstance(obj, Mapping) and isinstance(obj.get("arch"), Mapping) else None
    return obj, dict(arch) if arch else None


HF_MODEL_TYPES = ("dinov2", "dinov2_with_registers", "dinov3_vit")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _hf_shards(d: Path) -> Optional[list[Path]]:
    """Files of a (possibly sharded) Hugging Face safetensors checkpoint in folder ``d``."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return [d / f for f in sorted(set(_read_json(index)["weight_map"].values()))]
    return [d / WEIGHTS_NAME] if (d / WEIGHTS_NAME).is_file() else None


def _students(run: Path) -> list[str]:
    export = run / "export"
    return sorted(p.name for p in export.iterdir() if (p / WEIGHTS_NAME).is_file()) if export.is_dir() else []


def _resolve_path(path: Path, which: Optional[str] = None) -> tuple[list[Path], Optional[dict], dict]:
    """A file or folder -> (weights files, dinopipe arch if recorded, HF config.json if an HF folder).

    Run directories: ``export/teacher`` (pretraining), ``export/NAME`` (distillation: the student named by
    ``which``, or the only one), else the latest DCP checkpoint (handled by the caller).
    """
    if path.is_file():
        return [path], read_sidecar(path), {}  # an official-layout export's FILE.json records its architecture
    if not path.is_dir():
        raise CheckpointError(f"'{path}' is neither a file, a folder nor a registry name ({', '.join(list_models())})")
    subs = ["", "export/teacher", "export"]
    students = _students(path)
    if which and which not in ("teacher", "student"):
        if which not in students:
            raise CheckpointError(f"'{path}': no exported student '{which}' (exported: {students or 'none'})")
        subs = [f"export/{which}"]
    elif not (path / "export" / "teacher").is_dir() and len(students) == 1:
        subs.append(f"export/{students[0]}")
    for sub in subs:
        d = path / sub if sub else path
        files = _hf_shards(d)
        if files:
            cfg = _read_json(d / CONFIG_NAME)
            arch = cfg.get("arch") if cfg.get("format") == EXPORT_FORMAT else None
            if cfg.get("model_type") in HF_MODEL_TYPES or isinstance(cfg.get("model_args"), Mapping):
                return files, arch, cfg  # Hugging Face config, or a timm folder's (its model_args give the heads)
            return files, arch, {}
    if len(students) > 1 and not (path / "export" / "teacher").is_dir() and not which:
        raise CheckpointError(f"'{path}' is a distillation run with students {students}: pass which=NAME "
                              f"(dinopipe export --which NAME) to pick one")
    raise CheckpointError(f"'{path}': no {WEIGHTS_NAME} in the folder, export/teacher/ or export/, and no DCP checkpoint")


# -- DCP checkpoints (RUN/checkpoints/step_N) --------------------------------------------------------------


def _dcp_dir(path: Path, which: Optional[str] = None) -> Optional[Path]:
    """A DCP checkpoint folder for ``path``: itself, or a run directory's latest checkpoint when the run has no
    export yet or a raw student is asked for (exports hold the teacher / EMA weights only)."""
    if (path / ".metadata").is_file():
        return path
    pointer = path / "checkpoints" / "latest"
    wants_student = bool(which) and (which == "student" or which.startswith("student."))
    if pointer.is_file() and (wants_student or not (path / "export").is_dir()):
        ckpt = path / "checkpoints" / pointer.read_text().strip()
        if (ckpt / ".metadata").is_file():
            return ckpt
    return None


def _pick_dcp_state(names: list[str], which: Optional[str], where: Path) -> str:
    """Which saved module to read: pretraining saves 'teacher'/'student', distillation 'ema.NAME'/'student.NAME'."""
    students = sorted(n.split(".", 1)[1] for n in names if n.startswith("ema."))
    if which in (None, "teacher") and "teacher" in names:
        return "teacher"
    if which == "student" and "student" in names:
        return "student"
    if which in names:
        return which
    if which and f"ema.{which}" in names:
        return f"ema.{which}"  # the EMA of a student, which is what distillation exports
    if which in (None, "teacher", "student") and len(students) == 1:
        return (f"student.{students[0]}" if which == "student" else f"ema.{students[0]}")
    if students:
        raise CheckpointError(f"{where}: a distillation checkpoint with students {students}: pass which=NAME (its EMA, "
                              f"as exported) or which='student.NAME' (the raw student)")
    raise CheckpointError(f"{where}: no backbone '{which}' in this checkpoint (it holds {names})")


def _flatten(d: Mapping, prefix: str = "") -> dict[str, Tensor]:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_dcp_backbone(path: Path, which: Optional[str] = None) -> tuple[dict[str, Tensor], str]:
    """(backbone state dict, state name) from a DCP folder, in this process, without a process group."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import (
        _load_state_dict_from_keys,
    )

    keys = list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    marker = ".model.backbone."
    names = sorted({k.split(marker, 1)[0] for k in keys if marker in k})
    if not names:
        raise CheckpointError(f"{path}: a DCP checkpoint without backbone weights (keys like {keys[:3]})")
    name = _pick_dcp_state(names, which, path)
    want = {k for k in keys if k.startswith(name + marker)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")  # exactly what we want here
        loaded = _flatten(_load_state_dict_from_keys(keys=want, checkpoint_id=str(path)))
    prefix = name + marker
    return {k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)}, name


def _run_arch(ckpt: Path, state: str) -> Optional[dict]:
    """Exact architecture from the run's resolved config.yaml (RUN/checkpoints/step_N -> RUN/config.yaml)."""
    from omegaconf import OmegaConf

    cfg_file = ckpt.parent.parent / "config.yaml"
    if not cfg_file.is_file():
        return None
    cfg = OmegaConf.to_container(OmegaConf.load(cfg_file), resolve=True)
    model = cfg.get("model")
    if "." in state and isinstance(cfg.get("students"), list):  # distillation: students[i].model
        student = state.split(".", 1)[1]
        model = next((s.get("model") for s in cfg["students"] if s.get("name") == student), None)
    if not isinstance(model, Mapping) or model.get("pretrained") or model.get("name") not in list_models():
        return None
    from .config import ModelConfig

    kwargs = ModelConfig(**{k: v for k, v in model.items() if k in ModelConfig.__dataclass_fields__}).create_kwargs()
    return {**model_defaults(model["name"]), **kwargs}


def _read_backbone(path: Path, num_heads: Optional[int], which: Optional[str]
                   ) -> tuple[dict, dict, Path, Optional[int]]:
    """(canonical state dict, architecture kwargs the file records or its shapes imply, file read, head count
    given or found in a timm folder's config)."""
    dcp_dir = _dcp_dir(path, which) if path.is_dir() else None
    file_arch, hf_cfg = None, {}
    if dcp_dir is not None:
        obj, state = read_dcp_backbone(dcp_dir, which)
        file, file_arch = dcp_dir, _run_arch(dcp_dir, state)
    else:
        files, file_arch, hf_cfg = _resolve_path(path, which)
        file = files[0]
        obj = {}
        for f in files:
            part, part_arch = read_checkpoint(f)
            obj = part if len(files) == 1 else {**obj, **part}
            file_arch = file_arch or part_arch
    if not num_heads and isinstance(hf_cfg.get("model_args"), Mapping):
        num_heads = hf_cfg["model_args"].get("num_heads")
    hf_cfg = hf_cfg if hf_cfg.get("model_type") in HF_MODEL_TYPES else {}
    try:
        # a recorded architecture tells the head count the shapes cannot
        heads = num_heads or (file_arch or {}).get("num_heads")
        sd, inferred = convert_checkpoint(obj, num_heads=heads, hf_config=hf_cfg or None)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{file}: {exc}") from None
    return sd, dict(file_arch or inferred), file, num_heads


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
    if name in list_models() and not Path(name).exists():
        from .models.registry import create_model

        log.warning("dinopipe.load('%s'): a registry name, so the weights are randomly initialised", name)
        return create_model(name, **overrides).to(device).eval()
    sd, kwargs, file, num_heads = _read_backbone(Path(path_or_name), num_heads, which)
    kwargs.update(arch or {})
    if num_heads:
        kwargs["num_heads"] = num_heads
    kwargs.update(overrides)
    model = build_vit(**kwargs)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "mask_token"]  # timm files carry none; it only matters for iBOT
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{file}: weights do not fit the architecture {kwargs}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model.to(device).eval()


def _heads_file(path: Path) -> Optional[Path]:
    for cand in (path / "export" / "teacher" / HEADS_NAME, path / HEADS_NAME):
        if cand.is_file():
            return cand
    return None


def has_heads(path: str | Path) -> bool:
    """Whether a pretraining run / export carries its DINO heads (file metadata only, nothing is loaded)."""
    path = Path(path)
    return path.is_dir() and _heads_file(path) is not None


def load_heads(path: str | Path) -> dict[str, dict[str, Tensor]]:
    """{'dino_head': sd, 'ibot_head': sd} exported next to a pretraining run's teacher ({} for a bare backbone)."""
    path = Path(path)
    hf = _heads_file(path) if path.is_dir() else None
    if hf is None:
        return {}
    sd = load_file(str(hf))
    heads = {}
    for name in ("dino_head", "ibot_head"):
        part = {k[len(name) + 1:]: v for k, v in sd.items() if k.startswith(name + ".")}
        if part:
            heads[name] = part
    return heads


def backbone_arch(path_or_name: str | Path, num_heads: Optional[int] = None, which: Optional[str] = None
                  ) -> dict[str, Any]:
    """The architecture kwargs ``load`` would build (patch size, width, ...) without building the model."""
    name = str(path_or_name)
    if name in list_models() and not Path(name).exists():
        return model_defaults(name)
    path = Path(path_or_name)
    if path.is_dir() and _dcp_dir(path, which) is None:  # an export folder records its arch: skip the weights
        file_arch = _resolve_path(path, which)[1]
        if file_arch:
            return {**file_arch, **({"num_heads": num_heads} if num_heads else {})}
    _, kwargs, _, num_heads = _read_backbone(Path(path_or_name), num_heads, which)
    if num_heads:
        kwargs["num_heads"] = num_heads
    return kwargs


# Writers live in dinopipe/export (imported above, so ``hub.save_backbone``, ``hub.export(...)`` keep working).
__all__ = [
    "load", "load_heads", "has_heads", "backbone_arch", "read_checkpoint", "read_dcp_backbone", "CheckpointError",
    "save_backbone", "save_heads", "export", "export_arch", "export_timm", "export_dinov2", "export_dinov3",
    "export_hf",
]
