"""The one config system: typed dataclasses as OmegaConf structured configs.

Merge order (as dinov2's ``utils/config.py``): dataclass defaults <- YAML file <- command-line dotlist
overrides (``train.batch_size=64``). Every merge step is done separately so an unknown key or a wrong
type can be reported with *where it came from* (the file or the override), before any work starts.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence, Type, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .utils.io import atomic_write

T = TypeVar("T")

EXIT_CONFIG_ERROR = 2


class ConfigError(ValueError):
    """A configuration mistake a person has to fix; the message names the key and its origin."""


class InputError(ConfigError, RuntimeError):
    """A mistake in the user's input found while working (a step run before the one it needs, a changed pool in
    an old output folder, a launch with the wrong task count): exit 2 like a :class:`ConfigError`, and a
    ``RuntimeError`` too for callers that caught those before it existed."""


def _describe(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"key '{key}': {msg}" if key else msg


def _merge(base: DictConfig, other: DictConfig, origin: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as exc:  # unknown key, wrong type, missing value...
        raise ConfigError(f"{origin}: {_describe(exc)}") from None
    except TypeError as exc:  # e.g. 'phases.0.x=1': a dotted index into a list
        raise ConfigError(f"{origin}: {exc} (to change one list entry, give the whole list: phases=[{{...}}])") from None


def _parse_override(item: str) -> DictConfig:
    if "=" not in item:
        raise ConfigError(f"override '{item}': expected key=value (e.g. train.batch_size=64)")
    try:
        return OmegaConf.from_dotlist([item])
    except OmegaConfBaseException as exc:
        raise ConfigError(f"override '{item}': {_describe(exc)}") from None
    except Exception as exc:  # the value is parsed as YAML: a syntax error comes from yaml
        raise ConfigError(f"override '{item}': cannot parse the value as YAML: {str(exc).splitlines()[0]} "
                          "(in flow mappings put a space after each colon: {name: x, depth: 2})") from None


def load_config(
    schema: Type[T],
    path: Optional[str | Path] = None,
    overrides: Sequence[str] = (),
) -> T:
    """Build a config of type ``schema`` from defaults, an optional YAML file and dotlist overrides.

    Returns an instance of ``schema`` (plain dataclasses all the way down, methods included).
    Raises :class:`ConfigError` naming the offending key and where it came from.
    """
    cfg = OmegaConf.structured(schema)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            file_cfg = OmegaConf.load(path)
        except Exception as exc:  # YAML syntax errors come from yaml, not omegaconf
            raise ConfigError(f"{path}: cannot parse YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(file_cfg, DictConfig):
            raise ConfigError(f"{path}: top level must be a mapping")
        cfg = _merge(cfg, file_cfg, str(path))
    for item in overrides:
        cfg = _merge(cfg, _parse_override(item), f"override '{item}'")
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"required key(s) not set: {', '.join(missing)} (set them in the YAML or as key=value)")
    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:  # e.g. a bad ${interpolation}
        raise ConfigError(_describe(exc)) from None


def to_yaml(cfg: Any) -> str:
    if dataclasses.is_dataclass(cfg):
        cfg = OmegaConf.structured(cfg)
    return OmegaConf.to_yaml(cfg, resolve=True)


def save_config(cfg: Any, run_dir: str | Path, name: str = "config.yaml", header: str = "") -> Path:
    """Write the resolved config into the run directory (atomically), so a run documents itself.
    ``header``: a comment line put first (e.g. which command wrote it)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return atomic_write(run_dir / name, (f"# {header}\n" if header else "") + to_yaml(cfg))


def exit_on_config_error(exc: ConfigError) -> NoReturn:
    print(f"config error: {exc}", file=sys.stderr)
    raise SystemExit(EXIT_CONFIG_ERROR)


EXIT_BUG = 1


def report_bug(command: str) -> int:
    """In an ``except Exception`` of a command line: the traceback into the log (stderr), one line saying it is
    a bug to report, and :data:`EXIT_BUG` (docs/exit-codes.md: 2 is only for the user's mistakes)."""
    import traceback

    traceback.print_exc()
    print(f"{command}: internal error (not a mistake in your input): please report it with the command, the "
          f"config and the traceback above", file=sys.stderr)
    return EXIT_BUG


