"""What every curation step shares: the one shape of a step (``(task_index, num_tasks)`` over memory-mapped rows,
part files written atomically, finished parts skipped) and the one runner that launches it (:mod:`.runner`, its
launchers :mod:`.supervise` and :mod:`.srun`), the path table, the output folder's shared files and status table,
the embedding store, the bucket output and the faiss import."""
