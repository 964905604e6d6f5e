"""One reader per checkpoint format ``dinopipe.load`` accepts, chosen by what the path holds; none unpickles.

``locate`` turns a user's path into the thing to read (a run directory into its teacher export, the named
student's export or its latest DCP checkpoint); ``pick`` asks each entry of :data:`FORMATS` in order whether
the located path holds its format; the chosen reader returns the raw tensors, the file it read and the
architecture the file records. Key layouts are converted afterwards by the pure converters of
``dinopipe.models.convert*``.

Every byte comes through :mod:`dinopipe.utils.safe_load` (safetensors, ``torch.load(weights_only=True)``,
memory-mapped) or :mod:`dinopipe.utils.safe_dcp` (DCP metadata through a restricted unpickler), so a file that
would need code to run to be read is refused with its name (:class:`UnsafeCheckpointError`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from ..models.convert import detect_format, unwrap_state_dict
from ..models.registry import list_models, model_defaults
from ..utils.safe_load import CheckpointError, read_safetensors, torch_load
from .backbone import ARCH_METADATA_KEY, CONFIG_NAME, EXPORT_FORMAT, WEIGHTS_NAME, read_sidecar
from ..utils.run_layout import TrainLayout

HF_MODEL_TYPES = ("dinov2", "dinov2_with_registers", "dinov3_vit")


@dataclass
class Found:
    """What a reader found: the raw state dict (or a checkpoint dict holding one) and what the file says."""

    fmt: str
    file: Path
    obj: Any
    arch: Optional[dict] = None  # exact build_vit kwargs the file records
    hf_config: dict = field(default_factory=dict)  # a Hugging Face config.json (its exact architecture)
    num_heads: Optional[int] = None  # a timm folder's model_args


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _hf_shards(d: Path) -> Optional[list[Path]]:
    """Files of a (possibly sharded) safetensors checkpoint in folder ``d``; shard names stay inside ``d``."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        bad = [n for n in names if not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..")]
        if bad or not names:
            raise CheckpointError(f"{index}: shard names {bad or names} are not plain file names in the folder")
        return [d / n for n in names]
    return [d / WEIGHTS_NAME] if (d / WEIGHTS_NAME).is_file() else None


class Probe:
    """A located file or folder and what has been read of it so far (each file is read at most once)."""

    def __init__(self, path: Path, which: Optional[str] = None, lazy: bool = False) -> None:
        self.path, self.which, self.lazy = path, which, lazy

    @cached_property
    def config(self) -> dict:
        return _read_json(self.path / CONFIG_NAME) if self.path.is_dir() else {}

    @cached_property
    def files(self) -> Optional[list[Path]]:
        return _hf_shards(self.path) if self.path.is_dir() else [self.path]

    @cached_property
    def weights(self) -> tuple[Any, Optional[dict]]:
        """(tensors or checkpoint object, arch recorded in the file) of all files, merged."""
        obj: Any = {}
        arch = None
        files = self.files or []
        for f in files:
            part, part_arch = read_weights_file(f)
            obj = part if len(files) == 1 else {**obj, **part}
            arch = arch or part_arch
        return obj, arch

    @cached_property
    def layout(self) -> Optional[str]:
        """The key layout of a weights file ('dinov3', 'dinov2', 'timm', ...; see ``detect_format``)."""
        try:
            return detect_format(unwrap_state_dict(self.weights[0]))
        except ValueError:
            return None


def read_weights_file(path: Path) -> tuple[Any, Optional[dict]]:
    """(raw object, arch dict if the file carries one) from a .safetensors or torch file."""
    if path.suffix == ".safetensors":
        tensors, meta = read_safetensors(path)
        try:
            arch = json.loads(meta[ARCH_METADATA_KEY]) if ARCH_METADATA_KEY in meta else None
        except ValueError:
            raise CheckpointError(f"{path}: the '{ARCH_METADATA_KEY}' metadata is not valid JSON") from None
        return tensors, arch if isinstance(arch, dict) else None
    obj = torch_load(path)  # weights_only=True, memory-mapped: a released .pth is not copied whole
    arch = obj.get("arch") if isinstance(obj, Mapping) and isinstance(obj.get("arch"), Mapping) else None
    return obj, dict(arch) if arch else None


# -- DCP checkpoints (RUN/checkpoints/step_N) --------------------------------------------------------------


