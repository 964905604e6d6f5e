"""Object storage behind every path a user gives: ``s3://``, ``gs://`` and any other fsspec URL.

One small layer so the rest of the package asks three questions only: is this a URL (:func:`is_url`), which
filesystem serves it (:func:`filesystem`), and read these bytes of that object, retried, checked against the
listing (:func:`read_range`). Writes go through :func:`put_atomic`: the local file is finished first and the
object appears in one PUT (or one completed multipart upload), so a killed task never leaves a half-written
object that looks whole.

Credentials come only from the provider chain of the store's own client (environment, profile, instance role:
botocore / google-auth). Nothing here reads, stores, prints or logs them; error messages name the URL and the
error code, never the client's configuration. ``endpoint_url`` (MinIO, Ceph, R2, a test server) comes from
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, botocore's own variables.

One rule for every error a store gives (docs/storage.md, "Faults"):

- **transient** (throttling, 5xx, a dropped or reset connection, a timeout, a read cut short): retried with capped
  exponential backoff and full jitter for up to the retry budget (``DINOPIPE_STORAGE_RETRY_S``, default 300 s:
  long enough for S3 throttling), counted per kind in :data:`COUNTS` (per process; the training loader moves a
  worker's counts into its batches); past the budget :class:`StoreUnavailable` (exit 75, "rerun the same
  command"). The clients' own retry loops are turned off so every retry is seen and counted.
- **refused** (403, bad / expired credentials, no such bucket): :class:`StoreRefused` at once (exit 2), naming
  the URL and the kind, never the credentials.
- **definite** answers about one object (404 ``missing``, 412 ``changed``, ``truncated``) and anything else that
  is not transient: :class:`Unreadable` with that short stable reason, the same contract as a corrupt local file.
"""

from __future__ import annotations

import collections
import errno
import os
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from ..config import ConfigError
from .exits import UnfinishedError

# Stable reasons an object is unreadable (they appear in manifests and step summaries).
MISSING = "missing"  # listed, then deleted (or never there)
CHANGED = "changed"  # its ETag / size no longer matches the listing: replaced mid-run
TRUNCATED_OBJECT = "truncated"  # shorter than the listing says (a read that stays short after retries)
READ_ERROR = "read_error"  # anything else that does not go away with retries

COUNTS: collections.Counter = collections.Counter()  # "retry/<kind>" and "unreadable/<reason>", per process
_lock = threading.Lock()

_THROTTLE = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
             "RequestThrottled", "ProvisionedThroughputExceededException"}
_SERVER = {"InternalError", "ServiceUnavailable", "RequestTimeout", "InternalServerError", "BadGateway"}
TRANSIENT_KINDS = ("throttled", "server_error", "connection")
FORBIDDEN, CREDENTIALS, NO_BUCKET = "forbidden", "credentials", "no_such_bucket"
REFUSED_KINDS = (FORBIDDEN, CREDENTIALS, NO_BUCKET)
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "ExpiredTokenException",
                     "InvalidToken", "TokenRefreshRequired", "RequestTimeTooSkewed", "UnrecognizedClientException",
                     "InvalidClientTokenId", "AuthFailure"}
_FORBIDDEN_CODES = {"AccessDenied", "Forbidden", "403", "AllAccessDisabled", "AccountProblem", "InvalidSecurity",
                    "NotSignedUp", "InvalidPayer"}
_CREDENTIAL_ERRORS = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                      "UnauthenticatedError")
_STATUS = re.compile(r"status code: (\d{3})")
_CONNECTION_NAMES = ("Disconnected", "Connection", "Payload", "IncompleteRead", "Timeout", "ResponseStreaming",
                     "ProtocolError", "ReadError", "ChecksumError")  # a body whose checksum fails: cut or garbled


class Unreadable(OSError):
    """An object the store definitely cannot give (missing, changed, truncated, or a non-transient error);
    ``reason`` is one of the stable reasons above."""

    def __init__(self, url: str, reason: str = READ_ERROR, detail: str = "") -> None:
        super().__init__(f"{url}: {reason}" + (f" ({detail})" if detail else ""))
        self.url, self.reason = url, reason


class _OneLine:
    """An error re-raised by a DataLoader worker arrives with the worker's traceback in its message
    (``ExceptionWrapper.reraise``): its text is the last line, so the command still prints one line."""

    def __str__(self) -> str:
        text = super().__str__()
        if "Traceback (most recent call last)" in text:
            text = text.strip().splitlines()[-1]
            text = text.split(": ", 1)[1] if text.split(": ", 1)[0].endswith(type(self).__name__) else text
        return text


