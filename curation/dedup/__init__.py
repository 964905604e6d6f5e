"""The dedup step: hash pre-dedup, then copy dedup through the kNN, verified on pixels."""
