"""Moved to :mod:`dinopipe.export.hf`; this import path keeps working."""

from .export.hf import (export_hf, hf_config, hf_dinov3_preprocessor_config, hf_preprocessor_config,  # noqa: F401
                        to_hf)

__all__ = ["export_hf", "to_hf", "hf_config", "hf_preprocessor_config", "hf_dinov3_preprocessor_config"]
