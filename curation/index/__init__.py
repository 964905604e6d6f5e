"""The index step (`curate index`, `curate search`): the pool, eval and retrieval indexes trained once and
searched by W array tasks, for the dedup, decontaminate and rebalance steps to read."""
