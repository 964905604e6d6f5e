"""The embed step: descriptors, hashes and model embeddings of the pool."""
