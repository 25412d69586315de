"""FsspecStorage: a checkpoint under a URL (``https://``, ``s3://``, any protocol fsspec knows).

Reads are ranged requests (``fs.cat_file(path, start, end)``), at most ``max_request_bytes`` each, so no
read-ahead cache fetches bytes nobody asked for; names are validated plain file names joined to the
root with ``/``, so every read stays inside the checkpoint. Credentials and other storage options come
from fsspec's usual configuration (environment variables, config files).

Saving through fsspec is not supported (:meth:`FsspecStorage.begin_save` raises UnsupportedStorageError):
``s3://`` URLs are saved and loaded by :class:`~.object_store.ObjectStorage` (its s3fs client is built on
the same fsspec configuration), which commits without renames: data objects under per-save names, the
record last, replaced objects deleted after it. :class:`~hyperdcp.sources.remote.RemoteFiles` reads any
of them through this interface.
"""

from __future__ import annotations

import threading
from typing import Any

from ..core.buffers import copy_into
from ..errors import CheckpointNotFoundError, CorruptionError, FormatError, StorageError, UnsupportedStorageError
from .base import SaveFiles, SaveStaging, Storage
from .urls import url_join

#: the largest single ranged request; bounds the transient memory of one read to this much per thread
MAX_REQUEST_BYTES = 16 << 20


def _storage_error(action: str, url: str, e: BaseException) -> StorageError:
    return StorageError(
        f"{action} {url} failed ({type(e).__name__}: {e}); check the URL, the network and the credentials "
        "(fsspec configuration), then retry"
    )


def _missing(e: FileNotFoundError) -> bool:
    """Whether fsspec's FileNotFoundError means "no such file" rather than a failure it wraps as one.

    fsspec's HTTP file system turns every failure of a size query (connection refused, 403...) into a
    FileNotFoundError raised from the original error; only a 404/410 (or no cause) is a missing file.
    """
    cause = e.__cause__
    return cause is None or isinstance(cause, FileNotFoundError) or getattr(cause, "status", None) in (404, 410)


def filesystem(url: str) -> tuple[Any, str]:
    """fsspec's file system for ``url`` and the path on it; clear errors for a missing package or protocol."""
    try:
        import fsspec.core
    except ImportError:
        raise StorageError(f"cannot read {url!r}: reading from URLs needs fsspec; pip install fsspec") from None
    try:
        fs, p = fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise StorageError(
            f"cannot read {url!r}: fsspec needs another package for this protocol ({e}); install it (aiohttp for "
            "http(s)://, s3fs for s3://, gcsfs for gs://, adlfs for az://)"
        ) from None
    except Exception as e:  # noqa: BLE001 - unknown protocol, malformed URL, credentials...
        raise _storage_error("opening", url, e) from e
    return fs, p


