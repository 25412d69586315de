"""LocalStorage: a checkpoint in a local (or mounted) directory.

Reads: every file is opened once, ``O_NOFOLLOW | O_NONBLOCK`` relative to the checkpoint directory and
checked to be a regular file (:mod:`.safe_open`), then read with ``preadv`` straight into the caller's
buffer. Saves: :meth:`LocalStorage.begin_save` is today's :class:`~.local_commit.SaveTarget` (lock,
sibling temporary directory, fsyncs, ``renameat2`` swap or two renames, recovery), so the saving
protocol of docs/FORMAT.md is unchanged; writers create files with ``O_EXCL`` and fsync them on close.
"""

from __future__ import annotations

import os
import secrets
import threading

from ..errors import CheckpointExistsError, CorruptionError, StorageError
from .base import FileWriter, SaveFiles, SaveStaging, Storage
from .local_commit import _OLD, _TMP, SaveTarget, _rmtree, fsync_dir
from .safe_open import open_dir, open_regular, pread_exact, read_regular

_WRITE_SLICE = 64 << 20
#: marks a checkpoint being deleted (renamed out of the listing first): ``.<name>.hyperdcp-trash-<token>``
_TRASH = ".hyperdcp-trash-"
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
_REPLACE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)



def pread_full(fd: int, out, offset: int, where: str, path: str, what: str) -> int:
    """Fill ``out`` from ``offset`` of ``fd`` (short reads retried); a read error is a StorageError naming
    ``where``, an early end of file a CorruptionError naming ``path``. Returns the bytes read."""
    mv = memoryview(out).cast("B")
    done = 0
    while done < len(mv):
        try:
            n = os.preadv(fd, [mv[done:]], offset + done)
        except OSError as e:
            raise StorageError(f"reading {where} failed: {e.strerror or e} (errno {e.errno}) while reading {what}; "
                               "check the storage device and retry") from None
        if n <= 0:
            raise CorruptionError(f"{path}: unexpected end of file while reading {what}")
        done += n
    return done

class LocalWriter(FileWriter):
    """A new file written with ``os.write`` and fsynced by :meth:`close`."""

    def __init__(self, path: str, what: str, flags: int = _CREATE):
        self.path, self.what = path, what
        self.name = os.path.basename(path)
        try:
            self._fd: int | None = os.open(path, flags, 0o644)
        except OSError as e:
            raise StorageError(f"cannot create {what} {path}: {e.strerror or e}") from e

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            try:
                n = os.write(self._fd, mv[:_WRITE_SLICE])
            except OSError as e:
                raise StorageError(f"writing {self.path} failed: {e.strerror or e}; check free space and "
                                   "permissions") from e
            mv = mv[n:]

    def close(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        except OSError as e:
            raise StorageError(f"fsync of {self.path} failed: {e.strerror or e}") from e
        finally:
            os.close(fd)

    def discard(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class LocalFiles(SaveFiles):
    """Files of one save in the local directory ``location``."""

    def __init__(self, location: str):
        self.location = location

    def create(self, name: str, what: str = "data file") -> LocalWriter:
        return LocalWriter(os.path.join(self.location, name), what)

    def put(self, name: str, data: bytes, what: str = "metadata file") -> None:
        """Temporary name, fsync, rename, directory fsync."""
        final = os.path.join(self.location, name)
        tmp = final + ".tmp"
        with LocalWriter(tmp, what, _REPLACE) as w:
            w.write(data)
        try:
            os.rename(tmp, final)
            fsync_dir(self.location)
        except OSError as e:
            raise StorageError(f"cannot put {what} {final} in place: {e.strerror or e}; check the directory's "
                               "permissions and free space, then save again") from e

    def remove(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.location, name))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"cannot remove {os.path.join(self.location, name)} (left by an earlier save): "
                               f"{e.strerror or e}; remove it and save again") from e

    def list(self) -> list[str]:
        try:
            return sorted(os.listdir(self.location))
        except OSError as e:
            raise StorageError(f"cannot list {self.location!r}: {e.strerror or e}") from e


class LocalStaging(LocalFiles, SaveStaging):
    """A save staged by :class:`~.local_commit.SaveTarget` in its temporary directory."""

    def __init__(self, target: SaveTarget):
        self.target = target
        super().__init__(target.prepare())

    def commit(self, record: bytes) -> None:
        self.target.commit(record)

    def abort(self) -> None:
        self.target.abort()

    def release(self) -> None:
        self.target.release()


