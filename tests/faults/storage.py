"""Faulty storage for tests, built on the public Storage interface (hyperdcp.storage.base).

* :class:`FaultyFiles` wraps the files of one save (a ``SaveStaging`` or ``SaveFiles``): its data-file writers
  stall before writing or fail after closing;
* :class:`StallingLocalStorage`: a local directory whose data-file writes hang (what a persist process sees on
  a hung network file system). Served for the ``stalling://`` scheme through the documented extension point::

      hyperdcp.storage.register_storage("stalling", "tests.faults.storage:StallingLocalStorage")
      hyperdcp.async_save(state, f"stalling://{path}")   # the persist process imports it by that path

No hyperdcp function is patched: these are subclasses and wrappers of the interface's own classes.
"""

from __future__ import annotations

import time

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
