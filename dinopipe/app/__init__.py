"""The application layer: the console commands and the orchestration that drives both packages (the ``dinopipe``
command, ``dinopipe pipeline``, the Slurm submitter, the GPU acceptance check). The only part of ``dinopipe`` that
imports ``curation``; ``curation`` never imports it (``tests/test_import_cycles.py``, ``tests/test_layers.py``)."""
