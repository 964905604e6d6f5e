"""``output.dir=s3://bucket/prefix`` (or any fsspec URL): curate in a local scratch folder, publish to the bucket.

Curation's steps memory-map their arrays, rename part files into place and rerun only missing parts; object
stores do none of that. So a URL output runs every step in a local scratch folder (``$DINOPIPE_SCRATCH``, else
the system temporary folder, one subfolder per URL) and then uploads each finished file as one object (a PUT, or
a multipart upload that S3 makes visible only once completed) and, last, the marker object ``_COMPLETE``: a reader
that waits for the marker never sees a half-published output, and a killed upload is simply redone.

A later ``curate <step>`` against the same URL on another machine first copies the published output down (when
the scratch folder is absent), so steps can still run as separate jobs.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

from dinopipe.utils import storage

MARKER = "_COMPLETE"


def scratch_for(url: str) -> str:
    base = os.environ.get("DINOPIPE_SCRATCH") or tempfile.gettempdir()
    tag = hashlib.blake2b(url.rstrip("/").encode(), digest_size=6).hexdigest()
    return os.path.join(base, f"dinopipe-curate-{tag}")


def localize(cfg: Any) -> str | None:
    """If ``cfg.output.dir`` is a URL: point it at the scratch folder (pulling a published output down when the
    folder is new) and return the URL; else None and ``cfg`` is untouched."""
    url = cfg.output.dir
    if not storage.is_url(url):
        return None
    local = scratch_for(url)
    if not os.path.isdir(local):
        fs, path = storage.filesystem(url)
        marker = storage.join(url, MARKER)
        if storage.call(lambda: fs.exists(fs._strip_protocol(marker)), marker):
            storage.call(lambda: fs.get(path.rstrip("/") + "/", local + "/", recursive=True), url)
        os.makedirs(local, exist_ok=True)
    cfg.output.dir = local
    return url


def publish(local: str, url: str) -> int:
    """Upload every file of ``local`` to ``url``, then the marker (its body: the file count). Returns the count."""
    marker = os.path.join(local, MARKER)
    if os.path.exists(marker):
        os.remove(marker)
    n = storage.put_tree(local, url)
    with open(marker, "w") as f:
        json.dump({"files": n, "from": "curate"}, f)
    storage.put_atomic(marker, storage.join(url, MARKER))
    return n


__all__ = ["localize", "publish", "scratch_for", "MARKER"]