class StoreUnavailable(_OneLine, UnfinishedError):
    """The store kept failing transiently (throttled, 5xx, resets) for the whole retry budget: exit 75, rerun."""

    why = "the object store did not answer within the retry budget (DINOPIPE_STORAGE_RETRY_S)"


class StoreRefused(_OneLine, ConfigError):
    """The store refused the request (403, bad or expired credentials, no such bucket): exit 2 at once."""


class MissingExtra(ConfigError):
    """A URL whose client package is not installed: exit 2 with the pip command."""


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with full jitter: attempt k waits uniform(0, min(cap, base * 2^k)) seconds, until
    ``budget_s`` seconds have passed since the first failure (then :class:`StoreUnavailable`). ``attempts`` > 0
    also stops after that many attempts (tests)."""

    budget_s: float = 300.0
    base_s: float = 0.1
    cap_s: float = 10.0
    attempts: int = 0

    @classmethod
    def from_env(cls) -> "RetryPolicy":
        return cls(budget_s=_env_float("DINOPIPE_STORAGE_RETRY_S", cls.budget_s),
                   cap_s=_env_float("DINOPIPE_STORAGE_BACKOFF_CAP_S", cls.cap_s),
                   attempts=int(_env_float("DINOPIPE_STORAGE_ATTEMPTS", 0)))

    def wait(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap_s, self.base_s * 2 ** min(attempt, 60)))


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"{name} must be a number of seconds >= 0, got {raw!r}")
    return value


def is_url(path: Any) -> bool:
    """True for ``proto://...`` (s3, gs, memory, file, ...); plain paths and ``os.PathLike`` are local."""
    if not isinstance(path, str):
        return False
    head, sep, _ = path.partition("://")
    return bool(sep) and head.replace("+", "").replace("-", "").isalnum()


def protocol(url: str) -> str:
    return url.split("://", 1)[0].lower()


def join(root: str, rel: str) -> str:
    """``root`` / ``rel`` for URLs and paths alike (os.path.join would be wrong on a URL on Windows only)."""
    return f"{root.rstrip('/')}/{rel.lstrip('/')}" if is_url(root) else os.path.join(root, rel)


def _client_options(proto: str) -> dict:
    if proto in ("s3", "s3a"):
        opts: dict = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}  # we retry and count, not botocore
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["endpoint_url"] = endpoint
        return opts
    return {}  # gcsfs and the others keep their own retry loops (not counted here; docs/storage.md)


def fsspec_options(url: str) -> dict:
    """Keyword arguments for an fsspec filesystem another library opens itself (DCP's fsspec reader and writer):
    this module's endpoint and client retry settings (botocore's own retries off: the whole operation is retried
    under the store rule instead, :func:`retry_transient`), and a fresh instance (fsspec's cached one may predate
    the endpoint)."""
    return _client_options(protocol(url))


_fs_cache: dict = {}


def filesystem(url: str):
    """(fsspec filesystem, path without the protocol) for ``url``; one client per protocol and process.

    Missing client packages become a one-line hint (``pip install 'dinopipe[s3]'``), not a traceback."""
    import fsspec

    proto = protocol(url)
    key = (proto, os.getpid(), os.environ.get("AWS_ENDPOINT_URL_S3"), os.environ.get("AWS_ENDPOINT_URL"))
    fs = _fs_cache.get(key)
    if fs is None:
        try:
            cls = fsspec.get_filesystem_class(proto)
        except (ImportError, ValueError) as e:
            extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}.get(proto)
            hint = f"; install it with: pip install 'dinopipe[{extra}]'" if extra else ""
            raise MissingExtra(f"cannot open {proto}:// URLs ({url}): {str(e).splitlines()[0]}{hint}") from None
        fs = cls(**_client_options(proto), skip_instance_cache=True)
        if proto in ("s3", "s3a"):
            fs.retries = 1  # s3fs's own loop off: every retry goes through call() and is counted
        _fs_cache[key] = fs
    return fs, fs._strip_protocol(url)