class Choice(str, enum.Enum):
    """A string choice of a config field. OmegaConf rejects any other value while merging the YAML file or an
    override (exit 2, naming the key and listing the allowed values); YAML and overrides give the lowercase
    strings, the saved config.yaml shows them, and a member compares, hashes, prints and formats as its string
    (``cfg.mode == "ssl"``, ``{"ssl": ...}[cfg.mode]``, ``f"{cfg.mode}"``), so code reading configs needs no
    change. Members are named by their values (OmegaConf matches names), hence ``choices()`` below."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def choices(name: str, values: Sequence[str], module: str) -> Any:
    """A :class:`Choice` enum whose members are ``values`` (names may hold characters such as ``kmeans++``);
    assign it to a module-level ``name`` in ``module`` so it pickles."""
    return Choice(name, {v: v for v in values}, module=module, qualname=name)


def _choice_type(tp: Any) -> Optional[type]:
    for t in (tp, *typing.get_args(tp)):  # Optional[E] is Union[E, None]
        if isinstance(t, type) and issubclass(t, Choice):
            return t
    return None


def check_choices(cfg: Any, prefix: str = "") -> None:
    """Turn the string in each :class:`Choice` field into its member, or raise ConfigError naming the key and
    the allowed values. OmegaConf already did this for configs loaded from YAML / overrides; this covers a
    config built or changed in Python (``cfg.dedup.grouping = "chain"``) before it is used."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            check_choices(value, key + ".")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_choices(item, f"{key}.{i}.")
        elif value is not None and (kind := _choice_type(hints.get(f.name))) is not None:
            try:
                setattr(cfg, f.name, kind(value))
            except ValueError:
                raise ConfigError(f"key '{key}': invalid value '{value}', expected one of "
                                  f"[{', '.join(m.value for m in kind)}]") from None


# ---------------------------------------------------------------------------------------------
# Shared sections. Stage configs (curation, pretrain, distill, pipeline) compose these.
# ---------------------------------------------------------------------------------------------


AttnBackend = choices("AttnBackend", ("auto", "sdpa", "xformers", "math"), __name__)
"""dinopipe.models.attention.BACKENDS (a test keeps the two equal; configs import nothing above them)."""
RopeDtype = choices("RopeDtype", ("fp32", "bf16"), __name__)
FFN = choices("FFN", ("mlp", "swiglu", "swiglu32", "swiglu64", "swiglu128"), __name__)
"""dinopipe.models.registry.FFN_LAYERS."""
PatchEmbedExpand = choices("PatchEmbedExpand", ("mean", "rgb_map"), __name__)
"""dinopipe.models.channels.EXPAND_MODES."""
DINOV3_KEYS = ("rope_rescale", "rope_shift", "rope_jitter", "rope_dtype", "untie_cls_and_patch_norms",
               "untie_global_and_local_cls_norm")


