"""``output.dir=s3://bucket/prefix`` (or any fsspec URL): curate in a local scratch folder, publish to the bucket.

Curation's steps memory-map their arrays, rename part files into place and rerun only missing parts; object
stores do none of that. So a URL output runs every step in a local scratch folder (``$DINOPIPE_SCRATCH``, else
the system temporary folder, one subfolder per URL) and then publishes it (:func:`publish`):

1. the marker object ``_COMPLETE`` is deleted first, so no reader takes the prefix for complete while it changes;
2. each finished file is uploaded as one object (a PUT, or a multipart upload that S3 makes visible only once
   completed);
3. objects an earlier publish left under the prefix that this output no longer has are deleted;
4. the marker is written last. A killed or failed publish leaves no marker; rerunning the command publishes again.

A later ``curate <step>`` against the same URL on another machine first pulls the published output down (only a
prefix with its marker, into a temporary folder renamed into place when whole: a half-pulled folder is never
used). Store faults follow the store rule: a publish or pull the store did not let finish is exit 75 ("rerun the
same command"), a refusal (403, credentials) exit 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
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
        try:
            storage.call(lambda: fs.info(fs._strip_protocol(marker)), marker)
            published = True
        except storage.Unreadable as e:
            if e.reason != storage.MISSING:
                raise storage.StoreUnavailable(f"{marker}: cannot be read ({e.reason})") from None
            published = False  # a definite not-found: nothing (whole) was published there yet
        partial = f"{local}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        if published:
            storage.call(lambda: fs.get(path.rstrip("/") + "/", partial + "/", recursive=True), url)
            _check_pull(partial, url)
        os.replace(partial, local)  # the scratch folder appears whole or not at all
    cfg.output.dir = local
    return url


def _check_pull(local: str, url: str) -> None:
    """The pulled folder holds what the marker says was published (its file count), else 75: a publish ran again
    after the marker was read, or a pull was cut short."""
    try:
        with open(os.path.join(local, MARKER)) as f:
            want = int(json.load(f).get("files", -1))
    except (OSError, ValueError):
        want = -1
    have = sum(len([f for f in files if f != MARKER]) for _, _, files in os.walk(local))
    if want != have:
        raise storage.StoreUnavailable(f"{url}: the pulled output has {have} files, its marker says {want} "
                                       f"(published again meanwhile?)")


def publish(local: str, url: str) -> int:
    """Publish ``local`` to ``url`` (marker gone first, files, stale objects removed, marker last); returns the
    number of files. Raises StoreUnavailable (75) when the store does not let it finish, StoreRefused (2)."""
    fs, path = storage.filesystem(url)
    marker_url = storage.join(url, MARKER)
    try:
        storage.call(lambda: fs.rm_file(fs._strip_protocol(marker_url)), marker_url)
    except storage.Unreadable as e:
        if e.reason != storage.MISSING:
            raise storage.StoreUnavailable(f"{marker_url}: cannot be removed ({e.reason})") from None
    marker = os.path.join(local, MARKER)
    if os.path.exists(marker):
        os.remove(marker)
    try:
        before = [rel for rel, _, _ in storage.iter_prefix(url)]
        n = storage.put_tree(local, url)
        keep = {os.path.relpath(os.path.join(d, f), local).replace(os.sep, "/")
                for d, _, files in os.walk(local) for f in files}
        for rel in before:
            if rel not in keep and rel != MARKER:  # an earlier publish's object this output does not have
                stale = storage.join(url, rel)
                storage.call(lambda s=stale: fs.rm_file(fs._strip_protocol(s)), stale)
    except storage.Unreadable as e:  # a definite refusal of one object (not throttling): still not published
        raise storage.StoreUnavailable(f"could not publish {local} to {url}: {e}") from None
    with open(marker, "w") as f:
        json.dump({"files": n, "from": "curate"}, f)
    storage.put_atomic(marker, marker_url)
    return n


__all__ = ["localize", "publish", "scratch_for", "MARKER"]