def classify(exc: BaseException) -> tuple[str, bool]:
    """(kind, transient) of an error raised by a storage client (s3fs / botocore / aiohttp / gcsfs / obstore / OS).
    A kind in :data:`REFUSED_KINDS` is a refusal (:func:`refused`), not an unreadable object."""
    if isinstance(exc, Unreadable):
        return exc.reason, False
    if isinstance(exc, StoreRefused):
        return FORBIDDEN, False
    if type(exc).__module__ == "tarfile":  # a tar reader's error is about bytes, not the connection (its cause may be)
        cause = exc.__cause__ or exc.__context__
        return classify(cause) if cause is not None else (READ_ERROR, False)
    chain = [e for e in (exc, exc.__cause__, exc.__context__) if e is not None]
    for e in chain:
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code", "")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0
            if code == "NoSuchBucket":
                return NO_BUCKET, False
            if code in _CREDENTIAL_CODES or status == 401:
                return CREDENTIALS, False
            if code in _FORBIDDEN_CODES or status == 403:
                return FORBIDDEN, False
            if code in _THROTTLE or status in (429, 503) and code not in _SERVER:
                return "throttled", True
            if code in _SERVER or int(status) >= 500:
                return "server_error", True
            if code in ("PreconditionFailed", "412") or status == 412:
                return CHANGED, False
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                return MISSING, False
    names = " ".join(type(e).__name__ for e in chain)
    if any(n in names for n in _CREDENTIAL_ERRORS):
        return CREDENTIALS, False
    if isinstance(exc, PermissionError) or "PermissionDeniedError" in names:
        return FORBIDDEN, False
    if isinstance(exc, FileNotFoundError):
        return MISSING, False
    if isinstance(exc, OSError) and exc.errno in (errno.EBUSY, errno.EAGAIN):  # s3fs's SlowDown / 503 / 409
        return "throttled", True
    if isinstance(exc, OSError) and exc.errno in (errno.EREMOTEIO, errno.ETIMEDOUT, errno.ECONNRESET):
        return "server_error" if exc.errno == errno.EREMOTEIO else "connection", True
    text = str(exc)
    if type(exc).__name__ == "PreconditionError":  # obstore's 412: If-Match refused
        return CHANGED, False
    obstore = type(exc).__module__.startswith("obstore")
    if obstore:  # object_store quotes the store's error body: its code names a refusal
        if "NoSuchBucket" in text:
            return NO_BUCKET, False
        if any(code in text for code in _CREDENTIAL_CODES):
            return CREDENTIALS, False
        if any(code in text for code in _FORBIDDEN_CODES - {"403"}):
            return FORBIDDEN, False
    status = _STATUS.search(text) if obstore else None  # obstore (object_store) names the status in its message
    if status:
        code = int(status.group(1))
        if code in (429, 503) or "SlowDown" in text:
            return "throttled", True
        if code >= 500:
            return "server_error", True
        return {404: NO_BUCKET if "NoSuchBucket" in text else MISSING, 412: CHANGED, 401: CREDENTIALS,
                403: FORBIDDEN}.get(code, READ_ERROR), False
    if obstore and ("HTTP error" in text or "error sending request" in text):
        return "connection", True  # a body cut short / a refused or reset connection (reqwest / hyper)
    if "key does not exist" in text or "NoSuchKey" in text:  # the CRT client's words for a 404
        return MISSING, False
    if "pre-conditions" in text or "PreconditionFailed" in text:
        return CHANGED, False
    if "SlowDown" in text or "reduce your request rate" in text:
        return "throttled", True
    if isinstance(exc, (ConnectionError, TimeoutError)) or any(n in names for n in _CONNECTION_NAMES):
        return "connection", True
    return READ_ERROR, False


def count(key: str, n: int = 1) -> None:
    with _lock:
        COUNTS[key] += n


def take_counts() -> dict[str, int]:
    """This process's counts since the last call (and reset them): the loader attaches them to a batch."""
    with _lock:
        out = dict(COUNTS)
        COUNTS.clear()
    return out


def refused(url: str, kind: str, exc: BaseException) -> StoreRefused:
    """The one-line refusal of ``url``: the kind and the store's error name, never a credential."""
    what = {FORBIDDEN: "access denied (403): check the bucket policy and the identity you run as",
            CREDENTIALS: "the credentials were refused (invalid, expired or missing): renew them",
            NO_BUCKET: "no such bucket: check the URL"}[kind]
    return StoreRefused(f"{url}: the object store refused the request: {what} [{type(exc).__name__}]")


