"""Faulty storage for tests, built on the public Storage interface (hyperdcp.storage.base).

* :class:`FaultyFiles` wraps the files of one save (a ``SaveStaging`` or ``SaveFiles``): its data-file writers
  stall before writing or fail after closing;
* :class:`StallingLocalStorage`: a local directory whose data-file writes hang (what a persist process sees on
  a hung network file system). Served for the ``stalling://`` scheme through the documented extension point::

      hyperdcp.storage.register_storage("stalling", "tests.faults.storage:StallingLocalStorage")
      hyperdcp.async_save(state, f"stalling://{path}")   # the persist process imports it by that path

* :class:`KillAtStorage`: a local directory whose process SIGKILLs itself at one point of a save or of a
  checkpoint deletion (``killat://`` in tests/test_manager_kill.py); the points inside ``Storage.delete``
  are timed by the kernel (:func:`refuse_removals`, a seccomp filter), not by a seam in hyperdcp.

No hyperdcp function is patched: these are subclasses and wrappers of the interface's own classes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
import struct
import time

from hyperdcp.format.metadata import METADATA_FILE
from hyperdcp.storage.base import FileWriter, SaveFiles, SaveStaging
from hyperdcp.storage.local import LocalStorage
from hyperdcp.storage.memory import MemoryStorage


class _FaultyWriter(FileWriter):
    def __init__(self, inner: FileWriter, stall: float, fail: str | None):
        self.inner, self.name, self.stall, self.fail = inner, inner.name, stall, fail

    def write(self, data) -> None:
        if self.stall:
            time.sleep(self.stall)
        self.inner.write(data)

    def close(self) -> None:
        self.inner.close()
        if self.fail:
            raise RuntimeError(self.fail)

    def discard(self) -> None:
        self.inner.discard()


class FaultyFiles(SaveStaging):
    """``inner``'s files, whose data files stall ``stall`` seconds before each write, or raise
    ``RuntimeError(fail)`` once written and closed (durable, yet the save fails)."""

    def __init__(self, inner: SaveFiles, *, stall: float = 0.0, fail: str | None = None):
        self.inner, self.location, self.stall, self.fail = inner, inner.location, stall, fail

    def create(self, name: str, what: str = "data file") -> FileWriter:
        w = self.inner.create(name, what)
        return _FaultyWriter(w, self.stall, self.fail) if what == "data file" else w

    def put(self, name: str, data: bytes, what: str = "metadata file") -> None:
        self.inner.put(name, data, what)

    def remove(self, name: str) -> None:
        self.inner.remove(name)

    def list(self) -> list[str]:
        return self.inner.list()

    def commit(self, record: bytes) -> None:
        self.inner.commit(record)  # type: ignore[attr-defined]

    def abort(self) -> None:
        self.inner.abort()  # type: ignore[attr-defined]

    def release(self) -> None:
        self.inner.release()  # type: ignore[attr-defined]


class StallingLocalStorage(LocalStorage):
    """``stalling:///abs/dir``: the local directory ``/abs/dir``, whose data-file writes each stall
    ``storage_options["stall_seconds"]`` (default 60) seconds first; everything else is LocalStorage's."""

    def __init__(self, url: str, storage_options: dict | None = None):
        super().__init__(url.split("://", 1)[1])
        self.stall = float((storage_options or {}).get("stall_seconds", 60))

    def begin_save(self, *, overwrite: bool) -> SaveStaging:
        return FaultyFiles(super().begin_save(overwrite=overwrite), stall=self.stall)

    def writer_at(self, location: str) -> SaveFiles:
        return FaultyFiles(super().writer_at(location), stall=self.stall)


class DiskGoneAfterWriting(MemoryStorage):
    """A MemoryStorage whose data files, while ``failing`` is set, fail once written: each is stored, then the
    save errs with ``RuntimeError(failing)``."""

    failing: str | None = None

    def begin_save(self, *, overwrite: bool) -> SaveStaging:
        return FaultyFiles(super().begin_save(overwrite=overwrite), fail=self.failing)

    def writer_at(self, location: str) -> SaveFiles:
        return FaultyFiles(super().writer_at(location), fail=self.failing)


