"""How a save to a local directory becomes visible atomically (:class:`SaveTarget`, behind
:meth:`hyperdcp.storage.local.LocalStorage.begin_save`), and the recovery of interrupted overwrites.

A save writes into a sibling temporary directory ``.<name>.hyperdcp-tmp-<token>``; data files are
fsynced by their writers; then the metadata (the commit record) is written to a temporary name,
fsynced and renamed, the directory is fsynced, and only then is the temporary directory renamed to
``<name>`` (atomically exchanged with an existing checkpoint when overwriting). A crash at any point
leaves the previous checkpoint untouched and at most a temporary directory, which the next save to
the same path removes. Concurrent saves to one path are refused through a lock file
``.<name>.hyperdcp-lock`` held by the committing process for the duration of the save and removed
when it ends (one left by a killed process is taken over and removed by the next save to the path).

Overwriting replaces only a hyperdcp checkpoint (complete, or an interrupted save of ours) or an empty
directory: a directory holding anything hyperdcp does not write, or a symbolic link, is refused with
an error naming what is there. Where ``renameat2(RENAME_EXCHANGE)`` is unavailable (NFS, ...) the
swap is two renames, ``<name>`` -> ``.<name>.hyperdcp-old-<token>`` then the temporary directory ->
``<name>``; a kill between them leaves the old checkpoint aside and nothing at ``<name>``, and the next
access to the path (save, load, read_metadata, latest_checkpoint) renames it back
(:func:`recover_interrupted_overwrite`). Setting the environment variable
``HYPERDCP_NO_RENAME_EXCHANGE=1`` forces that two-rename path (for tests, and file systems whose
RENAME_EXCHANGE misbehaves).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
import time

from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    IncompleteCheckpointError,
    StorageError,
)
from ..format.metadata import METADATA_FILE, Metadata, max_metadata_bytes
from ..format.rank_files import is_rank_file
from ..format.rank_files import merge as merge_rank_files
from .safe_open import read_regular

_TMP = ".hyperdcp-tmp-"
_OLD = ".hyperdcp-old-"
#: names hyperdcp writes inside a checkpoint directory (commit record, rank files, data files, temporaries)
_OURS = re.compile(r"hyperdcp\.json(\.tmp)?|hyperdcp\.rank-[0-9]{5,}\.json(\.tmp)?"
                   r"|(r[0-9]{5,}-([0-9A-Za-z]+-)?[0-9]{2,}|hf[0-9]{5,}|hyperdcp-index-[0-9a-z]+)\.safetensors")
#: environment switch: commit overwrites with two renames instead of renameat2(RENAME_EXCHANGE)
NO_EXCHANGE_ENV = "HYPERDCP_NO_RENAME_EXCHANGE"
#: file descriptors a save keeps in reserve so that cleaning up after it never fails for lack of them
_SPARE_FDS = 3


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


def torch_dcp_message(path: str) -> str | None:
    """If ``path`` is a torch.distributed.checkpoint directory (it has ``.metadata``), say so and what to do."""
    try:
        if not os.path.isfile(os.path.join(path, ".metadata")):
            return None
    except (OSError, ValueError):
        return None
    return (f"{path!r} is a torch.distributed.checkpoint (torch DCP) checkpoint (it has .metadata and no "
            f"{METADATA_FILE}); hyperdcp reads torch DCP checkpoints only when asked, as that means unpickling "
            ".metadata (with a restricted unpickler): pass source=\"torch-dcp\" (hyperdcp.load(sd, path, "
            "source=\"torch-dcp\"), hyperdcp inspect --source torch-dcp PATH), or convert it once with hyperdcp "
            "convert torch-dcp-to-hyperdcp PATH DST")


def _old_copies(parent: str, name: str) -> list[str]:
    try:
        return [os.path.join(parent, e) for e in os.listdir(parent or ".") if e.startswith(f".{name}{_OLD}")]
    except OSError:
        return []


def _complete_copy(path: str) -> float | None:
    """The commit time of the complete checkpoint at ``path`` (every listed data file present with its size),
    else None."""
    try:
        meta = _committed_metadata(path)
        for f in meta.files:
            st = os.stat(os.path.join(path, f.name), follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.nbytes:
                return None
        return float(meta.created_unix)
    except (CheckpointError, OSError):
        return None


def _committed_metadata(path: str) -> Metadata:
    """The validated commit record of the checkpoint directory ``path`` (or its merged rank files)."""
    try:
        raw = read_regular(os.path.join(path, METADATA_FILE), "metadata file", max_metadata_bytes(),
                           missing=FileNotFoundError)
    except FileNotFoundError:
        names = sorted(n for n in os.listdir(path) if is_rank_file(n))
        if not names:
            raise IncompleteCheckpointError(f"incomplete checkpoint at {path!r}: it has no {METADATA_FILE}") from None
        return merge_rank_files({n: read_regular(os.path.join(path, n), "rank metadata file", max_metadata_bytes())
                                 for n in names}, path)
    return Metadata.from_json(raw, where=os.path.join(path, METADATA_FILE),  # format 2: its index beside it
                              index=lambda name, n: read_regular(os.path.join(path, name), "chunk index", n))


def recover_interrupted_overwrite(path: str, wait: float = 2.0) -> bool:
    """Rename back the checkpoint an overwrite set aside, when it was killed between its two renames.

    Only acts when nothing is at ``path`` and a complete ``.<name>.hyperdcp-old-*`` copy is next to it
    (the newest by commit time is restored); it takes the save lock to do so. While a live save holds
    the lock, it waits up to ``wait`` seconds for that save to put its checkpoint in place. Returns
    True when it restored a checkpoint.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.lexists(path):
        return False
    parent, name = os.path.split(path.rstrip(os.sep))
    olds = _old_copies(parent, name)
    if not olds:
        return False
    target = SaveTarget(path)
    try:
        target._lock()
    except CheckpointExistsError:  # a save is committing right now: its second rename is imminent
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if os.path.lexists(path):
                return False
            time.sleep(0.01)
        raise IncompleteCheckpointError(
            f"no checkpoint at {path!r}: a save to it holds its lock while the previous checkpoint is set aside in "
            f"{olds[0]!r}; wait for that save to finish and retry"
        ) from None
    except StorageError as e:
        raise IncompleteCheckpointError(
            f"no checkpoint at {path!r}: an overwrite was interrupted and the previous checkpoint is set aside in "
            f"{sorted(olds)[0]!r}, but it cannot be restored here ({e}); rename that directory back to {path!r}"
        ) from None
    try:
        return target._recover()
    except OSError as e:
        raise StorageError(
            f"cannot restore the checkpoint set aside by an interrupted overwrite of {path!r} ({olds[0]!r}): "
            f"{e.strerror or e}; rename that directory back to {path!r}"
        ) from e
    finally:
        target.release()