def call(fn: Callable[[], Any], url: str, policy: Optional[RetryPolicy] = None,
         sleep: Callable[[float], None] = time.sleep):
    """``fn()`` (one request to the store) retried on transient errors (counted as ``retry/<kind>``) for up to the
    policy's budget, then :class:`StoreUnavailable`; a refusal raises :class:`StoreRefused` at once, any other
    error :class:`Unreadable` with its reason."""
    try:
        return retry_transient(fn, url, policy, sleep)
    except (StoreUnavailable, StoreRefused):
        raise
    except Exception as e:  # noqa: BLE001 - every client error is classified, none escapes unnamed
        raise Unreadable(url, classify(e)[0], type(e).__name__) from None


def retry_transient(fn: Callable[[], Any], url: str, policy: Optional[RetryPolicy] = None,
                    sleep: Callable[[float], None] = time.sleep, catch: tuple = (Exception,),
                    unwrap: Callable[[BaseException], BaseException] = lambda e: e):
    """``fn()`` (a request, or a whole operation made of requests: a DCP save) under the store rule: transient
    errors retried for up to the budget, then :class:`StoreUnavailable`; a refusal :class:`StoreRefused`; any
    other error (``unwrap`` names its cause: DCP wraps its ranks' errors) re-raised untouched."""
    policy = policy or RetryPolicy.from_env()
    start, slept, attempt = time.monotonic(), 0.0, 0
    while True:
        try:
            return fn()
        except (StoreUnavailable, StoreRefused):
            raise
        except catch as e:
            cause = unwrap(e)
            if isinstance(cause, (StoreUnavailable, StoreRefused)):
                raise cause from None
            kind, transient = classify(cause)
            if kind in REFUSED_KINDS:
                raise refused(url, kind, cause) from None
            if not transient:
                raise
            count(f"retry/{kind}")
            attempt += 1
            # an injected sleep (tests) does not pass real time: the budget counts what was asked to be slept
            elapsed = max(time.monotonic() - start, slept)
            if elapsed >= policy.budget_s or (policy.attempts and attempt >= policy.attempts):
                raise StoreUnavailable(f"{url}: still failing after {attempt} attempts in {elapsed:.0f} s "
                                       f"({kind}; retry budget {policy.budget_s:g} s)") from None
            wait = min(policy.wait(attempt - 1), max(0.0, policy.budget_s - elapsed))
            sleep(wait)
            slept += wait


class _ShortRead(ConnectionError):
    """A ranged read that returned fewer bytes than the listing promises: retried like a dropped connection."""


def read_range(url: str, offset: int, size: int, etag: Optional[str] = None, object_size: Optional[int] = None,
               policy: Optional[RetryPolicy] = None) -> bytes:
    """``size`` bytes at ``offset`` of the object at ``url`` (``size < 0``: the whole object).

    s3:// goes through obstore when installed, else s3fs (``DINOPIPE_S3_READER``: dinopipe/utils/s3_readers.py).
    With ``etag`` (S3 and S3-compatible stores) the GET carries ``If-Match``, so an object replaced since the
    listing is refused by the server itself and raises Unreadable('changed'). A read that comes back short is
    retried (a cut connection); if it stays short, the object is looked at once to name why (changed, truncated).
    """
    fs, path = filesystem(url)
    end = None if size < 0 else offset + size
    if end is not None and object_size is not None and end > object_size:
        count(f"unreadable/{TRUNCATED_OBJECT}")  # the listing itself says the bytes are not there: no retry
        raise Unreadable(url, TRUNCATED_OBJECT, f"bytes {offset}-{end} of a {object_size}-byte object")

    fast = None
    if protocol(url) in ("s3", "s3a"):
        from dinopipe.utils import s3_readers

        bucket, key, _ = fs.split_path(path)
        fast = s3_readers.getter(bucket)  # obstore (default when installed) or CRT; None: s3fs

    def get() -> bytes:
        if fast is not None:  # 3-5x less CPU per GET than s3fs (dinopipe/utils/s3_readers.py)
            data = fast(key, offset, end, etag)
        elif etag and protocol(url) in ("s3", "s3a"):
            from s3fs.core import _fetch_range  # s3fs's ranged GET with extra request keys (If-Match)

            stop = end if end is not None else (object_size if object_size is not None else fs.size(path))
            data = _fetch_range(fs, bucket, key, None, offset, stop, req_kw={"IfMatch": etag})
        else:
            data = fs.cat_file(path, start=offset or None, end=end)
        want = (end - offset) if end is not None else object_size
        if want is not None and len(data) < want:
            # A cut connection (retried) or an object that is shorter now (definite): the store says which.
            reason = _why_unreadable(fs, path, etag, object_size) if object_size is not None else READ_ERROR
            if reason in (MISSING, CHANGED, TRUNCATED_OBJECT):
                raise Unreadable(url, reason, f"{len(data)} of {want} bytes")
            raise _ShortRead(f"{len(data)} of {want} bytes")
        return data

    try:
        return call(get, url, policy)
    except Unreadable as e:
        reason = e.reason if e.reason != READ_ERROR or object_size is None else _why_unreadable(fs, path, etag,
                                                                                                 object_size)
        count(f"unreadable/{reason}")
        raise Unreadable(url, reason) from None