# -- kill -9 at a chosen point (tests/test_manager_kill.py) ------------------------------------------------------
#: the environment variable naming the point, ``"<point>:<n>"``: SIGKILL at the n-th time it is reached
KILL_AT_ENV = "HYPERDCP_TEST_KILL_AT"
#: save-before-commit / save-after-commit: around ``staging.commit``; save-before-rename: the commit record durable
#: in the staging directory and the checkpoint not renamed in place; trash-renamed / trash-emptied: inside
#: ``Storage.delete``, once the checkpoint is renamed to trash (before any file of it is removed / once its files
#: are removed and its directory is not)
KILL_POINTS = ("save-before-commit", "save-before-rename", "save-after-commit", "trash-renamed", "trash-emptied")
_reached: dict[str, int] = {}


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _due(point: str) -> bool:
    """Whether this is the n-th time ``point`` is reached and it is the one ``KILL_AT_ENV`` names."""
    want, _, nth = os.environ.get(KILL_AT_ENV, "").partition(":")
    if want != point:
        return False
    _reached[point] = _reached.get(point, 0) + 1
    return _reached[point] == int(nth or 1)


def refuse_removals(files_too: bool) -> None:
    """From now on this thread's removals of directories (``rmdir``, ``unlinkat(AT_REMOVEDIR)``) -- and, with
    ``files_too``, of files (every ``unlinkat``/``unlink``) -- fail with EPERM: a seccomp filter (Linux x86-64),
    irreversible, so the caller kills itself right after. The kernel, not a hyperdcp seam, stops the deletion."""
    if platform.machine() != "x86_64":
        raise OSError(errno.ENOSYS, "refuse_removals: the seccomp filter is written for x86-64")
    NR_UNLINK, NR_RMDIR, NR_UNLINKAT, AT_REMOVEDIR = 87, 84, 263, 0x200
    LD, JEQ, JSET, RET = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    ALLOW, EPERM = 0x7FFF0000, 0x00050000 | errno.EPERM
    prog = [(LD, 0, 0, 4), (JEQ, 0, 9, 0xC000003E),                 # arch != x86-64: allow
            (LD, 0, 0, 0), (JEQ, 6, 0, NR_RMDIR),                   # nr; rmdir: refuse
            (JEQ, 0, 1, NR_UNLINK), (RET, 0, 0, EPERM if files_too else ALLOW),
            (JEQ, 0, 4, NR_UNLINKAT), (LD, 0, 0, 32),               # unlinkat: its flags (args[2], low word)
            (JSET, 1, 0, AT_REMOVEDIR), (RET, 0, 0, EPERM if files_too else ALLOW),
            (RET, 0, 0, EPERM), (RET, 0, 0, ALLOW)]
    buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in prog))
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) != 0:  # NO_NEW_PRIVS, SECCOMP
        e = ctypes.get_errno()
        raise OSError(e, f"refuse_removals: cannot install the seccomp filter: {os.strerror(e)}")


class _KillingStaging(FaultyFiles):
    """A staged save whose process SIGKILLs itself just before, inside or just after its commit."""

    def commit(self, record: bytes) -> None:
        if _due("save-before-commit"):
            kill_self()
        if _due("save-before-rename"):
            # the state LocalStaging.commit reaches just before its rename: the record durable (temporary name,
            # fsync, rename, directory fsync) in the staging directory, nothing at the checkpoint path yet
            self.inner.put(METADATA_FILE, record, "commit record")
            kill_self()
        self.inner.commit(record)  # type: ignore[attr-defined]
        if _due("save-after-commit"):
            kill_self()


class KillAtStorage(LocalStorage):
    """``killat:///abs/dir``: the local directory ``/abs/dir``, whose process SIGKILLs itself at the point
    ``os.environ[KILL_AT_ENV]`` names (see :data:`KILL_POINTS`); without it, plain LocalStorage."""

    def __init__(self, url: str, storage_options: dict | None = None):
        super().__init__(url.split("://", 1)[1])

    def begin_save(self, *, overwrite: bool) -> SaveStaging:
        return _KillingStaging(super().begin_save(overwrite=overwrite))

    def delete(self, name: str) -> None:
        point = next((p for p in ("trash-renamed", "trash-emptied") if _due(p)), None)
        if point is None:
            return super().delete(name)
        refuse_removals(files_too=point == "trash-renamed")
        try:
            super().delete(name)  # renames to trash, then its removal is refused: StorageError
        except Exception:  # noqa: BLE001 - any failure: the deletion stopped where the filter stopped it
            kill_self()
        os._exit(4)  # the deletion completed although removals were refused: the campaign reports "not killed"
