"""dinopipe.utils.storage on its own: URL detection, ETag packing, the retry loop's backoff and counts, reasons."""

from __future__ import annotations

import pytest

from dinopipe.utils import storage


def test_urls_and_local_paths():
    assert storage.is_url("s3://b/k") and storage.is_url("gs://b") and storage.is_url("memory://x")
    assert not storage.is_url("/data/shards") and not storage.is_url("rel/path:with://colon")
    assert storage.join("s3://b/p/", "/x.tar") == "s3://b/p/x.tar"


@pytest.mark.parametrize("etag", ['"0123456789abcdef0123456789abcdef"', '"0123456789abcdef0123456789abcdef-17"'])
def test_s3_etags_pack_into_20_bytes_and_back(etag):
    raw, parts = storage.etag_pack(etag)
    assert len(raw) == 16 and storage.etag_unpack(raw, parts) == etag


def test_other_stores_tags_are_checked_by_size_only():
    assert storage.etag_pack("CJbV8fOx3fMCEAE=") == (bytes(16), -1)
    assert storage.etag_unpack(bytes(16), -1) is None


class _SlowDown(Exception):
    response = {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}


def test_transient_errors_are_retried_with_capped_backoff_and_counted():
    storage.take_counts()
    waits, calls = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 5:
            raise _SlowDown("throttled")
        return b"ok"

    policy = storage.RetryPolicy(attempts=8, base_s=0.05, cap_s=0.2)
    assert storage.call(flaky, "s3://b/k", policy, sleep=waits.append) == b"ok"
    assert len(waits) == 4 and max(waits) <= 0.2
    assert storage.take_counts() == {"retry/throttled": 4}


def test_a_transient_error_past_the_budget_is_unfinished_and_a_definite_one_names_its_reason():
    policy = storage.RetryPolicy(budget_s=1.0, cap_s=0.3)
    waits: list = []
    with pytest.raises(storage.StoreUnavailable) as e:
        storage.call(lambda: (_ for _ in ()).throw(ConnectionResetError("reset")), "s3://b/k", policy,
                     sleep=waits.append)
    assert "s3://b/k" in str(e.value) and "connection" in str(e.value) and "retry budget 1 s" in str(e.value)
    assert sum(waits) == pytest.approx(1.0) and max(waits) <= 0.3  # the whole budget is waited, never more
    assert isinstance(e.value, storage.UnfinishedError)  # exit 75 through run_command
    with pytest.raises(storage.Unreadable) as e:
        storage.call(lambda: (_ for _ in ()).throw(FileNotFoundError("gone")), "s3://b/k", policy)
    assert e.value.reason == "missing"
    storage.take_counts()


def test_the_default_budget_is_minutes_and_the_env_sets_it(monkeypatch):
    assert storage.RetryPolicy().budget_s >= 120
    monkeypatch.setenv("DINOPIPE_STORAGE_RETRY_S", "2.5")
    assert storage.RetryPolicy.from_env().budget_s == 2.5
    monkeypatch.setenv("DINOPIPE_STORAGE_RETRY_S", "soon")
    with pytest.raises(storage.ConfigError, match="DINOPIPE_STORAGE_RETRY_S"):
        storage.RetryPolicy.from_env()


class _Refusal(Exception):
    def __init__(self, code, status):
        super().__init__(code)
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


@pytest.mark.parametrize("code,status,kind", [
    ("AccessDenied", 403, "forbidden"), ("InvalidAccessKeyId", 403, "credentials"),
    ("SignatureDoesNotMatch", 403, "credentials"), ("ExpiredToken", 400, "credentials"),
    ("NoSuchBucket", 404, "no_such_bucket")])
def test_a_refusal_is_a_config_error_at_once_naming_url_and_kind(code, status, kind):
    calls = []

    def refuse():
        calls.append(1)
        raise _Refusal(code, status)

    assert storage.classify(_Refusal(code, status)) == (kind, False)
    with pytest.raises(storage.StoreRefused) as e:
        storage.call(refuse, "s3://b/k", storage.RetryPolicy(budget_s=60), sleep=lambda s: None)
    assert len(calls) == 1 and "s3://b/k" in str(e.value) and isinstance(e.value, storage.ConfigError)


def test_s3fs_translated_errors_are_classified_by_their_errno():
    import errno

    assert storage.classify(OSError(errno.EBUSY, "Please reduce your request rate."))[1]
    assert storage.classify(OSError(errno.EREMOTEIO, "We encountered an internal error."))[1]
    assert storage.classify(PermissionError("Forbidden")) == ("forbidden", False)


def test_a_read_past_the_listed_size_is_truncated_without_retrying():
    import fsspec

    fsspec.filesystem("memory").pipe_file("/unit/obj.bin", b"x" * 100)
    assert storage.read_range("memory://unit/obj.bin", 10, 20, object_size=100) == b"x" * 20
    with pytest.raises(storage.Unreadable) as e:
        storage.read_range("memory://unit/obj.bin", 90, 20, object_size=100)
    assert e.value.reason == "truncated"
    fsspec.filesystem("memory").pipe_file("/unit/obj.bin", b"x" * 50)  # shrunk after the listing
    with pytest.raises(storage.Unreadable) as e:
        storage.read_range("memory://unit/obj.bin", 40, 20, object_size=100,
                           policy=storage.RetryPolicy(attempts=2, base_s=0.0))
    assert e.value.reason == "truncated"
    storage.take_counts()
