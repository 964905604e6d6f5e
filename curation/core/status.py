"""The one status table: what became of each input image.

The step arrays (``status.npy`` of dedup, decontaminate, rebalance) hold the code; decisions.tsv and manifest.json
spell the name. ``UNREADABLE`` is only in decisions.tsv and the manifest (an image that could not be decoded has no
row in the step arrays). ``MANIFEST_ORDER`` is the order in which manifest.json, the report and the docs list them.
"""

from __future__ import annotations

KEPT, HASH_DUP, COPY_DUP, DECONTAM, NOT_SELECTED, UNREADABLE = range(6)

STATUS_NAMES = ("kept", "hash_duplicates", "copy_duplicates", "decontaminated", "not_selected", "unreadable")
"""code -> name"""

MANIFEST_ORDER = (KEPT, HASH_DUP, COPY_DUP, DECONTAM, UNREADABLE, NOT_SELECTED)

STATUSES = tuple(STATUS_NAMES[c] for c in MANIFEST_ORDER)
"""Every input image ends in exactly one of these (manifest.json counts them: input = their sum)."""

__all__ = ["KEPT", "HASH_DUP", "COPY_DUP", "DECONTAM", "NOT_SELECTED", "UNREADABLE", "STATUS_NAMES",
           "MANIFEST_ORDER", "STATUSES"]
