"""Moved to :mod:`dinopipe.export.onnx`; this import path keeps working."""

from .export.onnx import (INPUT_NAME, OUTPUT_NAMES, FeatureGraph, export_onnx, export_program,  # noqa: F401
                          max_abs_diff, onnx_runner, program_runner, resample_matrix, trace)

__all__ = ["export_onnx", "export_program", "trace", "FeatureGraph", "resample_matrix", "max_abs_diff", "onnx_runner",
           "program_runner", "OUTPUT_NAMES", "INPUT_NAME"]