class FsspecStorage(Storage):
    """Read-only storage at ``url`` through fsspec (opened on first use, so failures surface inside a load's
    error exchange). Safe to use from several threads; ``requests`` counts every ranged request."""

    supports_writes = False
    atomic_replace = False

    def __init__(self, url: str, max_request_bytes: int = MAX_REQUEST_BYTES):
        super().__init__()
        self.url = url.rstrip("/")
        self.max_request_bytes = max(1, int(max_request_bytes))
        self._fs: Any = None
        self._fs_root = ""
        self._lock = threading.Lock()
        self.requests = 0

    @property
    def fs(self) -> Any:
        """fsspec's file system for the root (created on first use)."""
        if self._fs is None:
            with self._lock:
                if self._fs is None:
                    fs, root = filesystem(self.url)
                    self._fs_root = root.rstrip("/")
                    self._fs = fs
        return self._fs

    def path(self, name: str) -> str:
        """The URL of file ``name`` (for messages)."""
        return url_join(self.url, name)

    def _fs_path(self, name: str) -> str:
        _ = self.fs
        return url_join(self._fs_root, name)

    def info(self, name: str, what: str = "file") -> dict:
        """fsspec's description of file ``name``: CheckpointNotFoundError when it is missing, FormatError for a
        link or anything but a file."""
        url = self.path(name)
        try:
            info = self.fs.info(self._fs_path(name))
        except FileNotFoundError as e:
            if not _missing(e):
                raise _storage_error(f"opening {what}", url, e.__cause__ or e) from e
            raise CheckpointNotFoundError(f"{what} {url} is missing") from None
        except Exception as e:  # noqa: BLE001
            raise _storage_error(f"opening {what}", url, e) from e
        if info.get("islink"):
            raise FormatError(f"{what} {url} is a symbolic link; hyperdcp never follows links inside a checkpoint")
        if info.get("type", "file") != "file":
            raise FormatError(f"{what} {url} is not a regular file")
        return info

    def size(self, name: str, what: str = "file") -> int:
        size = self.info(name, what).get("size")
        if size is None:
            raise StorageError(
                f"cannot check {what} {self.path(name)}: the storage does not report its size, which hyperdcp needs "
                "to detect truncated files; serve it with a Content-Length (or from storage that reports sizes)"
            )
        return int(size)

    def fetch(self, name: str, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of ``name`` in one ranged request (fewer at end of file)."""
        if n <= 0:
            return b""
        url = self.path(name)
        try:
            data = self.fs.cat_file(self._fs_path(name), start=offset, end=offset + n)
        except FileNotFoundError:
            raise CorruptionError(f"{url} is missing; the checkpoint is damaged; restore it or load another "
                                  "checkpoint") from None
        except Exception as e:  # noqa: BLE001
            raise _storage_error(f"reading bytes {offset}..{offset + n} of", url, e) from e
        with self._lock:
            self.requests += 1
        if len(data) > n:
            raise StorageError(
                f"reading bytes {offset}..{offset + n} of {url}: the storage sent {len(data)} bytes instead of {n}; it "
                "ignores ranged requests (HTTP Range); serve the checkpoint from storage that honours them"
            )
        return data

    def read_into(self, name: str, offset: int, out, what: str = "") -> None:
        mv = memoryview(out).cast("B")
        done = 0
        while done < len(mv):
            n = min(self.max_request_bytes, len(mv) - done)
            data = self.fetch(name, offset + done, n)
            if len(data) < n:
                with self._lock:
                    self.bytes_read += len(data)
                raise CorruptionError(
                    f"{self.path(name)}: unexpected end of file while reading {what} (got {done + len(data)} of "
                    f"{len(mv)} bytes from offset {offset}); the file is truncated; "
                    "restore it or load another checkpoint"
                )
            copy_into(mv, data, done)
            done += n
            with self._lock:
                self.bytes_read += n
        with self._lock:
            self.reads += 1

    def read_all(self, name: str, limit: int, what: str = "file") -> bytes:
        url = self.path(name)
        size = self.info(name, what).get("size")
        if size is not None and size > limit:
            raise FormatError(f"{what} {url} has {size} bytes, more than the {limit}-byte limit; the file is damaged "
                              "or is not what hyperdcp wrote (check the URL)")
        try:
            raw = self.fs.cat_file(self._fs_path(name))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{what} {url} disappeared while it was read; retry") from None
        except Exception as e:  # noqa: BLE001
            raise _storage_error("reading", url, e) from e
        if len(raw) > limit:
            raise FormatError(f"{what} {url} is larger than the {limit}-byte limit; check the URL")
        if size is not None and len(raw) != size:
            raise CorruptionError(f"{what} {url}: received {len(raw)} bytes but the storage reports {size}; the "
                                  "transfer was cut short or the file changed; retry")
        return bytes(raw)

    def list(self) -> list[str]:
        try:
            entries = self.fs.ls(self._fs_root, detail=False)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint at {self.url!r}: nothing is stored under it; check the URL "
                                          "and step") from None
        except Exception as e:  # noqa: BLE001
            raise _storage_error("listing", self.url, e) from e
        return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries} - {""})

    def exists(self) -> bool:
        """Whether anything is at the root (best effort: many HTTP servers cannot tell; False then)."""
        try:
            return bool(self.fs.exists(self._fs_root))
        except Exception:  # noqa: BLE001
            return False

    def _unsupported(self) -> UnsupportedStorageError:
        return UnsupportedStorageError(
            f"cannot save to {self.url!r}: saving to remote storage is not supported yet; save to a local (or "
            "mounted) directory and upload it (e.g. with your storage's CLI or fsspec's put(..., recursive=True)); "
            "hyperdcp.load reads it back from the URL"
        )

    def begin_save(self, *, overwrite: bool) -> SaveStaging:
        raise self._unsupported()

    def writer_at(self, location: str) -> SaveFiles:
        raise self._unsupported()

    def begin_in_place(self, rank: int) -> SaveFiles:
        raise self._unsupported()


__all__ = ["FsspecStorage", "MAX_REQUEST_BYTES", "filesystem"]
