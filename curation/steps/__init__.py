"""The one shape of a curation step (``(task_index, num_tasks)`` over memory-mapped rows, part files
written atomically, finished parts skipped) and the one runner that launches it (:mod:`.runner`)."""
