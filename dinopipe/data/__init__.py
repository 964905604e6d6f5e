"""Image data: sources with stable ids (folders, file lists, tar shards) and robust decoding."""

from .decode import REASONS, safe_decode, to_rgb
from .sources import (
    IMAGE_EXTENSIONS,
    FileListSource,
    FolderSource,
    ImageRef,
    ImageSource,
    MultiSource,
    Sample,
    TarShardSource,
    as_multi,
    open_source,
)

__all__ = [
    "REASONS", "safe_decode", "to_rgb", "IMAGE_EXTENSIONS", "FileListSource", "FolderSource",
    "ImageRef", "ImageSource", "MultiSource", "Sample", "TarShardSource", "as_multi", "open_source",
]