@dataclass
class ModelConfig:
    """Which backbone to build (a registry name) and the overrides passed to ``create_model``."""

    name: str = "vit_test"
    """Registry name, e.g. vit_s14, vit_l14_reg4, vit_g14, vit_test."""
    img_size: int = 224
    """Size the position embedding is created for; other sizes are interpolated."""
    patch_size: Optional[int] = None
    """Patch side in pixels; null keeps the variant's (14 for DINOv2 names, 16 for *16 and DINOv3 names)."""
    drop_path_rate: float = 0.0
    """Stochastic depth: probability of dropping a block's residual branch per sample (the last block's when not uniform)."""
    drop_path_uniform: bool = False
    """true: every block drops with drop_path_rate (DINOv2's large models); false: the rate grows linearly with depth."""
    efficient_drop_path: bool = True
    """Run each residual branch only on the kept samples (DINOv2's subset stochastic depth)."""
    attn_backend: AttnBackend = AttnBackend.auto
    """auto | sdpa | xformers | math"""
    num_register_tokens: Optional[int] = None
    """Register tokens (Darcet et al. 2024; DINOv3 calls them storage tokens); null keeps the variant's (4 for
    *_reg4 and DINOv3 names, else 0)."""
    init_values: Optional[float] = 1.0e-5
    """LayerScale init; null disables LayerScale."""
    ffn: Optional[FFN] = None
    """mlp | swiglu (| swiglu32 | swiglu64 | swiglu128: DINOv3's aligned widths); null keeps the variant's
    default."""
    num_heads: Optional[int] = None
    """Override the head count; also tells it for ``pretrained`` files whose heads are not 64-dim."""
    embed_dim: Optional[int] = None
    """Override the variant's width (e.g. a custom small student)."""
    depth: Optional[int] = None
    """Override the variant's number of blocks."""
    pretrained: Optional[str] = None
    """A checkpoint dinopipe.load accepts, used to initialise the backbone (continued pretraining)."""
    in_chans: Optional[int] = None
    """Input channels (1-16); null: data.channels. A pretrained file with another count (e.g. RGB weights for
    4-band images) has its patch embedding expanded as expand_patch_embed says (docs/multichannel.md)."""
    expand_patch_embed: PatchEmbedExpand = PatchEmbedExpand.mean
    """RGB weights -> in_chans channels: mean (the mean RGB kernel in every channel, x 3/in_chans) | rgb_map (the
    channels named by rgb_channels get the R, G, B kernels, the rest the mean kernel; all x 3/in_chans)."""
    rgb_channels: Optional[list[int]] = None
    """rgb_map: the input channels (0-based) holding red, green and blue, e.g. [2, 1, 0] for B,G,R,NIR bands."""
    pretrained_heads: Optional[str] = None
    """Pretraining only: DINO/iBOT heads to start from instead of fresh ones (docs/pretrain.md, "Continuing from a
    release"): ``auto`` = the heads saved with ``pretrained`` (a dinopipe run, export or DCP checkpoint; fresh
    heads when it has none), or a path to such a run/export/checkpoint. null: fresh heads."""
    rope_rescale: Optional[float] = None
    """DINOv3 backbones only (RoPE): training-time coordinate rescale augmentation (released models: 2)."""
    rope_shift: Optional[float] = None
    """DINOv3 only: training-time RoPE coordinate shift augmentation (null keeps the variant's default)."""
    rope_jitter: Optional[float] = None
    """DINOv3 only: training-time per-axis RoPE coordinate jitter augmentation."""
    rope_dtype: Optional[RopeDtype] = None
    """DINOv3 only, training: dtype of the RoPE tables and of the q/k rotation. bf16 is what the official trainer
    runs (its build_model drops the config's pos_embed_rope_dtype, so the model default bf16 applies); null/fp32:
    the released models' setting (hub, transformers, timm), which exports always use."""
    untie_cls_and_patch_norms: Optional[bool] = None
    """DINOv3 only: a separate final norm for the class/storage tokens."""
    untie_global_and_local_cls_norm: Optional[bool] = None
    """DINOv3 only: a separate final norm for the local crops' class tokens in training (the ViT-7B's)."""

    def create_kwargs(self) -> dict:
        out = {
            "img_size": self.img_size,
            "drop_path_rate": self.drop_path_rate,
            "drop_path_uniform": self.drop_path_uniform,
            "efficient_drop_path": self.efficient_drop_path,
            "attn_backend": str(self.attn_backend),  # model code gets plain strings, not config enums
            "init_values": self.init_values,
        }
        for key in ("patch_size", "num_register_tokens", "ffn", "num_heads", "embed_dim", "depth", "in_chans") + DINOV3_KEYS:
            if getattr(self, key) is not None:
                v = getattr(self, key)
                out[key] = str(v) if isinstance(v, Choice) else v
        return out


COMPUTE_DTYPES = ("fp32", "bf16")  # fp16 would need a gradient scaler (refused by check_parallel_config)


@dataclass
class ParallelConfig:
    """How a training stage shards and runs its models (applied by dinopipe/train/parallel.py)."""

    param_dtype: str = "bf16"
    """Compute dtype of parameters and activations (bf16 / fp32), at any world size: FSDP2's mixed-precision
    policy with several processes, autocast in one. fp16 is refused (it would need a gradient scaler)."""
    reduce_dtype: str = "fp32"
    """dtype of the gradient reduce-scatter (fp32 / bf16): of every part, unless head_reduce_dtype sets the heads'."""
    head_reduce_dtype: Optional[str] = None
    """dtype of the DINO / iBOT heads' gradient reduce-scatter (null: reduce_dtype). DINOv2 reduces the backbone
    in 16 bits and the heads in fp32 (reduce_dtype=bf16, head_reduce_dtype=fp32): ~0.51 of all-fp32 traffic."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them (less memory, one more forward per block)."""
    compile: bool = False
    """Per-block torch.compile(fullgraph=True) (useful on CUDA; slow to compile on CPU)."""
    reshard_after_forward: bool = True
    """Student only: free the gathered parameters after forward (re-gather in backward). Frozen models
    (teachers, EMAs) always reshard. At one rank nothing is freed (the shard is the whole parameter), so the
    student keeps its gathered parameters there whatever this says."""
    sync_batchnorm: bool = True
    """Trained models with BatchNorm (timm CNN students) use SyncBatchNorm over all ranks on CUDA (batch statistics
    of the global batch). torch has no CPU kernel for it: on CPU (gloo) each rank normalises its own images."""


