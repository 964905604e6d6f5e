"""The rebalance step: hierarchical k-means or retrieval around seed images."""
