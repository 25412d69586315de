"""S3 clients behind one small interface: :class:`ObjectClient` (keys in one bucket, bytes in and out).

Two implementations, picked by :func:`make_client` (``storage_options={"client": ...}`` or the
``HYPERDCP_S3_CLIENT`` environment variable):

* ``"s3fs"`` (the default, :class:`S3fsClient`): s3fs's configuration (the AWS environment variables,
  ``~/.aws``, the s3fs keyword arguments in ``storage_options``) and its aiobotocore client. Every
  request is explicit, so multipart uploads run their parts in parallel under our retries, and an
  unfinished upload is aborted on failure.
* ``"obstore"`` (:class:`ObstoreClient`): the Rust ``object_store`` client. Multipart uploads are its
  own (``open_writer``), with its own retries; it exposes no abort of an unfinished upload, so a failed
  one is left to the bucket's ``AbortIncompleteMultipartUpload`` lifecycle rule.

Errors raised here are the client's own (classified by :mod:`.retry`), :class:`ObjectExists` for a failed
``If-None-Match`` put and :class:`ObjectMissing` for a 404; :mod:`.object_store` turns them into
hyperdcp errors naming the object.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any

from ..core.buffers import copy_into
from ..errors import StorageError
from .body import Body
from .retry import code_of, status_of

#: bytes a streamed GET hands over at a time (:meth:`S3fsClient.get_range_into`): small, so the client's
#: buffers are reused memory and each copy into the caller's buffer is short
STREAM_STEP = 256 << 10
#: the longest one request may take (s3fs client), waiting for a connection included: with
#: :class:`~.retry.RetryPolicy`'s total, every call is bounded by about ``total_seconds + REQUEST_SECONDS``
#: (``HYPERDCP_S3_REQUEST_SECONDS`` when the client is made)
REQUEST_SECONDS = 120.0


class ObjectExists(Exception):
    """A conditional put found the key already there (HTTP 412)."""


class ObjectMissing(Exception):
    """No object under the key (HTTP 404)."""


class ObjectClient(ABC):
    """Requests on one bucket. Thread-safe; every method is one request (the caller retries)."""

    name: str
    bucket: str
    #: whether :meth:`create_multipart` / :meth:`upload_part` / ... exist (else :meth:`open_stream`)
    explicit_multipart: bool = True
    #: whether :meth:`put` honours ``if_none_match`` (S3 since 2024, MinIO, Ceph; moto)
    conditional_put: bool = True

    @abstractmethod
    def head(self, key: str) -> int | None:
        """The object's size, None when it does not exist."""

    @abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) (fewer at the end of the object); ObjectMissing when absent."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object; ObjectMissing when absent."""

    def get_range_sized(self, key: str, start: int, end: int) -> tuple[bytes, int | None]:
        """:meth:`get_range` and the object's total size when the answer tells it (Content-Range), else None."""
        return self.get_range(key, start, end), None

    def get_range_into(self, key: str, start: int, out: Any) -> tuple[int, int | None]:
        """Bytes [start, start + n) into ``out``, a writable bytes-like or a list of them filled in order (n: their
        total size): (bytes the answer holds, the object's total size or None). Fewer than n at the end of the
        object; more when the store ignored the range (then ``out`` holds nothing meaningful). ObjectMissing
        when absent.

        This default copies :meth:`get_range_sized`'s answer; clients that can stream override it, so a
        large read lands in ``out`` without an intermediate buffer of its size."""
        views = targets(out)
        data, total = self.get_range_sized(key, start, start + sum(len(v) for v in views))
        if len(data) <= sum(len(v) for v in views):
            at = 0
            for v in views:
                k = min(len(v), len(data) - at)
                if k <= 0:
                    break
                copy_into(v[:k], memoryview(data)[at:at + k])
                at += k
        return len(data), total

    @abstractmethod
    def put(self, key: str, data: bytes | Body, *, if_none_match: bool = False) -> None:
        """One PUT (atomic) of ``data`` (bytes-like, or a :class:`~.body.Body` of several buffers); ObjectExists
        when ``if_none_match`` and the key exists."""

    @abstractmethod
    def list(self, prefix: str, delimiter: str = "") -> tuple[list[tuple[str, int]], list[str]]:
        """(objects as (key, size), common prefixes) under ``prefix``, every page."""

    @abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Delete ``keys`` (absent ones are fine)."""

    def create_multipart(self, key: str) -> str:
        raise NotImplementedError

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | Body) -> str:
        raise NotImplementedError

    def complete_multipart(self, key: str, upload_id: str, parts: list[tuple[int, str]]) -> None:
        raise NotImplementedError

    def abort_multipart(self, key: str, upload_id: str) -> None:
        raise NotImplementedError

    def list_multipart(self, prefix: str) -> list[tuple[str, str]]:
        """Unfinished multipart uploads under ``prefix`` as (key, upload id) ([] if the client cannot tell)."""
        return []

    def open_stream(self, key: str, part_bytes: int, concurrency: int) -> Any:
        """A writer (``write``, ``close``) for clients without explicit multipart requests."""
        raise NotImplementedError


def targets(out: Any) -> list[memoryview]:
    """``out`` (a writable bytes-like, or a list of them) as byte memoryviews, in order."""
    return [memoryview(o).cast("B") for o in (out if isinstance(out, (list, tuple)) else [out])]


def _body(data: bytes | Body) -> Any:
    """What botocore sends: a fresh reader of a Body (each attempt starts at its first byte), else bytes."""
    if isinstance(data, Body):
        return data.open()
    return data if isinstance(data, (bytes, bytearray)) else bytes(data)


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ("bucket", "a/b")."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"{url!r} names no bucket; use s3://BUCKET/PATH")
    return bucket, key.strip("/")


class S3fsClient(ObjectClient):
    """aiobotocore requests through s3fs's session and event loop (configured as s3fs is)."""

    name = "s3fs"

    def __init__(self, bucket: str, options: dict, request_seconds: float | None = None):
        try:
            import s3fs
            from fsspec.asyn import sync
        except ImportError:
            raise StorageError("saving to or loading from s3:// needs s3fs; pip install hyperdcp[s3]") from None
        opts = dict(options)
        ck = dict(opts.pop("config_kwargs", {}) or {})
        # one attempt per call: hyperdcp's RetryPolicy retries, with a fresh body each time (botocore's
        # "max_attempts" counts retries, not attempts, so it would add one of its own to each of ours)
        ck.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        ck.setdefault("max_pool_connections", 64)
        self.bucket = bucket
        #: seconds one request may take in all (waiting for a pooled connection included, which aiobotocore
        #: does not bound); past it the request is cancelled and raises TimeoutError (retried)
        self.request_seconds = float(os.environ.get("HYPERDCP_S3_REQUEST_SECONDS", REQUEST_SECONDS)
                                     if request_seconds is None else request_seconds)
        self.fs = s3fs.S3FileSystem(config_kwargs=ck, skip_instance_cache=True, **opts)
        self._sync = sync
        self._s3 = sync(self.fs.loop, self.fs.set_session)

    def _run(self, coro) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self.fs.loop)
        try:
            return fut.result(timeout=self.request_seconds)
        except concurrent.futures.TimeoutError:
            fut.cancel()  # the request's task is cancelled in the loop: its connection goes back to the pool
            raise TimeoutError(f"no answer within {self.request_seconds:g} s (HYPERDCP_S3_REQUEST_SECONDS)") from None

    @staticmethod
    def _missing(e: BaseException) -> bool:
        return status_of(e) == 404 or code_of(e) in ("NoSuchKey", "404", "NotFound")

    def head(self, key: str) -> int | None:
        try:
            return int(self._run(self._s3.head_object(Bucket=self.bucket, Key=key))["ContentLength"])
        except Exception as e:  # noqa: BLE001
            if self._missing(e):
                return None
            raise

    async def _get(self, key: str, rng: str | None) -> tuple[bytes, int | None]:
        kw = {"Range": rng} if rng else {}
        resp = await self._s3.get_object(Bucket=self.bucket, Key=key, **kw)
        async with resp["Body"] as body:
            data = await body.read()
        want = resp.get("ContentLength")
        if want is not None and len(data) != int(want):
            raise ConnectionResetError(f"body cut short: {len(data)} of {want} bytes")  # retried
        total = str(resp.get("ContentRange") or "").rpartition("/")[2]
        return data, int(total) if total.isdigit() else (len(data) if not rng else None)

    def get_range_sized(self, key: str, start: int, end: int) -> tuple[bytes, int | None]:
        try:
            return self._run(self._get(key, f"bytes={start}-{end - 1}"))
        except Exception as e:  # noqa: BLE001
            if self._missing(e):
                raise ObjectMissing(key) from None
            if status_of(e) == 416:  # the range starts past the end
                return b"", None
            raise

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.get_range_sized(key, start, end)[0]

    async def _get_into(self, key: str, start: int, views: list[memoryview]) -> tuple[int, int | None]:
        size = sum(len(v) for v in views)
        resp = await self._s3.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + size - 1}")
        want = resp.get("ContentLength")
        total = str(resp.get("ContentRange") or "").rpartition("/")[2]
        total = int(total) if total.isdigit() else None
        pos = 0
        ranged = resp.get("ResponseMetadata", {}).get("HTTPStatusCode") != 200 or start == 0
        async with resp["Body"] as body:
            if want is not None and int(want) > size or not ranged:
                # the store ignored the range (a whole object, or a 200 from a later offset): refused, unread
                return max(int(want or 0), size + 1), total
            for v in views:
                at = 0
                while at < len(v):
                    got = await body.readinto(v[at:at + STREAM_STEP])
                    if not got:
                        break
                    at += got
                pos += at
                if at < len(v):
                    break
            if want is None and pos == size and await body.read(1):
                return pos + 1, total  # more than asked for, without a Content-Length
        if want is not None and pos != int(want):
            raise ConnectionResetError(f"body cut short: {pos} of {want} bytes")  # retried
        return pos, total

    def get_range_into(self, key: str, start: int, out: Any) -> tuple[int, int | None]:
        views = targets(out)
        if not sum(len(v) for v in views):
            return 0, None
        try:
            return self._run(self._get_into(key, start, views))
        except Exception as e:  # noqa: BLE001
            if self._missing(e):
                raise ObjectMissing(key) from None
            if status_of(e) == 416:  # the range starts past the end
                return 0, None
            raise

    def get(self, key: str) -> bytes:
        try:
            return self._run(self._get(key, None))[0]
        except Exception as e:  # noqa: BLE001
            if self._missing(e):
                raise ObjectMissing(key) from None
            raise

    def put(self, key: str, data: bytes | Body, *, if_none_match: bool = False) -> None:
        kw = {"IfNoneMatch": "*"} if if_none_match else {}
        try:
            self._run(self._s3.put_object(Bucket=self.bucket, Key=key, Body=_body(data), **kw))
        except Exception as e:  # noqa: BLE001
            if status_of(e) == 412 or code_of(e) == "PreconditionFailed":
                raise ObjectExists(key) from None
            raise

    def list(self, prefix: str, delimiter: str = "") -> tuple[list[tuple[str, int]], list[str]]:
        objs, prefixes, token = [], [], None
        while True:
            kw: dict = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                kw["Delimiter"] = delimiter
            if token:
                kw["ContinuationToken"] = token
            resp = self._run(self._s3.list_objects_v2(**kw))
            objs += [(o["Key"], int(o["Size"])) for o in resp.get("Contents", [])]
            prefixes += [p["Prefix"] for p in resp.get("CommonPrefixes", [])]
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or not token:
                return objs, prefixes

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i:i + 1000]]
            if batch:
                self._run(self._s3.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))

    def create_multipart(self, key: str) -> str:
        return self._run(self._s3.create_multipart_upload(Bucket=self.bucket, Key=key))["UploadId"]

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | Body) -> str:
        resp = self._run(self._s3.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                              Body=_body(data)))
        return resp["ETag"]

    def complete_multipart(self, key: str, upload_id: str, parts: list[tuple[int, str]]) -> None:
        self._run(self._s3.complete_multipart_upload(
            Bucket=self.bucket, Key=key, UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": n, "ETag": t} for n, t in parts]}))

    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            self._run(self._s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id))
        except Exception as e:  # noqa: BLE001
            if not (self._missing(e) or code_of(e) == "NoSuchUpload"):
                raise

    def list_multipart(self, prefix: str) -> list[tuple[str, str]]:
        resp = self._run(self._s3.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix))
        return [(u["Key"], u["UploadId"]) for u in resp.get("Uploads", [])]