def check_parallel_config(cfg: ParallelConfig) -> None:
    """Config errors (exit 2, naming the key) for choices the type system cannot check."""
    if cfg.param_dtype == "fp16":
        raise ConfigError("parallel.param_dtype: fp16 is not supported: it needs a gradient scaler, which the "
                          "training loop does not have (gradients underflow/overflow). Use bf16 (same speed on "
                          "A100/H100, fp32's exponent range) or fp32.")
    if cfg.param_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"parallel.param_dtype: expected one of {list(COMPUTE_DTYPES)}, got '{cfg.param_dtype}'")
    if cfg.reduce_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"parallel.reduce_dtype: expected one of {list(COMPUTE_DTYPES)}, got '{cfg.reduce_dtype}'")
    head = getattr(cfg, "head_reduce_dtype", None)
    if head is not None and head not in COMPUTE_DTYPES:
        raise ConfigError(f"parallel.head_reduce_dtype: expected one of {list(COMPUTE_DTYPES)} or null, got '{head}'")


def reduce_dtypes(cfg: ParallelConfig) -> tuple[str, str]:
    """(backbone, heads) gradient reduce dtypes of a parallel config."""
    head = getattr(cfg, "head_reduce_dtype", None)
    return cfg.reduce_dtype, head if head is not None else cfg.reduce_dtype


def dataclass_fields(schema: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)]


def phase_steps(cfg: Any) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` steps of each of ``cfg.phases`` (a stage config with ``phases[].fraction``
    and ``train.epochs``, ``train.epoch_length``); the last phase takes the rounding remainder, so the
    ends reach ``epochs * epoch_length`` exactly. The trainer's schedules and the planner both split here."""
    total = cfg.train.epochs * cfg.train.epoch_length
    bounds, start = [], 0
    for i, ph in enumerate(cfg.phases):
        end = total if i == len(cfg.phases) - 1 else start + int(round(ph.fraction * total))
        bounds.append((start, end))
        start = end
    return bounds


# -- the config reference (`dinopipe config --kind X`) -------------------------------------------------------


def _field_docs(cls: type) -> dict[str, str]:
    """Field name -> the first line of its attribute docstring (the string under the field), else of the comment
    on its line: what `dinopipe config --kind X` prints next to each key."""
    import ast
    import inspect
    import textwrap

    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines, docs = src.splitlines(), {}
    body = ast.parse(src).body[0].body  # type: ignore[attr-defined]
    for stmt, nxt in zip(body, body[1:] + [None]):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        doc = ""
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            doc = " ".join(nxt.value.value.split()).replace("``", "")
        elif "#" in lines[stmt.end_lineno - 1]:
            doc = lines[stmt.end_lineno - 1].split("#", 1)[1].strip()
        docs[stmt.target.id] = doc
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return "???"


def _show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if value is None:
        return "null"
    if value == "":
        return '""'
    if isinstance(value, (list, dict)) and value and dataclasses.is_dataclass(next(iter(value))):
        return f"[{len(value)} entries]"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def config_reference(schema: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """Every key of a config dataclass, nested sections included: (dotted key, default, one-line doc).
    A list of sections (e.g. ``phases``) is shown as ``phases[].KEY`` with the fields' own defaults."""
    hints = typing.get_type_hints(schema)
    docs = _field_docs(schema)
    rows: list[tuple[str, str, str]] = []
    for f in dataclasses.fields(schema):
        key, tp, default = f"{prefix}{f.name}", hints.get(f.name), _default(f)
        doc = docs.get(f.name, "")
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp):
            if doc:
                rows.append((key, "(section)", doc))
            rows.extend(config_reference(tp, f"{key}."))
        elif inner and typing.get_origin(tp) is list:
            rows.append((f"{key}", _show(default), doc))
            rows.extend(config_reference(inner[0], f"{key}[]."))
        else:
            rows.append((key, _show(default), doc))
    return rows


def format_reference(schema: type) -> str:
    rows = config_reference(schema)
    width = min(48, max(len(k) + len(d) + 3 for k, d, _ in rows))
    out = []
    for key, default, doc in rows:
        if default == "(section)":
            out.append(f"# {key}: {doc}")
            continue
        left = f"{key} = {default}"
        out.append(f"{left:{width}s}  {doc}".rstrip() if len(left) <= width else f"{left}\n{'':{width}s}  {doc}".rstrip())
    return "\n".join(out) + "\n"


__all__ = [
    "Choice",
    "choices",
    "check_choices",
    "ConfigError",
    "EXIT_CONFIG_ERROR",
    "ModelConfig",
    "ParallelConfig",
    "check_parallel_config",
    "reduce_dtypes",
    "config_reference",
    "format_reference",
    "load_config",
    "save_config",
    "to_yaml",
    "exit_on_config_error",
    "field",
    "phase_steps",
]
