"""The ranged GET behind :func:`dinopipe.utils.storage.read_range` for ``s3://``: which client sends it.

Training reads one image per request in a global random order, so the client's CPU per request is what limits a
core (bench/bench_remote.py: s3fs 1.2-2.5 ms of CPU per 60 KB GET, obstore 0.4-0.5 ms).
``DINOPIPE_S3_READER`` picks:

* ``obstore`` (the default when the ``obstore`` package is installed, ``[s3]`` extra): Rust's object_store. Sends
  ``If-Match`` (a replaced object is refused with 412 -> ``changed``), its own retries are off (``max_retries:
  0``) so every retry goes through storage.call() and is counted. Credentials: object_store's chain (the
  ``AWS_*`` environment, web identity, ECS / EC2 instance role); when no key is in the environment but an AWS
  profile file is, s3fs (botocore's chain, which reads profiles) serves instead. obstore's tokio runtime does not
  survive ``fork()``: a process forked after its parent started it reads through s3fs (see :func:`obstore_get`).
* ``s3fs``: fsspec's S3 client (the fallback; also every listing and write).
* ``crt``: AWS's CRT client (``[s3-crt]``): its own uncounted retries and no If-Match (size check only).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

Getter = Callable[[str, int, Optional[int], Optional[str]], bytes]  # (key, offset, end, etag) -> bytes

_obstore: dict[str, Any] = {"pid": None, "stores": {}}
_crt: dict = {}


def endpoint() -> Optional[str]:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


_chosen: dict = {}


def reader_name() -> str:
    """The reader this process uses for s3:// now: 'obstore', 's3fs' or 'crt' (asked per read: memoized)."""
    key = (os.getpid(), _obstore["pid"], os.environ.get("DINOPIPE_S3_READER"), bool(os.environ.get("AWS_ACCESS_KEY_ID")),
           os.environ.get("AWS_PROFILE"))
    if key not in _chosen:
        _chosen[key] = _choose()
    return _chosen[key]


def _choose() -> str:
    want = os.environ.get("DINOPIPE_S3_READER", "").strip().lower() or "auto"
    if want not in ("auto", "obstore", "s3fs", "crt"):
        raise ValueError(f"DINOPIPE_S3_READER must be obstore, s3fs or crt, not {want!r}")
    if want in ("s3fs", "crt"):
        return want
    try:
        import obstore  # noqa: F401
    except ImportError:
        if want == "obstore":
            raise ValueError("DINOPIPE_S3_READER=obstore needs obstore: pip install 'dinopipe[s3]'") from None
        return "s3fs"
    if _obstore["pid"] not in (None, os.getpid()):
        return "s3fs"  # forked after the parent started obstore's runtime: its threads are gone here
    if not os.environ.get("AWS_ACCESS_KEY_ID") and _profile_file():
        return "s3fs"  # credentials in a profile: botocore's chain reads those, object_store's does not
    return "obstore"


def _profile_file() -> bool:
    files = [os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials"),
             os.environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")]
    return bool(os.environ.get("AWS_PROFILE")) or any(os.path.exists(f) for f in files)


def getter(bucket: str) -> Optional[Getter]:
    """A ranged GET on ``bucket`` through the chosen fast reader, or None: use s3fs."""
    name = reader_name()
    if name == "obstore":
        return lambda key, offset, end, etag: obstore_get(bucket, key, offset, end, etag)
    if name == "crt":
        client = _crt_client()
        return lambda key, offset, end, etag: b"".join(client.get_object(bucket, key, offset if end is not None
                                                                         else None, end))
    return None


def obstore_get(bucket: str, key: str, offset: int, end: Optional[int], etag: Optional[str]) -> bytes:
    """Bytes ``[offset, end)`` of ``key`` (``end`` None: to the end) with ``If-Match: etag``; errors are obstore's
    (storage.classify names them: 404 missing, 412 changed, 503 throttled, 5xx, a cut body)."""
    import obstore

    pid = os.getpid()
    _obstore["pid"] = pid  # from here on a fork of this process must not touch obstore
    store = _obstore["stores"].get((pid, bucket, endpoint()))
    if store is None:
        store = _obstore["stores"][(pid, bucket, endpoint())] = _obstore_store(bucket)
    options: dict[str, Any] = {}
    if end is not None:
        options["range"] = (offset, end)
    elif offset:
        options["range"] = {"offset": offset}
    if etag:
        options["if_match"] = etag
    return bytes(obstore.get(store, key, options=options).bytes())


def _obstore_store(bucket: str):
    """One S3Store per (process, bucket, endpoint). Credentials and region come from the environment, read by
    object_store itself; nothing here sees them. Retries off: storage.call() retries and counts."""
    from datetime import timedelta

    from obstore.store import S3Store

    config: dict[str, Any] = {}
    url = endpoint()
    if url:
        config["endpoint"] = url
    if not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
        config["region"] = "us-east-1"  # botocore's default too
    client = {"allow_http": bool(url and url.startswith("http://")), "timeout": timedelta(seconds=60)}
    return S3Store(bucket, config=config, client_options=client,
                   retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=60)})


def _crt_client():
    key = (os.getpid(), endpoint())
    if key not in _crt:
        try:
            from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client
        except ImportError:
            raise ValueError("DINOPIPE_S3_READER=crt needs s3torchconnectorclient: "
                             "pip install 'dinopipe[s3-crt]'") from None
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        _crt[key] = MountpointS3Client(region, endpoint=key[1], force_path_style=bool(key[1]))
    return _crt[key]