def _why_unreadable(fs, path: str, etag: Optional[str], object_size: int) -> str:
    try:
        fs.invalidate_cache(path)  # the answer must come from the store, not from a listing cached earlier
        info = fs.info(path)
    except FileNotFoundError:
        return MISSING
    except Exception:  # noqa: BLE001 - the store is not answering: not a definite answer, the read is retried
        return READ_ERROR
    if etag and info.get("ETag") not in (None, etag):
        return CHANGED
    return TRUNCATED_OBJECT if int(info.get("size", object_size)) < object_size else READ_ERROR


def put_atomic(local_path: str, url: str, policy: Optional[RetryPolicy] = None) -> None:
    """Upload a finished local file to ``url``. The object appears whole or not at all: S3 makes a PUT (or a
    multipart upload, completed last) visible only once complete; a killed task leaves nothing at ``url``."""
    fs, path = filesystem(url)
    call(lambda: fs.put_file(local_path, path), url, policy)


def put_tree(local_dir: str, url: str, marker: Optional[str] = None) -> int:
    """Upload every file under ``local_dir`` to ``url``/..., then ``marker`` (if given) last: a reader that
    waits for the marker never sees a half-uploaded folder. Returns the number of files uploaded."""
    n = 0
    for dirpath, _, files in os.walk(local_dir):
        for fn in sorted(files):
            full = os.path.join(dirpath, fn)
            rel = os.path.relpath(full, local_dir).replace(os.sep, "/")
            if marker and rel == marker:
                continue
            put_atomic(full, join(url, rel))
            n += 1
    if marker:
        src = os.path.join(local_dir, marker)
        if os.path.exists(src):
            put_atomic(src, join(url, marker))
            n += 1
    return n


def register_webdataset_openers(protocols: tuple[str, ...] = ("s3", "s3a", "gs", "gcs")) -> None:
    """Make ``webdataset.WebDataset("s3://...")`` stream shards through fsspec (this module's clients, endpoint and
    credential chain) instead of shelling out to ``aws s3 cp`` / ``gsutil`` (broken pipes: webdataset #473)."""
    import importlib

    gopen = importlib.import_module("webdataset.gopen")  # the module (the package re-exports a function of that name)

    def open_with_fsspec(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any):
        fs, path = filesystem(url)
        return call(lambda: fs.open(path, mode, block_size=max(bufsize, 8 << 20), cache_type="readahead"), url)

    for proto in protocols:
        gopen.gopen_schemes[proto] = open_with_fsspec


# ------------------------------------------------------------------------------------------------- listing
def etag_pack(etag: Optional[str]) -> tuple[bytes, int]:
    """An S3 ETag as 16 bytes + a part count: ``"<md5 hex>"`` -> (md5, 0), ``"<hex>-N"`` (multipart) -> (hex, N).
    Anything else (another store's tag) -> (zeros, -1): checked by size only."""
    tag = (etag or "").strip('"')
    head, _, parts = tag.partition("-")
    try:
        raw = bytes.fromhex(head)
        if len(raw) == 16 and (not parts or parts.isdigit()):
            return raw, int(parts or 0)
    except ValueError:
        pass
    return bytes(16), -1


def etag_unpack(raw: bytes, parts: int) -> Optional[str]:
    if parts < 0:
        return None
    return '"' + raw.hex() + (f"-{parts}" if parts else "") + '"'


