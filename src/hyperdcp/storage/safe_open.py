"""The one way hyperdcp opens and reads a file inside a checkpoint.

Every open is ``O_NOFOLLOW`` (a symbolic link is refused, never followed, and its target is never read),
``O_NONBLOCK`` (a FIFO planted under an expected name cannot hang the open), relative to a directory
descriptor when one is given, and followed by an ``fstat``: only regular files are read, and never more
than a stated cap. Read errors of the operating system (EIO, EISDIR, ...) become :class:`StorageError`
naming the file, never a raw ``OSError``.
"""

from __future__ import annotations

import errno
import os
import stat

from ..errors import CheckpointNotFoundError, CorruptionError, FormatError, StorageError

_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_READ_SLICE = 64 << 20


def open_regular(path: str, what: str, *, dir_fd: int | None = None, name: str | None = None,
                 missing: type = CheckpointNotFoundError) -> tuple[int, int]:
    """Open ``path`` (or ``name`` relative to ``dir_fd``) read-only; return ``(fd, size)``.

    Raises ``missing`` when it does not exist, :class:`FormatError` for a link or anything but a regular
    file, :class:`StorageError` for other failures. ``what`` says what the file is ("data file", ...).
    """
    try:
        fd = os.open(name, _FLAGS, dir_fd=dir_fd) if dir_fd is not None and name is not None else os.open(path, _FLAGS)
    except FileNotFoundError:
        raise missing(f"{what} {path} is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP or _is_link(path):
            raise FormatError(f"{what} {path} is a symbolic link; hyperdcp never follows links inside a checkpoint "
                              "(copy the file in its place)") from None
        raise StorageError(f"cannot open {what} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise StorageError(f"cannot stat {what} {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FormatError(f"{what} {path} is not a regular file ({_kind(st.st_mode)}); the checkpoint is damaged")
    return fd, st.st_size


def pread_exact(fd: int, n: int, offset: int, where: str) -> bytes:
    """Up to ``n`` bytes at ``offset`` (fewer only at end of file); OS read errors name ``where``."""
    out, done = [], 0
    while done < n:
        try:
            b = os.pread(fd, min(n - done, _READ_SLICE), offset + done)
        except OSError as e:
            raise StorageError(f"reading {where} failed: {e.strerror or e} (errno {e.errno}); check the storage device "
                               "and retry, or load another checkpoint") from None
        if not b:
            break
        out.append(b)
        done += len(b)
    return b"".join(out)


def read_regular(path: str, what: str, max_bytes: int, *, dir_fd: int | None = None, name: str | None = None,
                 missing: type = CheckpointNotFoundError) -> bytes:
    """The whole contents of a regular file, refused (before reading) when larger than ``max_bytes``."""
    fd, size = open_regular(path, what, dir_fd=dir_fd, name=name, missing=missing)
    try:
        if size > max_bytes:
            raise FormatError(f"{what} {path} has {size} bytes, more than the {max_bytes}-byte limit; the file is "
                              "damaged or is not what hyperdcp wrote")
        raw = pread_exact(fd, size, 0, f"{what} {path}")
        if len(raw) != size:
            raise CorruptionError(f"{what} {path} changed size while being read (expected {size} bytes, got "
                                  f"{len(raw)}); retry")
        return raw
    finally:
        os.close(fd)


def open_dir(path: str, what: str = "checkpoint directory") -> int:
    """A descriptor of directory ``path`` to open the files of one checkpoint relative to."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint at {path!r}: the {what} does not exist") from None
    except OSError as e:
        raise StorageError(f"cannot open {what} {path!r}: {e.strerror or e}") from None


def _is_link(path: str) -> bool:
    try:
        return os.path.islink(path)
    except (OSError, ValueError):
        return False


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"
