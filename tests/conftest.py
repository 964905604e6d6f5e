"""Suite-wide settings. Runs before any test module imports torch."""

import os

# See dinopipe/__init__.py: spinning OpenMP threads collapse CPU throughput when processes share cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