class LocalStorage(Storage):
    """The checkpoint directory ``path`` (plain path; ``file://`` URLs are resolved by ``storage_for``)."""

    supports_writes = True
    atomic_replace = True

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        self.url = os.fspath(path)
        self.root = os.path.abspath(self.url)
        self._lock = threading.Lock()
        self._dir_fd: int | None = None
        self._fds: dict[str, tuple[int, int]] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    # -- reading ----------------------------------------------------------------------------
    def _dir(self) -> int:
        if self._dir_fd is None:
            self._dir_fd = open_dir(self.root)
        return self._dir_fd

    def _open(self, name: str, what: str) -> tuple[int, int]:
        with self._lock:
            got = self._fds.get(name)
            if got is None:
                got = self._fds[name] = open_regular(self.path(name), what, dir_fd=self._dir(), name=name)
            return got

    def size(self, name: str, what: str = "file") -> int:
        return self._open(name, what)[1]

    def read_into(self, name: str, offset: int, out, what: str = "") -> None:
        path = self.path(name)
        done = pread_full(self._open(name, "data file")[0], out, offset, f"data file {path}", path, what)
        with self._lock:
            self.bytes_read += done
            self.reads += 1

    def fetch(self, name: str, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of ``name`` (fewer at its end), not counted in ``bytes_read``:
        ``pread`` calls on the file opened once (headers; no counter is touched, so concurrent reads keep theirs)."""
        return pread_exact(self._open(name, "data file")[0], n, offset, f"data file {self.path(name)}")

    def read_all(self, name: str, limit: int, what: str = "file") -> bytes:
        with self._lock:
            dfd = self._dir()
        return read_regular(self.path(name), what, limit, dir_fd=dfd, name=name)

    def list(self) -> list[str]:
        with self._lock:
            dfd = self._dir()
        try:
            return sorted(os.listdir(dfd))
        except OSError as e:
            raise StorageError(f"cannot list checkpoint directory {self.root!r}: {e.strerror or e}") from None

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()
            if self._dir_fd is not None:
                os.close(self._dir_fd)
                self._dir_fd = None

    # -- saving -----------------------------------------------------------------------------
    def begin_save(self, *, overwrite: bool) -> LocalStaging:
        """Check the target, take the lock, clean leftovers, stage in a sibling temporary directory."""
        target = SaveTarget(self.root, overwrite=overwrite)
        try:
            return LocalStaging(target)
        except BaseException:
            target.abort()  # a failed preparation may hold the lock already: give it back
            raise

    def writer_at(self, location: str) -> LocalFiles:
        return LocalFiles(location)

    # -- a directory of checkpoints (CheckpointManager) ---------------------------------------------
    def delete(self, name: str) -> None:
        """Rename ``name`` to ``.<name>.hyperdcp-trash-<token>`` (out of every listing), fsync, then remove it."""
        if not name or name.startswith(".") or os.sep in name or name in ("..",):
            raise StorageError(f"refusing to delete {name!r} under {self.root!r}: not a checkpoint name")
        path = self.path(name)
        if not os.path.lexists(path):
            return
        if os.path.islink(path) or not os.path.isdir(path):
            raise StorageError(f"refusing to delete {path!r}: it is not a checkpoint directory (a file or a link)")
        trash = self.path(f".{name}{_TRASH}{secrets.token_hex(6)}")
        try:
            os.rename(path, trash)
            fsync_dir(self.root)
        except OSError as e:
            raise StorageError(f"cannot delete checkpoint {path!r}: {e.strerror or e}; check the permissions of "
                               f"{self.root!r}") from e
        _rmtree(trash)

    def sweep(self) -> list[str]:
        """Remove trash of killed deletions, and temporaries of killed saves whose lock no live save holds."""
        try:
            entries = os.listdir(self.root)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError(f"cannot list {self.root!r}: {e.strerror or e}") from e
        removed, saves = [], set()
        for e in entries:
            if not e.startswith("."):
                continue
            if _TRASH in e:
                _rmtree(self.path(e))
                removed.append(e)
            for mark in (_TMP, _OLD, ".hyperdcp-lock"):
                if mark in e:
                    saves.add(e[1:].split(mark, 1)[0])
        for name in sorted(n for n in saves if n and not n.startswith(".")):
            target = SaveTarget(self.path(name))
            try:
                target._lock()
            except CheckpointExistsError:
                continue  # a save to it is running: its temporary directory is not abandoned
            try:
                target._recover()  # an overwrite killed between its two renames: put the old one back
                before = set(os.listdir(self.root))
                target._clean_leftovers()
                removed.extend(sorted(before - set(os.listdir(self.root))))
            finally:
                target.release()
        return removed

    def begin_in_place(self, rank: int) -> LocalFiles:
        """The checkpoint directory itself (created if needed); never through a link or over a file."""
        p = self.root
        if os.path.islink(p):
            raise StorageError(f"rank {rank}: cannot save to {p!r}: it is a symbolic link; hyperdcp never writes "
                               "through or replaces a link: save to the directory it points to")
        if os.path.exists(p) and not os.path.isdir(p):
            raise StorageError(f"cannot save to {p!r}: it is an existing file; choose a directory path")
        try:
            os.makedirs(p, exist_ok=True)
        except OSError as e:
            raise StorageError(f"rank {rank}: cannot create checkpoint directory {p!r}: {e.strerror or e}") from e
        return LocalFiles(p)


__all__ = ["LocalStorage", "LocalFiles", "LocalStaging", "LocalWriter"]
