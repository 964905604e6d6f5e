"""The kNN engine: faiss indexes (flat, IVF on disk, exact coarse step) and the sharded search."""