class Listing:
    """The objects under a prefix as arrays, filled one page at a time (never one Python object per key kept):
    ``name_blob``/``name_start`` (utf-8 names relative to the prefix), ``size`` (int64), ``etag`` ((n, 16) uint8)
    and ``etag_parts`` (int32; -1: no S3 ETag). About 36 bytes + the name per object."""

    def __init__(self, root: str) -> None:
        import array

        self.root = root.rstrip("/")
        self._blob, self._start = bytearray(), array.array("q", [0])
        self._size, self._etag, self._parts = array.array("q"), bytearray(), array.array("i")

    def add(self, rel: str, size: int, etag: Optional[str]) -> None:
        self._blob += rel.encode()
        self._start.append(len(self._blob))
        self._size.append(int(size))
        raw, parts = etag_pack(etag)
        self._etag += raw
        self._parts.append(parts)

    def __len__(self) -> int:
        return len(self._size)

    def arrays(self) -> dict:
        """numpy views of the buffers (no copy: the peak stays one listing, not two). Once taken, ``add`` is
        refused (a buffer with views cannot grow)."""
        import numpy as np

        return {"name_blob": np.frombuffer(self._blob, dtype=np.uint8),
                "name_start": np.frombuffer(self._start, dtype=np.int64),
                "size": np.frombuffer(self._size, dtype=np.int64),
                "etag": np.frombuffer(self._etag, dtype=np.uint8).reshape(-1, 16),
                "etag_parts": np.frombuffer(self._parts, dtype=np.int32)}

    def name(self, i: int) -> str:
        return bytes(self._blob[self._start[i]:self._start[i + 1]]).decode()

    def etag_of(self, i: int) -> Optional[str]:
        return etag_unpack(bytes(self._etag[16 * i:16 * i + 16]), self._parts[i])

    def size_of(self, i: int) -> int:
        return self._size[i]


def list_prefix(url: str, recursive: bool = True, suffixes: Optional[tuple[str, ...]] = None,
                page_size: int = 1000) -> Listing:
    """Every object under ``url`` (a prefix; ``recursive=False``: its direct children only), listed page by page
    (S3: ListObjectsV2 with ``page_size`` keys a page, each page retried and counted), in key order."""
    out = Listing(url)
    for rel, size, etag in iter_prefix(url, recursive, suffixes, page_size):
        out.add(rel, size, etag)
    return out


def iter_prefix(url: str, recursive: bool = True, suffixes: Optional[tuple[str, ...]] = None,
                page_size: int = 1000) -> Iterator[tuple[str, int, Optional[str]]]:
    """(name relative to ``url``, size, ETag) of every object under ``url``, in key order, a page at a time: what
    :func:`list_prefix` keeps, streamed (a caller keeping only some objects -- one task's share -- holds no more)."""
    fs, path = filesystem(url)
    prefix = path.rstrip("/") + "/"

    def keep(rel: str) -> bool:
        return bool(rel) and (suffixes is None or rel.lower().endswith(suffixes))

    if protocol(url) in ("s3", "s3a"):
        bucket, key, _ = fs.split_path(prefix)
        key = key.rstrip("/") + "/" if key else ""
        token = None
        while True:
            kw = {"Bucket": bucket, "Prefix": key, "MaxKeys": page_size}
            if not recursive:
                kw["Delimiter"] = "/"
            if token:
                kw["ContinuationToken"] = token
            page = call(lambda kw=kw: fs.call_s3("list_objects_v2", **kw), url)
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(key):]
                if keep(rel):
                    yield rel, obj["Size"], obj.get("ETag")
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
    # Other protocols: fsspec's generic listing (one call; the store's client pages internally).
    found = call(lambda: fs.find(prefix, detail=True, maxdepth=None if recursive else 1), url)
    for full in sorted(found):
        info = found[full]
        rel = full[len(prefix):] if full.startswith(prefix) else full.rsplit("/", 1)[-1]
        if info.get("type", "file") == "file" and keep(rel):
            yield rel, info.get("size", 0), info.get("ETag")


__all__ = ["is_url", "protocol", "join", "filesystem", "classify", "call", "retry_transient", "fsspec_options",
           "refused", "StoreUnavailable", "StoreRefused", "MissingExtra", "TRANSIENT_KINDS", "REFUSED_KINDS",
           "read_range", "put_atomic", "put_tree", "take_counts", "count", "COUNTS", "RetryPolicy", "Unreadable",
           "MISSING", "CHANGED", "TRUNCATED_OBJECT", "READ_ERROR", "register_webdataset_openers", "Listing",
           "list_prefix", "iter_prefix", "etag_pack", "etag_unpack"]
