"""ObjectStorage: a checkpoint under an ``s3://bucket/prefix`` URL, saved and loaded without renames.

The commit protocol (docs/OBJECT_STORAGE.md): data objects go straight under their final keys, which
carry the per-save token (``r<rank>-<token>-<idx>.safetensors``), so no save ever overwrites an object a
committed checkpoint uses; :meth:`ObjectStaging.commit` puts ``hyperdcp.json`` last, with
``If-None-Match: *`` unless ``overwrite=True`` (a concurrent save that committed first makes this one fail
with CheckpointExistsError); only then are the objects of the replaced save deleted. A checkpoint exists
iff its record is there and valid, so a reader sees the old checkpoint or the new one, never a mix, and
a save killed at any point leaves nothing that lists or loads.

An object of at most ``single_put_bytes`` goes up as one PUT; larger ones are multipart uploads whose parts
(``part_bytes``) go up ``concurrency`` at a time; an upload that fails is aborted. What a writer is given
with ``write_borrowed`` (a save's staged chunks) is sent from the caller's buffers (:class:`~.body.Body`),
with no copy; what it is given with ``write`` it copies, at most about
``max(single_put_bytes, (concurrency + 1) * part_bytes + MIN_PART) + part_bytes`` bytes at a time. Reads
are ranged GETs of at most ``max_request_bytes``, issued in parallel. Every request is retried by
:class:`~.retry.RetryPolicy` (throttling, 5xx, resets) within a bounded total time.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable

from ..errors import CheckpointExistsError, CheckpointNotFoundError, CorruptionError, FormatError, StorageError
from ..format import rank_files
from ..format.metadata import METADATA_FILE
from ..format.record_v2 import index_file_name, is_index_file
from ..format.safetensors import save_token
from .base import FileWriter, SaveFiles, SaveStaging, Storage
from .body import Body
from .object_client import ObjectClient, ObjectExists, ObjectMissing, make_client, split_url, targets
from .retry import RetryPolicy, code_of
from .urls import url_join

#: bytes per multipart part and per ranged GET (S3 parts are 5 MiB .. 5 GiB, at most 10,000 per object)
PART_BYTES = 16 << 20
#: parts of one file in flight at once; ranged GETs of one read in flight at once
CONCURRENCY = 4
#: S3's smallest part but the last: a part is sent once this much more than ``part_bytes`` is buffered, so a
#: file just over a multiple of ``part_bytes`` (a header) needs no tiny extra part
MIN_PART = 5 << 20
#: a borrowed piece smaller than this is copied anyway (many tiny tensors: one buffer, not a piece each)
SMALL_PIECE = 64 << 10
#: files this save wrote or a replaced save left: deleted by abort / after a commit (never foreign files)
_OWNED = re.compile(r"^r\d{5}-(?:[0-9a-f]{12}-)?\d{2,}\.safetensors$")


def _wrap(action: str, url: str, e: BaseException) -> StorageError:
    if isinstance(e, StorageError):
        return e
    return StorageError(f"{' '.join(x for x in (action, url) if x)} failed ({type(e).__name__}: {str(e)[:300]}); "
                        "check the URL, the endpoint "
                        "(AWS_ENDPOINT_URL), the credentials and the network, then retry")


class _Upload(FileWriter):
    """One object being written: one PUT up to ``single_put_bytes``, else a parallel multipart upload.

    What is written waits in ``_pieces`` until it is sent: copies of what :meth:`write` got (and of small
    borrowed pieces), views of what :meth:`write_borrowed` got. A request's body is a :class:`~.body.Body`
    of those pieces, never one joined buffer."""

    def __init__(self, files: "ObjectFiles", name: str, what: str):
        st = files.storage
        self.storage, self.name, self.what = st, name, what
        self.key, self.url = st.key(name), st.path(name)
        self._pieces: deque = deque()  # memoryviews (borrowed, or of a copy being sent) and bytearrays (copies)
        self._tail: bytearray | None = None  # the last piece, while copies are still appended to it
        self._pending = 0  # bytes in _pieces
        self._parts: list[Future] = []
        self._upload_id: str | None = None
        self._stream: Any = None
        self._done = False
        self._size = 0
        files.created.append(name)

    def _call(self, fn: Callable[[], Any], action: str) -> Any:
        return self.storage.call(fn, f"{action} {self.what} {self.url}")

    def write(self, data) -> None:
        self._append(memoryview(data).cast("B"), copy=True)

    def write_borrowed(self, data) -> None:
        mv = memoryview(data).cast("B")
        self._append(mv, copy=len(mv) < SMALL_PIECE)

    def _started(self) -> bool:
        return self._upload_id is not None or self._stream is not None

    def _append(self, mv: memoryview, copy: bool) -> None:
        self._size += len(mv)
        pb, single = self.storage.part_bytes, self.storage.single_put_bytes
        while len(mv):
            # copies are taken a part at a time, so at most about a part's bytes are copied and unsent
            cap = pb + MIN_PART if self._started() else single + 1  # a file of at most ``single``: one PUT
            take = min(cap - self._pending, len(mv)) if copy else len(mv)
            if not copy:
                self._pieces.append(mv[:take])
                self._tail = None  # later copies go after this piece
            else:
                if self._tail is None or len(self._tail) >= pb:  # copies in buffers of about a part each
                    self._tail = bytearray()
                    self._pieces.append(self._tail)
                self._tail += mv[:take]
            self._pending += take
            mv = mv[take:]
            if self._started() or self._pending > single:  # too big for one PUT: a multipart upload from here
                while self._pending >= pb + MIN_PART:
                    self._send_part(pb)

    def _take(self, n: int) -> Body:
        """The first ``n`` pending bytes, out of ``_pieces``, as views (a piece split at ``n`` stays as its rest)."""
        out, got = [], 0
        while got < n:
            p = self._pieces[0]
            mv = memoryview(p)
            k = min(len(mv), n - got)
            out.append(mv[:k])
            if k == len(mv):
                self._pieces.popleft()
            else:
                self._pieces[0] = mv[k:]
            if p is self._tail:
                self._tail = None  # views of it are being sent: it must not grow (nor move) any more
            got += k
        self._pending -= n
        return Body(out)

    def _send_part(self, n: int | None = None) -> None:
        """Send the first ``n`` pending bytes (all by default) as the next part."""
        st, client = self.storage, self.storage.client
        body = self._take(self._pending if n is None else n)
        if not client.explicit_multipart:
            if self._stream is None:
                self._stream = client.open_stream(self.key, st.part_bytes, st.concurrency)
            try:
                self._stream.write(body.tobytes())
            except Exception as e:  # noqa: BLE001
                raise _wrap(f"uploading {self.what}", self.url, e) from e
            return
        if self._upload_id is None:
            self._upload_id = self._call(lambda: client.create_multipart(self.key), "starting the upload of")
        while sum(not f.done() for f in self._parts) >= st.concurrency:  # bounded memory: wait for a slot
            next(f for f in self._parts if not f.done()).exception()
        for f in self._parts:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        n, uid = len(self._parts) + 1, self._upload_id
        self._parts.append(st.pool.submit(
            lambda: (n, self._call(lambda: client.upload_part(self.key, uid, n, body), f"uploading part {n} of"))))

    def close(self) -> None:
        if self._done:
            return
        client = self.storage.client
        try:
            if self._stream is not None:
                if self._pending:
                    self._stream.write(self._take(self._pending).tobytes())
                self._stream.close()
            elif self._upload_id is None and self._pending <= self.storage.single_put_bytes:
                body = self._take(self._pending)
                self._call(lambda: client.put(self.key, body), "uploading")
            else:
                while self._pending > self.storage.part_bytes + MIN_PART:  # the last part: up to part + MIN_PART
                    self._send_part(self.storage.part_bytes)
                if self._pending:
                    self._send_part()
                parts = [f.result() for f in self._parts]
                try:
                    self._call(lambda: client.complete_multipart(self.key, self._upload_id, parts),
                               "completing the upload of")
                except Exception as e:  # noqa: BLE001 - a retried completion whose first attempt landed
                    if code_of(e.__cause__ or e) != "NoSuchUpload" or client.head(self.key) != self._size:
                        raise
        except BaseException as e:
            self.discard()
            raise _wrap(f"uploading {self.what}", self.url, e) from e
        self._done, self._pieces, self._tail, self._pending, self._parts = True, deque(), None, 0, []

    def discard(self) -> None:
        if self._done:
            return
        self._done = True
        for f in self._parts:
            f.cancel()
        for f in self._parts:
            if not f.cancelled():
                f.exception()
        if self._upload_id is not None:  # an unfinished multipart upload holds storage until aborted
            try:
                client, uid = self.storage.client, self._upload_id
                self._call(lambda: client.abort_multipart(self.key, uid), "aborting the upload of")
            except Exception:  # noqa: BLE001 - never raises; the commit never lists it anyway
                pass
        self._pieces, self._tail, self._pending, self._parts, self._stream = deque(), None, 0, [], None


class ObjectFiles(SaveFiles):
    """Where one rank writes the files of one save: straight under the checkpoint's prefix."""

    def __init__(self, storage: "ObjectStorage", location: str):
        self.storage, self.location = storage, location
        self.created: list[str] = []

    def create(self, name: str, what: str = "data file") -> FileWriter:
        return _Upload(self, name, what)

    def put(self, name: str, data: bytes, what: str = "metadata file") -> None:
        st, payload = self.storage, bytes(data)
        st.call(lambda: st.client.put(st.key(name), payload), f"writing {what} {st.path(name)}")

    def remove(self, name: str) -> None:
        st = self.storage
        st.call(lambda: st.client.delete([st.key(name)]), f"deleting {st.path(name)}")

    def list(self) -> list[str]:
        return self.storage.names()