def dcp_dir(path: Path, which: Optional[str] = None) -> Optional[Path]:
    """A DCP checkpoint folder for ``path``: itself, or a run directory's latest checkpoint when the run has no
    export yet or a raw student is asked for (exports hold the teacher / EMA weights only)."""
    if (path / ".metadata").is_file():
        return path
    pointer = TrainLayout(path).latest
    wants_student = bool(which) and (which == "student" or which.startswith("student."))
    if pointer.is_file() and (wants_student or not TrainLayout(path).export().is_dir()):
        name = pointer.read_text(errors="replace").strip()
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{pointer}: names '{name}', not a checkpoint folder next to it")
        ckpt = TrainLayout(path).checkpoints / name
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


_BACKBONE = ".model.backbone."


def read_dcp_backbone(path: Path, which: Optional[str] = None, lazy: bool = False) -> tuple[dict[str, Any], str]:
    """(backbone state dict, state name) from a DCP folder, in this process, without a process group; ``lazy``:
    large tensors are read when sliced (``safe_dcp.lazy_tensors``), so a rank reads only its shard."""
    from ..utils import safe_dcp
    from ..utils.safe_load import read_dcp_metadata

    md = read_dcp_metadata(path)
    keys = list(md.state_dict_metadata)
    names = sorted({k.split(_BACKBONE, 1)[0] for k in keys if _BACKBONE in k})
    if not names:
        raise CheckpointError(f"{path}: a DCP checkpoint without backbone weights (keys like {keys[:3]})")
    name = _pick_dcp_state(names, which, path)
    prefix = name + _BACKBONE
    read = safe_dcp.lazy_tensors if lazy else safe_dcp.read_tensors
    loaded = read(path, {k for k in keys if k.startswith(prefix)}, md=md)
    return {k[len(prefix):]: v for k, v in loaded.items()}, name


def _run_arch(ckpt: Path, state: str) -> Optional[dict]:
    """Exact architecture from the run's resolved config.yaml (RUN/checkpoints/step_N -> RUN/config.yaml)."""
    from omegaconf import OmegaConf  # its YAML loader is a safe one: tags that construct objects are refused

    cfg_file = TrainLayout(ckpt.parent.parent).config
    if not cfg_file.is_file():
        return None
    try:
        cfg = OmegaConf.to_container(OmegaConf.load(cfg_file), resolve=True)
    except Exception as exc:  # omegaconf/yaml raise many kinds; the run's config is only a hint
        raise CheckpointError(f"{cfg_file}: cannot read the run's config ({type(exc).__name__}: {exc})") from None
    model = cfg.get("model") if isinstance(cfg, dict) else None
    if "." in state and isinstance(cfg.get("students"), list):  # distillation: students[i].model
        student = state.split(".", 1)[1]
        model = next((s.get("model") for s in cfg["students"] if isinstance(s, dict) and s.get("name") == student),
                     None)
    if isinstance(model, Mapping) and str(model.get("name", "")).startswith("timm:"):  # a timm student
        return {"family": "timm", "model": model["name"][len("timm:"):], "img_size": int(model.get("img_size", 224))}
    if not isinstance(model, Mapping) or model.get("pretrained") or model.get("name") not in list_models():
        return None
    from ..config import ModelConfig

    kwargs = ModelConfig(**{k: v for k, v in model.items() if k in ModelConfig.__dataclass_fields__}).create_kwargs()
    return {**model_defaults(model["name"]), **kwargs}


# -- the registry --------------------------------------------------------------------------------------------


def _read_dcp(p: Probe) -> Found:
    obj, state = read_dcp_backbone(p.path, p.which, lazy=p.lazy)
    return Found("dcp", p.path, obj, arch=_run_arch(p.path, state))


def _read_dinopipe(p: Probe) -> Found:
    arch = p.config.get("arch") if p.config.get("format") == EXPORT_FORMAT else None
    obj, file_arch = p.weights
    return Found("dinopipe", p.files[0], obj, arch=arch or file_arch)


def _read_hf(p: Probe) -> Found:
    return Found("hf", p.files[0], p.weights[0], hf_config=p.config)


def _read_timm_folder(p: Probe) -> Found:
    obj, file_arch = p.weights
    return Found("timm", p.files[0], obj, arch=file_arch, num_heads=p.config["model_args"].get("num_heads"))


def _read_file(name: str) -> Callable[[Probe], Found]:
    def read(p: Probe) -> Found:
        obj, arch = p.weights
        # an official-layout export's FILE.json records what the .pth cannot hold (heads, ...)
        return Found(name, p.path, obj, arch=arch or read_sidecar(p.path))
    return read


def _is_weights_folder(p: Probe) -> bool:
    return p.path.is_dir() and bool(p.files)


@dataclass(frozen=True)
class Format:
    name: str
    what: str  # for messages and docs
    matches: Callable[[Probe], bool]
    read: Callable[[Probe], Found]