def recover_under(root: str) -> list[str]:
    """:func:`recover_interrupted_overwrite` for every checkpoint directly under ``root`` left aside."""
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    present = set(entries)
    names = {e[1:].split(_OLD, 1)[0] for e in entries if e.startswith(".") and _OLD in e}
    return [n for n in sorted(names) if n and n not in present and recover_interrupted_overwrite(os.path.join(root, n))]


def interrupted_saves(path: str) -> list[str]:
    """Temporary directories left next to ``path`` by saves to it that never committed."""
    parent, name = os.path.split(os.path.abspath(os.fspath(path)).rstrip(os.sep))
    try:
        return sorted(os.path.join(parent, e) for e in os.listdir(parent or ".") if e.startswith(f".{name}{_TMP}"))
    except OSError:
        return []


class SaveTarget:
    """The committing side of one save (rank 0, or whichever process commits)."""

    def __init__(self, path: str, overwrite: bool = False):
        self.path = os.path.abspath(os.fspath(path))
        self.parent, self.name = _split(self.path)
        self.overwrite = overwrite
        self.tmp: str | None = None
        self._lock_fd: int | None = None
        self._spare: list[int] = []

    # -- before any data is written -----------------------------------------------------------
    def prepare(self) -> str:
        """Check the target, take the lock, clean leftovers, create the temporary directory."""
        p = self.path
        try:
            if os.path.islink(p):
                raise StorageError(
                    f"cannot save to {p!r}: it is a symbolic link (to {os.readlink(p)!r}); hyperdcp never writes "
                    "through or replaces a link: save to the directory it points to, or remove the link"
                )
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
            self._recover()
            if os.path.isdir(p):
                self._check_replaceable()
            self._clean_leftovers()
            self._reserve_fds()
            tmp = os.path.join(self.parent, f".{self.name}{_TMP}{secrets.token_hex(6)}")
            try:
                os.mkdir(tmp)
            except OSError as e:
                raise StorageError(f"cannot create {tmp!r}: {e.strerror or e}") from e
            self.tmp = tmp
        except CheckpointError:  # CheckpointExistsError is also an OSError (FileExistsError): keep it as is
            raise
        except OSError as e:
            raise StorageError(f"cannot prepare the save to {p!r}: {e.strerror or e} ({e.filename or p})") from e
        return self.tmp

    def _check_replaceable(self) -> None:
        """Refuse a directory at the path unless it is empty or holds only what hyperdcp writes."""
        p = self.path
        foreign, ours, has_record = [], 0, False
        with os.scandir(p) as it:
            for e in it:
                if e.is_file(follow_symlinks=False) and _OURS.fullmatch(e.name):
                    ours += 1
                    has_record |= e.name == METADATA_FILE
                else:
                    kind = "link" if e.is_symlink() else "directory" if e.is_dir(follow_symlinks=False) else "file"
                    foreign.append((e.name, kind))
        if foreign and has_record:  # a complete checkpoint may list data files under other names
            try:
                listed = {f.name for f in _committed_metadata(p).files}
            except CheckpointError:
                listed = set()
            foreign = [(n, k) for n, k in foreign if not (k == "file" and n in listed)]
        if foreign:
            shown = ", ".join(f"{n!r} ({k})" for n, k in sorted(foreign)[:5]) + (" ..." if len(foreign) > 5 else "")
            what = torch_dcp_message(p) or (f"{p!r} holds {len(foreign)} entr{'ies' if len(foreign) > 1 else 'y'} "
                                            f"hyperdcp did not write: {shown}")
            raise CheckpointExistsError(
                f"cannot save to {p!r}: it is not a hyperdcp checkpoint and hyperdcp only replaces its own "
                f"checkpoints (or an empty directory); {what}. Save to another path, or move those entries away"
            )
        if ours and not self.overwrite:
            if has_record:
                raise CheckpointExistsError(
                    f"a checkpoint already exists at {p!r}; pass overwrite=True to replace it (the old one stays "
                    "intact until the new one is complete) or save to a new path"
                )
            raise CheckpointExistsError(
                f"{p!r} holds an incomplete hyperdcp checkpoint (an interrupted save); pass overwrite=True to replace "
                "it or save to a new path"
            )

    def _recover(self) -> bool:
        """Under the lock: put back a checkpoint set aside by an overwrite killed between its renames."""
        if os.path.lexists(self.path):
            return False
        best = None
        for old in _old_copies(self.parent, self.name):
            when = _complete_copy(old)
            if when is not None and (best is None or when > best[0]):
                best = (when, old)
        if best is None:
            return False
        os.rename(best[1], self.path)
        fsync_dir(self.parent)
        return True

    def _reserve_fds(self) -> None:
        while len(self._spare) < _SPARE_FDS:
            self._spare.append(os.open(os.devnull, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))

    def _free_fds(self) -> None:
        """Give back the reserved descriptors, so that the cleanup that follows has them."""
        for fd in self._spare:
            os.close(fd)
        self._spare = []

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
        """Remove temporary and set-aside directories of earlier saves to this path (it is in place)."""
        for entry in os.listdir(self.parent):
            if entry.startswith(f".{self.name}{_TMP}") or entry.startswith(f".{self.name}{_OLD}"):
                _rmtree(os.path.join(self.parent, entry))

    # -- after every rank's data is durable -------------------------------------------------------
    def commit(self, metadata: bytes) -> None:
        assert self.tmp is not None
        self._free_fds()  # the commit and the removal of a replaced checkpoint use them
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
            raise StorageError(
                f"committing {self.path!r} failed: {e.strerror or e}; the previous checkpoint is intact"
            ) from e
        self.tmp = None

    def _swap_in(self) -> None:
        if os.path.isdir(self.path) and not os.path.islink(self.path) and not os.listdir(self.path):
            os.rmdir(self.path)
        if not os.path.lexists(self.path):
            os.rename(self.tmp, self.path)
            return
        if os.environ.get(NO_EXCHANGE_ENV, "") in ("", "0") and _rename_swap(self.tmp, self.path):
            self._free_fds()
            _rmtree(self.tmp, quiet=True)  # the old checkpoint; a leftover is removed by the next save
            return
        old = os.path.join(self.parent, f".{self.name}{_OLD}{secrets.token_hex(6)}")
        os.rename(self.path, old)
        # a kill here leaves the old checkpoint in `old` and nothing at the path: the next access renames it back
        os.rename(self.tmp, self.path)
        self._free_fds()
        _rmtree(old, quiet=True)

    def abort(self) -> None:
        """Remove the temporary directory (the previous checkpoint, if any, is untouched)."""
        self._free_fds()
        if self.tmp is not None:
            _rmtree(self.tmp, quiet=True)
            self.tmp = None
        self.release()

    def release(self) -> None:
        """Remove the lock file (while still holding it, see :meth:`_lock`) and unlock."""
        self._free_fds()
        if self._lock_fd is not None:
            lock = self._lock_path()
            try:
                if self._same_file(self._lock_fd, lock):
                    os.unlink(lock)
            except OSError:
                pass  # a lock file left behind is harmless: the next save locks and removes it
            os.close(self._lock_fd)
            self._lock_fd = None


def _rmtree(path: str, quiet: bool = False) -> None:
    """Remove a directory tree of ours; a failure is a :class:`StorageError` naming it (unless ``quiet``)."""
    errors: list[str] = []

    def onerror(fn, p, exc_info) -> None:
        if not isinstance(exc_info[1], FileNotFoundError):
            errors.append(f"{p}: {getattr(exc_info[1], 'strerror', None) or exc_info[1]}")

    shutil.rmtree(path, onerror=onerror)
    if errors and not quiet:
        raise StorageError(f"cannot remove {path!r} (left by an earlier save): {errors[0]}; remove it and save again")


_RENAME_EXCHANGE = 2


def _rename_swap(a: str, b: str) -> bool:
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