class ObjectStaging(ObjectFiles, SaveStaging):
    """The committer's side: the record last (conditionally), then the replaced save's objects go."""

    def __init__(self, storage: "ObjectStorage", location: str, overwrite: bool):
        super().__init__(storage, location)
        self.overwrite = overwrite
        self.token = save_token(location.rstrip("/").rsplit("/", 1)[-1])
        #: the names under the prefix when the save began: the replaced save's and interrupted saves' objects
        self.present: list[str] = []
        self._record: bytes | None = None  # the record commit() tried to put

    def commit(self, record: bytes) -> None:
        st, rec = self.storage, bytes(record)
        where = st.path(METADATA_FILE)
        conditional = not self.overwrite and st.client.conditional_put
        self._record = rec  # from here on a failed commit may still have put the record: abort() looks first
        try:
            st.call(lambda: st.client.put(st.key(METADATA_FILE), rec, if_none_match=conditional),
                    f"writing the commit record {where}")
        except ObjectExists:
            # a retried PUT whose first attempt landed sees its own record; anything else is another save's
            if st.call(lambda: st.client.get(st.key(METADATA_FILE)), f"reading {where}") != rec:
                self._record = None
                raise CheckpointExistsError(
                    f"a checkpoint was committed at {st.url!r} by another save while this one was writing; this save "
                    "is discarded; pass overwrite=True to replace it, or save to a new path") from None
        keep = {f["name"] for f in json.loads(rec.decode("utf-8"))["files"]}
        try:  # the new record is in place: the replaced save's objects (and strays of interrupted ones) go
            st.delete_owned(lambda n: n not in keep, self.present)
            self._abort_uploads()  # a CreateMultipartUpload retried after its answer was lost left one
        except Exception:  # noqa: BLE001 - the checkpoint is committed; strays cost space, not correctness
            pass

    def abort(self) -> None:
        st, token = self.storage, self.token
        if self._record is not None and self._record_may_be_in_place():
            return  # this save may be committed: its objects stay (a later save's commit sweeps strays)
        try:
            st.delete_owned(lambda n: f"-{token}-" in n or n == index_file_name(token))
            self._abort_uploads()
        except Exception:  # noqa: BLE001 - never raises: nothing of this save is listed without its record
            pass

    def _record_may_be_in_place(self) -> bool:
        """Whether the record this save tried to put is the one at the location (or that cannot be told)."""
        st = self.storage
        try:
            return st.call(lambda: st.client.get(st.key(METADATA_FILE)), f"reading {st.path(METADATA_FILE)}") == \
                self._record
        except ObjectMissing:
            return False
        except Exception:  # noqa: BLE001 - the store does not answer: keeping the objects is the safe side
            return True

    def _abort_uploads(self) -> None:
        """Abort the unfinished multipart uploads of this save's objects (writers that died or lost an answer)."""
        st = self.storage
        for key, uid in st.call(lambda: st.client.list_multipart(st.key("")), f"listing the uploads under {st.url}"):
            if f"-{self.token}-" in key:
                st.call(lambda k=key, u=uid: st.client.abort_multipart(k, u), f"aborting the upload of {key}")

    def release(self) -> None:
        pass


