"""Reading checkpoints from remote storage through fsspec (read side only).

Deprecated location: the URL helpers live in :mod:`hyperdcp.storage.urls`, the byte-range storage in
:mod:`hyperdcp.storage.fsspec` (:class:`~hyperdcp.storage.fsspec.FsspecStorage`); :class:`RemoteFiles`
and the commit-record reader stay here until the sources' ChunkReader replaces them.

A checkpoint root may be a URL (``https://host/ckpt/step-100``, ``s3://bucket/ckpt/step-100``, any
protocol fsspec knows). The commit record and the data files are joined to the root with ``/``; the
metadata's file names are validated plain names, so every read stays inside the checkpoint.

* :func:`is_remote`: a URL whose protocol is not ``file``/``local`` (those, like plain paths, are
  read from the local file system with :class:`~hyperdcp.sources.base.ChunkReader`);
* :func:`read_remote_metadata_bytes` / :func:`load_remote_metadata`: the commit record from a URL;
* :class:`RemoteFiles`: ranged, verified reads of the data files with the interface of ``DataFiles``;
* :func:`open_files`: ``DataFiles`` or ``RemoteFiles`` for a root;
* :func:`local_save_path`: saves go to local paths only (remote saves raise
  :class:`~hyperdcp.errors.UnsupportedStorageError`).

Every data read is one or more ranged requests (``fs.cat_file(path, start, end)``), at most
``max_request_bytes`` each, so no read-ahead cache fetches bytes nobody asked for. Credentials and
other storage options come from fsspec's usual configuration (environment variables, config files).
Remote roots must be committed hyperdcp checkpoints: HuggingFace directories and unmerged
no-collectives async saves are recognised on local paths only.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..errors import (
    CheckpointNotFoundError,
    CorruptionError,
    FormatError,
    IncompleteCheckpointError,
    StorageError,
)
from ..format.metadata import METADATA_FILE, Metadata
from ..storage.fsspec import MAX_REQUEST_BYTES, _missing, _storage_error, filesystem
from ..storage.urls import LOCAL_PROTOCOLS, is_remote, local_path, local_save_path, url_join
from .base import ChunkReader as DataFiles

#: a commit record larger than this is refused before it is downloaded (a wrong URL, not a checkpoint)
MAX_METADATA_BYTES = 2 << 30


def read_remote_metadata_bytes(url: str) -> bytes:
    """The raw commit record of the checkpoint at ``url``; clear errors when there is none."""
    url = os.fspath(url)
    fs, root = filesystem(url)
    meta_url, meta_path = url_join(url, METADATA_FILE), url_join(root, METADATA_FILE)
    try:
        info = fs.info(meta_path)
    except FileNotFoundError as e:
        if not _missing(e):
            raise _storage_error("reading", meta_url, e.__cause__ or e) from e
        try:
            root_exists = bool(fs.exists(root))
        except Exception:  # noqa: BLE001 - best effort: many servers cannot tell
            root_exists = False
        if root_exists:
            raise IncompleteCheckpointError(
                f"incomplete checkpoint at {url!r}: it has no {METADATA_FILE} (the save did not finish or this is not "
                "a hyperdcp checkpoint; no-collectives async saves must be finalized with "
                "hyperdcp.finalize, and HuggingFace directories loaded from a local path); load an "
                "earlier checkpoint"
            ) from None
        raise CheckpointNotFoundError(f"no checkpoint at {url!r}: {meta_url} does not exist; check the URL and step") from None
    except Exception as e:  # noqa: BLE001
        raise _storage_error("reading", meta_url, e) from e
    if info.get("type", "file") != "file":
        raise FormatError(f"{meta_url} is not a regular file; the checkpoint is damaged")
    size = info.get("size")
    if size is not None and size > MAX_METADATA_BYTES:
        raise FormatError(
            f"{meta_url} is {size} bytes, more than the {MAX_METADATA_BYTES}-byte limit of a commit record; it is not "
            "hyperdcp metadata (check the URL)"
        )
    try:
        raw = fs.cat_file(meta_path)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{meta_url} disappeared while it was read; retry, or load another checkpoint") from None
    except Exception as e:  # noqa: BLE001
        raise _storage_error("reading", meta_url, e) from e
    if len(raw) > MAX_METADATA_BYTES:
        raise FormatError(f"{meta_url} is larger than the {MAX_METADATA_BYTES}-byte limit of a commit record; check the URL")
    if size is not None and len(raw) != size:
        raise CorruptionError(
            f"{meta_url}: received {len(raw)} bytes but the storage reports {size}; the transfer was cut short or the "
            "file changed; retry"
        )
    return bytes(raw)


def load_remote_metadata(url: str) -> Metadata:
    """The validated metadata of the checkpoint at ``url``."""
    from .hyperdcp import HyperdcpSource  # reads a format-2 record's chunk index beside it

    return HyperdcpSource(os.fspath(url), read_remote_metadata_bytes(url)).metadata


class RemoteFiles(DataFiles):
    """Ranged, verified reads of a checkpoint's data files through fsspec; the interface of :class:`DataFiles`.

    Each file is checked once, before its first read: its size must equal the metadata's and its
    safetensors header must describe exactly the chunks the metadata puts in it. ``bytes_read`` and
    ``reads`` count the data reads (bytes requested from storage, one per :meth:`read_into`), as
    ``DataFiles`` does; the header checks are counted apart in ``header_bytes_read``, and ``requests``
    counts every ranged request. Safe to use from several threads.
    """

    def __init__(self, root: str, metadata: Metadata, max_request_bytes: int = MAX_REQUEST_BYTES):
        super().__init__(root, metadata)
        self.url = self.root.rstrip("/")
        self._fs: Any = None  # opened on first use, so a failure happens inside the load's error exchange
        self._fs_root = ""
        self.max_request_bytes = max(1, int(max_request_bytes))
        self._checked: set[int] = set()
        self._file_locks: dict[int, threading.Lock] = {}
        self.header_bytes_read = 0
        self.requests = 0

    @property
    def fs(self) -> Any:
        """fsspec's file system for the root (created on first use)."""
        if self._fs is None:
            with self._lock:
                if self._fs is None:
                    fs, fs_root = filesystem(self.root)
                    self._fs_root = fs_root.rstrip("/")
                    self._fs = fs
        return self._fs

    def path(self, fidx: int) -> str:
        """The URL of data file ``fidx`` (for messages)."""
        return url_join(self.url, self.meta.files[fidx].name)

    def _fs_path(self, fidx: int) -> str:
        _ = self.fs  # creates the file system (and _fs_root) on first use
        return url_join(self._fs_root, self.meta.files[fidx].name)

    def fd(self, fidx: int) -> int:
        """Check data file ``fidx`` (once) and return a handle for it (``fidx`` itself)."""
        if fidx in self._checked:
            return fidx
        with self._lock:
            lock = self._file_locks.setdefault(fidx, threading.Lock())
        with lock:  # one check per file; different files are checked concurrently
            if fidx not in self._checked:
                self._check_file(fidx)
                self._checked.add(fidx)
        return fidx

    def _check_file(self, fidx: int) -> None:
        url = self.path(fidx)
        try:
            info = self.fs.info(self._fs_path(fidx))
        except FileNotFoundError as e:
            if not _missing(e):
                raise _storage_error("opening data file", url, e.__cause__ or e) from e
            raise CorruptionError(f"data file {url} is missing; the checkpoint is damaged; restore it or load another checkpoint") from None
        except Exception as e:  # noqa: BLE001
            raise _storage_error("opening data file", url, e) from e
        if info.get("islink"):
            raise FormatError(f"data file {url} is a symbolic link; hyperdcp never follows links inside a checkpoint")
        if info.get("type", "file") != "file":
            raise FormatError(f"{url} is not a regular file")
        size, want = info.get("size"), self.meta.files[fidx].nbytes
        if size is None:
            raise StorageError(
                f"cannot check data file {url}: the storage does not report its size, which hyperdcp needs to detect "
                "truncated files; serve it with a Content-Length (or from storage that reports sizes)"
            )
        if size != want:
            raise CorruptionError(f"data file {url} has {size} bytes but the metadata records {want} (truncated or replaced)")
        if getattr(self.meta, "has_checksums", True):
            self._check_header(fidx, lambda n, off: self._fetch(fidx, off, n, header=True), url)  # type: ignore[arg-type]

    def _fetch(self, fidx: int, offset: int, n: int, header: bool = False) -> bytes:
        """Bytes [offset, offset + n) of data file ``fidx`` in one ranged request (fewer at end of file)."""
        if n <= 0:
            return b""
        url = self.path(fidx)
        try:
            data = self.fs.cat_file(self._fs_path(fidx), start=offset, end=offset + n)
        except FileNotFoundError:
            raise CorruptionError(f"data file {url} is missing; the checkpoint is damaged; restore it or load another checkpoint") from None
        except Exception as e:  # noqa: BLE001
            raise _storage_error(f"reading bytes {offset}..{offset + n} of", url, e) from e
        with self._lock:
            self.requests += 1
            if header:
                self.header_bytes_read += len(data)
            else:
                self.bytes_read += len(data)
        if len(data) > n:
            raise StorageError(
                f"reading bytes {offset}..{offset + n} of {url}: the storage sent {len(data)} bytes instead of {n}; it "
                "ignores ranged requests (HTTP Range); serve the checkpoint from storage that honours them"
            )
        return data

    def read_into(self, fidx: int, offset: int, out, what: str = "") -> None:
        """Fill ``out`` (a writable bytes-like) from ``offset`` with ranged requests; a short read is corruption."""
        mv = memoryview(out).cast("B")
        self.fd(fidx)
        done = 0
        while done < len(mv):
            n = min(self.max_request_bytes, len(mv) - done)
            data = self._fetch(fidx, offset + done, n)
            if len(data) < n:
                raise CorruptionError(
                    f"{self.path(fidx)}: unexpected end of file while reading {what} (got {done + len(data)} of "
                    f"{len(mv)} bytes from offset {offset}); the file is truncated; restore it or load another checkpoint"
                )
            mv[done : done + n] = data
            done += n
        with self._lock:
            self.reads += 1

    def close(self) -> None:
        """Forget the checks (fsspec's file systems are shared instances and stay open)."""
        with self._lock:
            self._checked.clear()


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
