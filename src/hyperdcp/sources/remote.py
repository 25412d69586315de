"""Reading checkpoints from URLs: the commit record and :class:`RemoteFiles`, both through :class:`Storage`.

A checkpoint root may be a URL: ``s3://bucket/ckpt/step-100`` (read through
:class:`~hyperdcp.storage.object_store.ObjectStorage`: parallel ranged GETs with retries) or any other
protocol fsspec knows (``https://``, ``gs://``...; :class:`~hyperdcp.storage.fsspec.FsspecStorage`). The
metadata's file names are validated plain names joined to the root with ``/``, so every read stays
inside the checkpoint. The URL helpers live in :mod:`hyperdcp.storage.urls` (re-exported here).

* :func:`read_remote_metadata_bytes` / :func:`load_remote_metadata`: the commit record from a URL;
* :class:`RemoteFiles`: a :class:`~hyperdcp.sources.base.ChunkReader` whose reads go through the
  URL's :class:`~hyperdcp.storage.base.Storage` (size and header checked once per file);
* :func:`open_files`: ``ChunkReader`` or ``RemoteFiles`` for a root.

Remote roots must be committed hyperdcp checkpoints: HuggingFace directories and unmerged
no-collectives async saves are recognised on local paths only.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from ..core.buffers import copy_into, same_memory
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptionError, IncompleteCheckpointError
from ..format.metadata import METADATA_FILE, Metadata
from ..storage.base import Storage
from ..storage.fsspec import MAX_REQUEST_BYTES, filesystem
from ..storage.urls import LOCAL_PROTOCOLS, is_remote, local_path, local_save_path, storage_for, url_join
from .base import ChunkReader as DataFiles

#: bytes read with an object's size check, so that most safetensors headers need no request of their own
HEADER_PREFETCH = 64 << 10
#: a commit record larger than this is refused before it is downloaded (a wrong URL, not a checkpoint)
MAX_METADATA_BYTES = 2 << 30


def read_remote_metadata_bytes(url: str, storage: Storage | None = None) -> bytes:
    """The raw commit record of the checkpoint at ``url``; clear errors when there is none."""
    url = os.fspath(url).rstrip("/")
    st = storage if storage is not None else storage_for(url)
    meta_url = url_join(url, METADATA_FILE)
    try:
        return st.read_all(METADATA_FILE, MAX_METADATA_BYTES, "metadata file")
    except CheckpointNotFoundError:
        if st.exists():
            raise IncompleteCheckpointError(
                f"incomplete checkpoint at {url!r}: it has no {METADATA_FILE} (the save did not finish or this is not "
                "a hyperdcp checkpoint; no-collectives async saves must be finalized with "
                "hyperdcp.finalize, and HuggingFace directories loaded from a local path); load an "
                "earlier checkpoint"
            ) from None
        raise CheckpointNotFoundError(
            f"no checkpoint at {url!r}: {meta_url} does not exist; check the URL and step"
        ) from None


def load_remote_metadata(url: str) -> Metadata:
    """The validated metadata of the checkpoint at ``url``."""
    from .hyperdcp import HyperdcpSource  # reads a format-2 record's chunk index beside it

    return HyperdcpSource(os.fspath(url), read_remote_metadata_bytes(url)).metadata


class RemoteFiles(DataFiles):
    """Ranged, verified reads of a checkpoint's data files through the URL's :class:`Storage`.

    Each file is checked once, before its first read: its size must equal the metadata's and its
    safetensors header must describe exactly the chunks the metadata puts in it. When the first read
    (``fd(fidx, first=...)``) starts near the file's beginning and fits one request, the check and that read
    are one ranged GET: the bytes are kept for the :meth:`read_into` of that range that follows. ``bytes_read`` and
    ``reads`` count the data reads (bytes requested from storage, one per :meth:`read_into`), as
    ``ChunkReader`` does; the header checks are counted apart in ``header_bytes_read``, and ``requests``
    counts every request the storage made. Safe to use from several threads.
    """

    def __init__(self, root: str, metadata: Metadata, max_request_bytes: int = MAX_REQUEST_BYTES,
                 storage: Storage | None = None):
        self.storage = storage if storage is not None else storage_for(os.fspath(root).rstrip("/"))
        if storage is None and hasattr(self.storage, "max_request_bytes") and max_request_bytes != MAX_REQUEST_BYTES:
            self.storage.max_request_bytes = max(1, int(max_request_bytes))  # type: ignore[attr-defined]
        super().__init__(root, metadata, storage=self.storage)
        self.url = self.root.rstrip("/")
        self._checked: set[int] = set()
        self._file_locks: dict[int, threading.Lock] = {}
        self._checking: set[int] = set()  # files whose check is in flight
        self._fetched: dict[tuple[int, int, int], memoryview] = {}  # a first read fetched with its file's check
        self._fetched_bytes = 0
        self.header_bytes_read = 0

    @property
    def bytes_read(self) -> int:  # type: ignore[override]
        """Data bytes the storage delivered to :meth:`read_into` (header checks apart)."""
        return self.storage.bytes_read + self._fetched_bytes

    @bytes_read.setter
    def bytes_read(self, value: int) -> None:
        pass  # ChunkReader.__init__ sets 0; the storage keeps the count

    @property
    def requests(self) -> int:
        return int(getattr(self.storage, "requests", 0))

    def path(self, fidx: int) -> str:
        """The URL of data file ``fidx`` (for messages)."""
        return url_join(self.url, self.meta.files[fidx].name)

    def fd(self, fidx: int, first: tuple[int, int] | None = None, into=None) -> int:
        """Check data file ``fidx`` (once) and return a handle for it (``fidx`` itself); ``first``: the
        ``(offset, nbytes)`` about to be read (see the class docstring); ``into``: where that read goes (a
        writable bytes-like of ``nbytes``), so that bytes fetched with the check are streamed there."""
        if fidx in self._checked:
            return fidx
        with self._lock:
            lock = self._file_locks.setdefault(fidx, threading.Lock())
        with lock:  # one check per file; different files are checked concurrently
            if fidx not in self._checked:
                limit = int(getattr(self.storage, "max_request_bytes", 0) or 0)
                fold = first is not None and first[1] > 0 and first[0] <= HEADER_PREFETCH and \
                    sum(first) <= limit + HEADER_PREFETCH and getattr(self.storage, "probe", None) is not None
                # only a storage that streams (probe_into) puts the read's bytes into ``into``
                streams = getattr(self.storage, "probe_into", None) is not None
                dest = memoryview(into).cast("B") if fold and into is not None and streams else None
                if dest is not None and len(dest) != first[1]:  # type: ignore[index]
                    dest = None
                with self._lock:
                    self._checking.add(fidx)
                try:
                    head, got = self._check_file(fidx, sum(first) if fold else HEADER_PREFETCH,  # type: ignore[arg-type]
                                                 dest)
                finally:
                    with self._lock:
                        self._checking.discard(fidx)
                if fold and got >= sum(first):  # type: ignore[arg-type]
                    off, n = first  # type: ignore[misc]
                    with self._lock:  # a view (of ``into`` when given): no copy
                        self._fetched[(fidx, off, n)] = dest if dest is not None else memoryview(head)[off:off + n]
                        self.header_bytes_read -= n  # data bytes, counted when read_into takes them
                self._checked.add(fidx)
        return fidx

    def check_in_flight(self, fidx: int) -> bool:
        """Whether another thread is checking file ``fidx`` now: a :meth:`read_into` of it may go out without
        waiting (it hands its bytes over once the check passed)."""
        with self._lock:
            return fidx in self._checking and fidx not in self._checked

    def _check_file(self, fidx: int, prefetch: int = HEADER_PREFETCH,
                    into: memoryview | None = None) -> tuple[bytes | memoryview, int]:
        """Check file ``fidx``; returns (the first bytes fetched with the check, how many were fetched): up to
        ``prefetch``, of which the last ``len(into)`` go to ``into`` when given (and are not in the first)."""
        url, name = self.path(fidx), self.meta.files[fidx].name
        probe = getattr(self.storage, "probe", None)  # object stores: header bytes and size in one request
        probe_into = getattr(self.storage, "probe_into", None)  # the same, streamed into a buffer of ours
        first: bytes | memoryview = b""
        got = 0
        try:
            if probe_into is not None:
                buf = np.empty(prefetch - (len(into) if into is not None else 0), dtype=np.uint8)
                got, size = probe_into(name, [buf, into] if into is not None else buf, "data file")
                first = memoryview(buf)[:got]
                with self._lock:
                    self.header_bytes_read += got
            elif probe is not None:
                first, size = probe(name, prefetch, "data file")
                got = len(first)
                with self._lock:
                    self.header_bytes_read += got
            else:
                size = self.storage.size(name, "data file")
        except CheckpointNotFoundError:
            raise CorruptionError(f"data file {url} is missing; the checkpoint is damaged; restore it or load another "
                                  "checkpoint") from None
        want = self.meta.files[fidx].nbytes
        if size != want:
            raise CorruptionError(f"data file {url} has {size} bytes "
                                  f"but the metadata records {want} (truncated or replaced)")
        if getattr(self.meta, "has_checksums", True):
            def header(n: int, off: int) -> bytes:
                if off + n <= len(first):
                    return bytes(first[off:off + n])
                data = self.storage.fetch(name, off, n)
                with self._lock:
                    self.header_bytes_read += len(data)
                return data

            self._check_header(fidx, header, url)  # type: ignore[arg-type]
        return first, got

    def read_into(self, fidx: int, offset: int, out, what: str = "") -> None:
        """Fill ``out`` (a writable bytes-like) from ``offset`` with ranged requests; a short read is corruption.

        While another thread checks the file, this read's requests go out at once and the bytes are handed
        over only once the check passed (its error, if it fails, is the one raised)."""
        mv = memoryview(out).cast("B")
        if self.check_in_flight(fidx):
            self._then_checked(fidx, lambda: self.storage.read_into(self.meta.files[fidx].name, offset, out, what))
        else:
            self.fd(fidx, (offset, len(mv)), into=mv)
            got = self._take_fetched(fidx, offset, len(mv))
            if got is not None:
                if not same_memory(got, mv):  # (fetched with the check into ``out`` itself: nothing to copy)
                    copy_into(mv, got)
                return
            self.storage.read_into(self.meta.files[fidx].name, offset, out, what)
        with self._lock:
            self.reads += 1

    def read_bytes(self, fidx: int, offset: int, n: int, what: str = ""):
        """Bytes [offset, offset + n) of data file ``fidx`` as a buffer of their own, for callers that would
        otherwise allocate one to read into (:class:`~hyperdcp.loading.coalesced_reads.CoalescedReads` runs):
        the answer streamed into it, or the bytes fetched with the file's check. One request when ``n`` fits
        the storage's request size; otherwise a buffer filled by :meth:`read_into`."""
        if n > int(getattr(self.storage, "max_request_bytes", 0) or 0):
            out = np.empty(n, dtype=np.uint8)
            self.read_into(fidx, offset, out, what)
            return memoryview(out)

        fetch_into = getattr(self.storage, "fetch_into", None)

        def fetch():
            name = self.meta.files[fidx].name
            if fetch_into is not None:  # streamed into a buffer of ours: no intermediate copy
                buf = np.empty(n, dtype=np.uint8)
                data = memoryview(buf)[:fetch_into(name, offset, buf)]
            else:
                data = self.storage.fetch(name, offset, n)
            if len(data) < n:
                raise CorruptionError(
                    f"{self.path(fidx)}: unexpected end of file while reading {what} ({n} bytes from offset "
                    f"{offset}); the object is truncated; restore it or load another checkpoint")
            return data

        if self.check_in_flight(fidx):
            data = self._then_checked(fidx, fetch)
        else:
            self.fd(fidx, (offset, n))
            got = self._take_fetched(fidx, offset, n)
            if got is not None:
                return got
            data = fetch()
        with self._lock:
            self._fetched_bytes += len(data)
            self.reads += 1
        return memoryview(data)

    def _then_checked(self, fidx: int, request):
        """``request()``'s result, once the check another thread runs on file ``fidx`` passed (a damaged file:
        the check's error, which names what is wrong with it, rather than the request's)."""
        try:
            result = request()
        except CheckpointError:
            self.fd(fidx)
            raise
        self.fd(fidx)
        return result

    def _take_fetched(self, fidx: int, offset: int, n: int) -> memoryview | None:
        """The bytes of this read if they came with the file's check (counted as read), else None."""
        with self._lock:
            got = self._fetched.pop((fidx, offset, n), None)
            if got is not None:
                self._fetched_bytes += len(got)
                self.reads += 1
        return got

    def close(self) -> None:
        """Forget the checks and release the storage's handles."""
        with self._lock:
            self._checked.clear()
            self._fetched.clear()
        self.storage.close()


def open_files(root: str, metadata: Metadata) -> DataFiles:
    """The reader for the data files under ``root``: :class:`RemoteFiles` for URLs, else :class:`DataFiles`."""
    root = os.fspath(root)
    return RemoteFiles(root, metadata) if is_remote(root) else DataFiles(local_path(root), metadata)


__all__ = [
    "LOCAL_PROTOCOLS",
    "MAX_REQUEST_BYTES",
    "is_remote",
    "local_path",
    "url_join",
    "local_save_path",
    "filesystem",
    "read_remote_metadata_bytes",
    "load_remote_metadata",
    "RemoteFiles",
    "open_files",
]
