"""``curate simulate``: every curation step after embedding, as W tasks, on synthetic data whose answer
is known (planted near-copies, planted eval overlap, planted near-duplicate hashes)."""
