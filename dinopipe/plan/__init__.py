"""The planner (``dinopipe plan``): the analytic memory / FLOP / time model (``analytic.py``, with the Gram
teacher and high-resolution phases in ``gram.py`` and the text report in ``report.py``), and the traced dry
run of the real training step at any world size in one process (``trace.py``, ``dinopipe plan --trace``),
which checks the analytic figures against torch's own memory and communication trackers."""

from .analytic import (DTYPE_BYTES, GiB, Arch, HeadArch, backbone_arch, backbone_saved_bytes, block_saved_bytes,
                       crop_forward_flops, describe, implied_mfu, largest_batch, masked_patches,
                       param_counts, plan, rope_table_bytes, sharded_numel, state_memory, step_flops, step_memory,
                       tokens)
from .cli import main
from .report import format_report

__all__ = ["DTYPE_BYTES", "GiB", "Arch", "HeadArch", "backbone_arch", "backbone_saved_bytes", "block_saved_bytes",
           "crop_forward_flops", "describe", "format_report", "implied_mfu", "largest_batch", "main",
           "masked_patches", "param_counts", "plan", "rope_table_bytes", "sharded_numel", "state_memory",
           "step_flops", "step_memory", "tokens"]