FORMATS: tuple[Format, ...] = (
    Format("dcp", "a DCP checkpoint folder (RUN/checkpoints/step_N)",
           lambda p: p.path.is_dir() and (p.path / ".metadata").is_file(), _read_dcp),
    Format("hf", "a Hugging Face Dinov2 / Dinov2WithRegisters / DINOv3ViT folder",
           lambda p: _is_weights_folder(p) and p.config.get("model_type") in HF_MODEL_TYPES, _read_hf),
    Format("timm-folder", "a timm local-dir folder (config.json with model_args)",
           lambda p: _is_weights_folder(p) and isinstance(p.config.get("model_args"), Mapping), _read_timm_folder),
    Format("dinopipe", "a dinopipe export folder (model.safetensors + config.json)", _is_weights_folder,
           _read_dinopipe),
    Format("safetensors", "a .safetensors file (dinopipe, timm or Hugging Face keys)",
           lambda p: p.path.is_file() and p.path.suffix == ".safetensors", _read_file("safetensors")),
    Format("dinov3-pth", "an official DINOv3 .pth (hub or training checkpoint)",
           lambda p: p.path.is_file() and p.layout == "dinov3", _read_file("dinov3-pth")),
    Format("dinov2-pth", "an official DINOv2 hub .pth (or a training checkpoint)",
           lambda p: p.path.is_file() and p.layout in ("dinov2", "dinopipe"), _read_file("dinov2-pth")),
    Format("timm-pth", "a timm DINOv2 / DINOv3 state dict",
           lambda p: p.path.is_file() and p.layout in ("timm", "timm_dinov3"), _read_file("timm-pth")),
    Format("torch-file", "any other torch file (read with weights_only=True; its keys must be a ViT's)",
           lambda p: p.path.is_file(), _read_file("torch-file")),
)


def pick(p: Probe) -> Format:
    for fmt in FORMATS:
        if fmt.matches(p):
            return fmt
    raise CheckpointError(f"'{p.path}': holds none of the formats dinopipe reads: "
                          + "; ".join(f.what for f in FORMATS))


def _students(run: Path) -> list[str]:
    export = TrainLayout(run).export()
    return sorted(p.name for p in export.iterdir() if (p / WEIGHTS_NAME).is_file()) if export.is_dir() else []


def locate(path: Path, which: Optional[str] = None) -> Path:
    """The file or folder to read for ``path``: itself, a run's DCP checkpoint, or a run's export folder
    (``export/teacher`` for pretraining, ``export/NAME`` for distillation: ``which``, or the only student)."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"'{path}' is neither a file, a folder nor a registry name ({', '.join(list_models())})")
    found = dcp_dir(path, which)
    if found is not None:
        return found
    subs = ["", "export/teacher", "export"]
    students = _students(path)
    if which and which not in ("teacher", "student"):
        if which not in students:
            raise CheckpointError(f"'{path}': no exported student '{which}' (exported: {students or 'none'})")
        subs = [f"export/{which}"]
    elif not TrainLayout(path).export("teacher").is_dir() and len(students) == 1:
        subs.append(f"export/{students[0]}")
    for sub in subs:
        d = path / sub if sub else path
        if _hf_shards(d):
            return d
    if len(students) > 1 and not TrainLayout(path).export("teacher").is_dir() and not which:
        raise CheckpointError(f"'{path}' is a distillation run with students {students}: pass which=NAME "
                              f"(dinopipe export --which NAME) to pick one")
    raise CheckpointError(f"'{path}': no {WEIGHTS_NAME} in the folder, export/teacher/ or export/, and no DCP checkpoint")


def recorded_arch(path: Path, which: Optional[str] = None) -> Optional[dict]:
    """The architecture an export folder records in its config.json, without reading any weights."""
    p = Probe(locate(path, which), which)
    if p.path.is_dir() and p.config.get("format") == EXPORT_FORMAT and isinstance(p.config.get("arch"), Mapping):
        return dict(p.config["arch"])
    return None


def read(path: Path, which: Optional[str] = None, lazy: bool = False) -> Found:
    """Locate, pick the format, read: the one way every entry point reads a user's checkpoint (``lazy``: a DCP
    folder's large tensors are read when sliced)."""
    p = Probe(locate(path, which), which, lazy)
    return pick(p).read(p)


__all__ = ["FORMATS", "Format", "Found", "Probe", "locate", "pick", "read", "recorded_arch", "read_dcp_backbone",
           "read_weights_file", "dcp_dir", "HF_MODEL_TYPES"]
