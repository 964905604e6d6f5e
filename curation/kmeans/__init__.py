"""The k-means engine: hierarchical k-means, its sharded and distributed forms, the tree and sampling."""
