"""Where a checkpoint lives on disk, and how a save becomes visible atomically.

A save writes into a sibling temporary directory ``.<name>.hyperdcp-tmp-<token>``; data files are
fsynced by their writers; then the metadata (the commit record) is written to a temporary name,
fsynced and renamed, the directory is fsynced, and only then is the temporary directory renamed to
``<name>`` (atomically exchanged with an existing checkpoint when overwriting). A crash at any point
leaves the previous checkpoint untouched and at most a temporary directory, which the next save to
the same path removes. Concurrent saves to one path are refused through a lock file
``.<name>.hyperdcp-lock`` held by the committing process for the duration of the save and removed
when it ends (one left by a killed process is taken over and removed by the next save to the path).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import secrets
import shutil
import stat

from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    FormatError,
    IncompleteCheckpointError,
    StorageError,
)
from ..format.metadata import METADATA_FILE, Metadata, max_metadata_bytes

_TMP = ".hyperdcp-tmp-"
_OLD = ".hyperdcp-old-"


def _split(path: str) -> tuple[str, str]:
    path = os.path.abspath(path)
    parent, name = os.path.split(path.rstrip(os.sep))
    if not name:
        raise StorageError(f"{path!r} cannot be a checkpoint path; name a directory below it")
    return parent, name


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_metadata_bytes(path: str) -> bytes:
    """The raw commit record of the checkpoint at ``path``; clear errors when there is none."""
    path = os.fspath(path)
    if not os.path.exists(path):
        if interrupted_saves(path):
            raise IncompleteCheckpointError(
                f"incomplete checkpoint at {path!r}: a save to it was interrupted before it committed (only its "
                "temporary directory exists); load an earlier checkpoint, or save again to clean it up"
            )
        raise CheckpointNotFoundError(f"no checkpoint at {path!r}: the path does not exist; check the path and step")
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{path!r} is a file, not a checkpoint directory")
    meta = os.path.join(path, METADATA_FILE)
    from .safe_open import read_regular  # no-follow, non-blocking, regular files only, size-capped

    try:
        return read_regular(meta, "metadata file", max_metadata_bytes(), missing=FileNotFoundError)
    except FileNotFoundError:
        from ..async_save.rank_files import merged_metadata_bytes  # no-collectives async saves: merge rank files

        merged = merged_metadata_bytes(path)
        if merged is not None:
            return merged
        raise IncompleteCheckpointError(
            f"incomplete checkpoint at {path!r}: it has no {METADATA_FILE} (the save did not finish or this is "
            "not a hyperdcp checkpoint); load an earlier checkpoint"
        ) from None


def interrupted_saves(path: str) -> list[str]:
    """Temporary directories left next to ``path`` by saves to it that never committed."""
    parent, name = os.path.split(os.path.abspath(os.fspath(path)).rstrip(os.sep))
    try:
        return sorted(os.path.join(parent, e) for e in os.listdir(parent or ".") if e.startswith(f".{name}{_TMP}"))
    except OSError:
        return []


def load_metadata(path: str) -> Metadata:
    return Metadata.from_json(read_metadata_bytes(path), where=os.path.join(os.fspath(path), METADATA_FILE))


def is_complete(path: str) -> bool:
    try:
        load_metadata(path)
        return True
    except CheckpointError:
        return False


class SaveTarget:
    """The committing side of one save (rank 0, or whichever process commits)."""

    def __init__(self, path: str, overwrite: bool = False):
        self.path = os.path.abspath(os.fspath(path))
        self.parent, self.name = _split(self.path)
        self.overwrite = overwrite
        self.tmp: str | None = None
        self._lock_fd: int | None = None

    # -- before any data is written -----------------------------------------------------------
    def prepare(self) -> str:
        """Check the target, take the lock, clean leftovers, create the temporary directory."""
        p = self.path
        if os.path.exists(p) and not os.path.isdir(p):
            raise StorageError(f"cannot save to {p!r}: it is an existing file; choose a directory path")
        if not os.path.isdir(self.parent):
            try:
                os.makedirs(self.parent, exist_ok=True)
            except OSError as e:
                raise StorageError(f"cannot create parent directory {self.parent!r}: {e.strerror or e}") from e
        if not os.access(self.parent, os.W_OK | os.X_OK):
            raise StorageError(f"cannot save to {p!r}: directory {self.parent!r} is not writable (read-only?)")
        self._lock()
        if os.path.isdir(p) and not self.overwrite:
            if os.path.exists(os.path.join(p, METADATA_FILE)):
                raise CheckpointExistsError(
                    f"a checkpoint already exists at {p!r}; pass overwrite=True to replace it (the old one stays "
                    "intact until the new one is complete) or save to a new path"
                )
            if os.listdir(p):
                raise CheckpointExistsError(
                    f"{p!r} exists, is not empty and is not a hyperdcp checkpoint; pass overwrite=True to replace "
                    "it or save to a new path"
                )
        self._clean_leftovers()
        self.tmp = os.path.join(self.parent, f".{self.name}{_TMP}{secrets.token_hex(6)}")
        try:
            os.mkdir(self.tmp)
        except OSError as e:
            raise StorageError(f"cannot create {self.tmp!r}: {e.strerror or e}") from e
        return self.tmp

    def _lock_path(self) -> str:
        return os.path.join(self.parent, f".{self.name}.hyperdcp-lock")

    def _lock(self) -> None:
        """flock ``.<name>.hyperdcp-lock``; :meth:`release` unlinks it again while still holding the lock.

        Unlinking a lock file lets a racer lock a stale inode (opened before the unlink) or a new file
        (created after it), so a lock only counts once the path still names the inode we locked;
        otherwise we retry on the current file. Every holder unlinks only while locked, so two savers
        can never both hold a lock on the inode the path names.
        """
        lock = self._lock_path()
        for _ in range(100):
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            except OSError as e:
                raise StorageError(f"cannot create lock file {lock!r}: {e.strerror or e}") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise CheckpointExistsError(
                    f"another save to {self.path!r} is in progress; wait for it or save to a different path"
                ) from None
            if self._same_file(fd, lock):
                self._lock_fd = fd
                return
            os.close(fd)  # the holder we raced removed it after we opened it: lock the current file
        raise CheckpointExistsError(f"could not lock {lock!r} (other saves to {self.path!r} keep replacing it)")

    @staticmethod
    def _same_file(fd: int, path: str) -> bool:
        try:
            a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def _clean_leftovers(self) -> None:
        for entry in os.listdir(self.parent):
            if entry.startswith(f".{self.name}{_TMP}") or entry.startswith(f".{self.name}{_OLD}"):
                shutil.rmtree(os.path.join(self.parent, entry), ignore_errors=True)

    # -- after every rank's data is durable -------------------------------------------------------
    def commit(self, metadata: bytes) -> None:
        assert self.tmp is not None
        tmp_meta = os.path.join(self.tmp, METADATA_FILE + ".tmp")
        try:
            with open(tmp_meta, "wb") as f:
                f.write(metadata)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp_meta, os.path.join(self.tmp, METADATA_FILE))
            fsync_dir(self.tmp)
            self._swap_in()
            fsync_dir(self.parent)
        except OSError as e:
            raise StorageError(f"committing {self.path!r} failed: {e.strerror or e}; the previous checkpoint is intact") from e
        self.tmp = None

    def _swap_in(self) -> None:
        if os.path.isdir(self.path) and not os.listdir(self.path):
            os.rmdir(self.path)
        if not os.path.exists(self.path):
            os.rename(self.tmp, self.path)
            return
        if _exchange(self.tmp, self.path):
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        old = os.path.join(self.parent, f".{self.name}{_OLD}{secrets.token_hex(6)}")
        os.rename(self.path, old)
        os.rename(self.tmp, self.path)
        shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Remove the temporary directory (the previous checkpoint, if any, is untouched)."""
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        self.release()

    def release(self) -> None:
        """Remove the lock file (while still holding it, see :meth:`_lock`) and unlock."""
        if self._lock_fd is not None:
            lock = self._lock_path()
            try:
                if self._same_file(self._lock_fd, lock):
                    os.unlink(lock)
            except OSError:
                pass  # a lock file left behind is harmless: the next save locks and removes it
            os.close(self._lock_fd)
            self._lock_fd = None


_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two directories (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD = -100
    rc = fn(AT_FDCWD, a.encode(), AT_FDCWD, b.encode(), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP if hasattr(errno, "ENOTSUP") else errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err), b)