class ObstoreClient(ObjectClient):
    """The Rust object_store client (obstore): configured from the AWS environment variables and
    ``storage_options`` (obstore's S3 config keys); ``http://`` endpoints are allowed."""

    name = "obstore"
    explicit_multipart = False

    def __init__(self, bucket: str, options: dict):
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError:
            raise StorageError("the obstore S3 client needs obstore; pip install obstore") from None
        opts = dict(options)
        endpoint = opts.get("endpoint") or opts.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL", "")
        client_options = dict(opts.pop("client_options", {}) or {})
        if str(endpoint).startswith("http://"):
            client_options.setdefault("allow_http", True)
        if "endpoint_url" in opts:
            opts["endpoint"] = opts.pop("endpoint_url")
        self.bucket, self._ob = bucket, obstore
        self.store = S3Store(bucket, client_options=client_options,
                             retry_config={"max_retries": 4, "retry_timeout": timedelta(seconds=60)},
                             **opts)

    def head(self, key: str) -> int | None:
        try:
            return int(self._ob.head(self.store, key)["size"])
        except FileNotFoundError:
            return None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        try:
            return bytes(self._ob.get_range(self.store, key, start=start, end=end))
        except FileNotFoundError:
            raise ObjectMissing(key) from None
        except Exception as e:  # noqa: BLE001 - a range past the end
            if "range" in str(e).lower() and "not satisf" in str(e).lower():
                return b""
            raise

    def get(self, key: str) -> bytes:
        try:
            return bytes(self._ob.get(self.store, key).bytes())
        except FileNotFoundError:
            raise ObjectMissing(key) from None

    def put(self, key: str, data: bytes | Body, *, if_none_match: bool = False) -> None:
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            payload = data.tobytes() if isinstance(data, Body) else bytes(data)
            self._ob.put(self.store, key, payload, mode="create" if if_none_match else "overwrite",
                         use_multipart=False)
        except (AlreadyExistsError, PreconditionError):
            raise ObjectExists(key) from None

    def list(self, prefix: str, delimiter: str = "") -> tuple[list[tuple[str, int]], list[str]]:
        if delimiter:
            res = self._ob.list_with_delimiter(self.store, prefix=prefix.rstrip("/") or None)
            return [(o["path"], int(o["size"])) for o in res["objects"]], [p + "/" for p in res["common_prefixes"]]
        out = [(o["path"], int(o["size"])) for batch in self._ob.list(self.store, prefix=prefix.rstrip("/") or None)
               for o in batch]
        return out, []

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            if keys[i:i + 1000]:
                self._ob.delete(self.store, keys[i:i + 1000])

    def open_stream(self, key: str, part_bytes: int, concurrency: int) -> Any:
        return self._ob.open_writer(self.store, key, buffer_size=part_bytes, max_concurrency=concurrency)