class ObjectStorage(Storage):
    """The checkpoint at ``url`` (``s3://bucket/prefix``) on an S3-compatible store; see the module docstring.

    ``storage_options``: the client's keyword arguments (s3fs: ``endpoint_url``, ``key``, ``secret``,
    ``client_kwargs``...; ``"client": "obstore"`` picks the other client), plus ``part_bytes``,
    ``concurrency`` and ``single_put_bytes`` (defaults from ``HYPERDCP_S3_PART_BYTES`` /
    ``HYPERDCP_S3_CONCURRENCY`` / ``HYPERDCP_S3_SINGLE_PUT_BYTES``; the last defaults to ``concurrency *
    part_bytes``, and 0 means one PUT only for what fits one part). Safe to use
    from several threads.
    """

    supports_writes = True
    atomic_replace = False

    def __init__(self, url: str, storage_options: dict | None = None, *, client: ObjectClient | None = None,
                 part_bytes: int = PART_BYTES, concurrency: int = CONCURRENCY, policy: RetryPolicy | None = None):
        super().__init__()
        self.url = url.rstrip("/")
        self.bucket, self.prefix = split_url(self.url)
        self.storage_options = dict(storage_options or {})
        part_bytes = int(self.storage_options.pop("part_bytes", os.environ.get("HYPERDCP_S3_PART_BYTES", part_bytes)))
        concurrency = int(self.storage_options.pop("concurrency",
                                                   os.environ.get("HYPERDCP_S3_CONCURRENCY", concurrency)))
        self.part_bytes = max(5 << 20, int(part_bytes))
        self.max_request_bytes = self.part_bytes
        self.concurrency = max(1, int(concurrency))
        # objects up to single_put_bytes go up as one PUT (default: the bytes a multipart upload holds in flight
        # anyway, so the memory bound does not move): a multipart upload costs two more requests, and servers that
        # join the parts at completion (moto, some S3-compatible stores) take a second pass over the bytes
        single = self.storage_options.pop("single_put_bytes", os.environ.get("HYPERDCP_S3_SINGLE_PUT_BYTES"))
        single = self.concurrency * self.part_bytes if single in (None, "") else int(single)
        self.single_put_bytes = min(max(int(single), self.part_bytes + MIN_PART), 5 << 30)  # S3's largest PUT: 5 GiB
        self.policy = policy or RetryPolicy.from_env()
        self._client = client
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.requests = 0

    @property
    def client(self) -> ObjectClient:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    try:
                        self._client = make_client(self.url, self.storage_options)
                    except StorageError:
                        raise
                    except Exception as e:  # noqa: BLE001 - credentials, configuration
                        raise _wrap("connecting to", self.url, e) from e
        return self._client

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(4 * self.concurrency, thread_name_prefix="hyperdcp-s3")
        return self._pool

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def path(self, name: str) -> str:
        """The URL of file ``name`` (for messages)."""
        return url_join(self.url, name)

    def call(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` under the retry policy; transport errors become StorageError naming ``what``."""
        def counted():
            with self._lock:
                self.requests += 1
            return fn()
        try:
            return self.policy.call(counted, what)
        except (ObjectExists, ObjectMissing, StorageError):
            raise
        except Exception as e:  # noqa: BLE001
            raise _wrap(what, "", e) from e

    # -- load --------------------------------------------------------------------------------------
    def size(self, name: str, what: str = "file") -> int:
        n = self.call(lambda: self.client.head(self.key(name)), f"checking {what} {self.path(name)}")
        if n is None:
            raise CheckpointNotFoundError(f"{what} {self.path(name)} is missing")
        return n

    def fetch(self, name: str, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of ``name`` in one ranged GET (fewer at the end of the object): small
        reads (headers); data goes through :meth:`fetch_into`."""
        buf = bytearray(max(0, n))
        return bytes(memoryview(buf)[:self.fetch_into(name, offset, buf)])

    def fetch_into(self, name: str, offset: int, out) -> int:
        """:meth:`fetch` streamed into ``out`` (a writable bytes-like): bytes written (fewer at the object's end)."""
        mv = memoryview(out).cast("B")
        n = len(mv)
        if n == 0:
            return 0
        url = self.path(name)
        try:
            got, _ = self.call(lambda: self.client.get_range_into(self.key(name), offset, mv),
                               f"reading bytes {offset}..{offset + n} of {url}")
        except ObjectMissing:
            raise CorruptionError(f"{url} is missing; the checkpoint is damaged; restore it or load another "
                                  "checkpoint") from None
        if got > n:
            raise StorageError(f"reading bytes {offset}..{offset + n} of {url}: the store sent {got} bytes; it "
                               "ignores ranged requests (HTTP Range); use storage that honours them")
        return got

    def read_into(self, name: str, offset: int, out, what: str = "") -> None:
        mv = memoryview(out).cast("B")
        step = self.max_request_bytes
        spans = [(s, min(step, len(mv) - s)) for s in range(0, len(mv), step)]

        def one(span: tuple[int, int]) -> int:
            s, n = span
            got = self.fetch_into(name, offset + s, mv[s:s + n])  # streamed into place: no buffer of its own
            with self._lock:
                self.bytes_read += got
            return got

        if len(spans) == 1:
            got = [one(spans[0])]
        else:  # every span finished (none still writing into ``out``) before an error is raised
            futs = [self.pool.submit(one, s) for s in spans]
            wait(futs)
            got = [f.result() for f in futs]
        if any(g < n for g, (_, n) in zip(got, spans)):
            raise CorruptionError(
                f"{self.path(name)}: unexpected end of file while reading {what} ({len(mv)} bytes from offset "
                f"{offset}); "
                "the object is truncated; restore it or load another checkpoint")
        with self._lock:
            self.reads += 1

    def probe(self, name: str, n: int, what: str = "file") -> tuple[bytes, int]:
        """The first ``n`` bytes of ``name`` and its size, in one ranged GET where the store reports the size
        (Content-Range); CheckpointNotFoundError when it is missing."""
        try:
            data, size = self.call(lambda: self.client.get_range_sized(self.key(name), 0, max(1, n)),
                                   f"reading {what} {self.path(name)}")
        except ObjectMissing:
            raise CheckpointNotFoundError(f"{what} {self.path(name)} is missing") from None
        if size is None:  # an empty object (416), or a store without Content-Range
            size = self.size(name, what)
        return data[:n], size

    def probe_into(self, name: str, out, what: str = "file") -> tuple[int, int]:
        """:meth:`probe` streamed into ``out`` (a writable bytes-like, or a list of them filled in order): (bytes
        written, the object's size)."""
        views = targets(out)
        n = sum(len(v) for v in views)
        try:
            got, size = self.call(lambda: self.client.get_range_into(self.key(name), 0, views),
                                  f"reading {what} {self.path(name)}")
        except ObjectMissing:
            raise CheckpointNotFoundError(f"{what} {self.path(name)} is missing") from None
        if got > n:
            raise StorageError(f"reading {what} {self.path(name)}: the store sent {got} bytes for the first "
                               f"{n}; it ignores ranged requests (HTTP Range); use storage that honours them")
        if size is None:
            size = self.size(name, what)
        return got, size

    def read_all(self, name: str, limit: int, what: str = "file") -> bytes:
        url = self.path(name)
        raw, size = self.probe(name, limit + 1, what)  # one request; never more than limit + 1 bytes
        if size > limit:
            raise FormatError(f"{what} {url} has {size} bytes, more than the {limit}-byte limit; the object is damaged "
                              "or is not what hyperdcp wrote (check the URL)")
        if len(raw) != size:
            raise CorruptionError(f"{what} {url}: received {len(raw)} bytes but the store reports {size}; retry")
        return raw

    def names(self) -> list[str]:
        """The object names directly under the prefix ([] when none)."""
        objs, _ = self.call(lambda: self.client.list(self.key(""), "/"), f"listing {self.url}")
        base = len(self.key(""))
        return sorted({k[base:] for k, _ in objs} - {""})

    def list(self) -> list[str]:
        """The object names and child prefixes (as names, like a directory's entries) directly under the prefix."""
        objs, prefixes = self.call(lambda: self.client.list(self.key(""), "/"), f"listing {self.url}")
        base = len(self.key(""))
        names = sorted({k[base:] for k, _ in objs} | {p[base:].strip("/") for p in prefixes} - {""})
        if not names:
            raise CheckpointNotFoundError(f"no checkpoint at {self.url!r}: nothing is stored under it; check the URL "
                                          "and step")
        return names

    def delete(self, name: str) -> None:
        """Delete the checkpoint ``name`` under this prefix: its commit record first (from then on it is no
        longer a checkpoint: never listed or loaded), then the objects hyperdcp wrote for it. Objects
        hyperdcp did not write are left; absent is fine."""
        if not name or "/" in name or name in (".", ".."):
            raise StorageError(f"refusing to delete {name!r} under {self.url!r}: not a checkpoint name")
        child = ObjectStorage(f"{self.url}/{name}", self.storage_options, client=self.client)
        try:
            self.call(lambda: self.client.delete([child.key(METADATA_FILE)]),
                      f"deleting the commit record of {child.url}")
            child.delete_owned(lambda n: True)
        finally:
            child.close()

    def delete_owned(self, which: Callable[[str], bool], names: list[str] | None = None) -> None:
        """Delete the hyperdcp data and rank files under the prefix (or among ``names``) for which ``which(name)``."""
        doomed = [self.key(n) for n in (self.names() if names is None else names)
                  if (_OWNED.match(n) or rank_files.is_rank_file(n) or is_index_file(n)) and which(n)]
        if doomed:
            self.call(lambda: self.client.delete(doomed), f"deleting {len(doomed)} replaced object(s) under {self.url}")

    # -- save --------------------------------------------------------------------------------------
    def begin_save(self, *, overwrite: bool) -> ObjectStaging:
        present = self.names()  # one LIST: is there a record, and what a commit will have to clean up
        if METADATA_FILE in present and not overwrite:
            raise CheckpointExistsError(
                f"a checkpoint already exists at {self.url!r}; pass overwrite=True to replace it (the old one stays "
                "loadable until the new one is committed) or save to a new path")
        staging = ObjectStaging(self, f"{self.url}/save-{secrets.token_hex(8)}", overwrite)
        staging.present = present
        return staging

    def writer_at(self, location: str) -> ObjectFiles:
        if location.rstrip("/").rsplit("/", 1)[0] != self.url:
            raise StorageError(f"save location {location!r} is not under {self.url!r}; every rank must save to one URL")
        return ObjectFiles(self, location)

    def begin_in_place(self, rank: int) -> ObjectFiles:
        return ObjectFiles(self, self.url)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


__all__ = ["CONCURRENCY", "ObjectFiles", "ObjectStaging", "ObjectStorage", "PART_BYTES"]
