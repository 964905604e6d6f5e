"""faiss, or a clear error: it is an extra (``pip install 'dinopipe[cpu]'`` or ``'dinopipe[gpu]'``), never a
base dependency, because faiss-cpu and faiss-gpu-cu12 both install the ``faiss`` package and overwrite each
other. Training and loading never import it; only curation does."""

try:
    import faiss  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by tests/test_gpu_check.py
    raise ImportError(
        "curation needs faiss, which is not installed: pip install 'dinopipe[cpu]' (faiss-cpu) or, on a CUDA 12 "
        "cluster, 'dinopipe[gpu]' (faiss-gpu-cu12) -- one of them, never both (they ship the same package)"
    ) from exc

__all__ = ["faiss"]