CLIENTS = {"s3fs": S3fsClient, "obstore": ObstoreClient}
#: clients made in this process, by (pid, kind, bucket, options, endpoint env): a client costs a session and
#: the service model (0.1-1 s), and every storage of a load or save would otherwise make its own
_CACHE: dict[tuple, ObjectClient] = {}
_CACHE_LOCK = threading.Lock()
_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
        "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "HYPERDCP_S3_REQUEST_SECONDS")


def make_client(url: str, storage_options: dict | None = None) -> ObjectClient:
    """The client for ``url`` (``s3://bucket/...``): ``storage_options["client"]`` or ``HYPERDCP_S3_CLIENT``
    picks it (default s3fs); the other options go to it."""
    opts = dict(storage_options or {})
    kind = str(opts.pop("client", None) or os.environ.get("HYPERDCP_S3_CLIENT", "s3fs"))
    if kind not in CLIENTS:
        raise StorageError(f"unknown S3 client {kind!r} for {url!r}; use one of {sorted(CLIENTS)}")
    bucket, _ = split_url(url)
    key = (os.getpid(), kind, bucket, repr(sorted(opts.items())), tuple(os.environ.get(k) for k in _ENV))
    with _CACHE_LOCK:
        client = _CACHE.get(key)
        if client is None:
            client = _CACHE[key] = CLIENTS[kind](bucket, opts)
        return client


__all__ = ["CLIENTS", "ObjectClient", "ObjectExists", "ObjectMissing", "ObstoreClient", "S3fsClient", "make_client",
           "split_url"]
