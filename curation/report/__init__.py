"""The report step: its numbers as tasks, its plots and summary."""
