"""MemoryStorage: a checkpoint's files in a dict, for tests and for the object-store save protocol.

It has no rename and no lock, like an object store, and commits the way object stores will: data files
go straight under their final names, which carry a per-save token (``location`` ends with it), and
:meth:`MemoryStaging.commit` puts ``hyperdcp.json`` last; the files of a replaced save are deleted only
after the new record is in place. A reader therefore sees the old checkpoint or the new one, never a mix.
Single writer per location (a documented precondition instead of a lock).
"""

from __future__ import annotations

import json
import secrets
import threading

from ..core.buffers import copy_into
from ..errors import CheckpointExistsError, CheckpointNotFoundError, CorruptionError, FormatError, StorageError
from ..format.metadata import METADATA_FILE
from .base import FileWriter, SaveFiles, SaveStaging, Storage


class _MemoryWriter(FileWriter):
    def __init__(self, files: "MemoryFiles", name: str):
        self.files, self.name, self._parts = files, name, []

    def write(self, data) -> None:
        self._parts.append(bytes(memoryview(data).cast("B")))

    def close(self) -> None:
        if self._parts is not None:
            self.files.storage._put(self.name, b"".join(self._parts))
            self.files.created.append(self.name)
            self._parts = None

    def discard(self) -> None:
        self._parts = None


class MemoryFiles(SaveFiles):
    """Files of one save, written under their final names."""

    def __init__(self, storage: "MemoryStorage", location: str):
        self.storage, self.location = storage, location
        self.created: list[str] = []

    def create(self, name: str, what: str = "data file") -> FileWriter:
        if name in self.storage.files:
            raise StorageError(f"cannot create {what} {self.storage.url}/{name}: it exists")
        return _MemoryWriter(self, name)

    def put(self, name: str, data: bytes, what: str = "metadata file") -> None:
        self.storage._put(name, bytes(data))

    def remove(self, name: str) -> None:
        with self.storage._lock:
            self.storage.files.pop(name, None)

    def list(self) -> list[str]:
        return self.storage.list()


class MemoryStaging(MemoryFiles, SaveStaging):
    """The committer's side: the record last, then the replaced save's files go."""

    def commit(self, record: bytes) -> None:
        st = self.storage
        keep = {f["name"] for f in json.loads(record.decode("utf-8"))["files"]} | {METADATA_FILE}
        st._put(METADATA_FILE, bytes(record))
        with st._lock:
            for name in [n for n in st.files if n not in keep]:
                del st.files[name]

    def abort(self) -> None:
        with self.storage._lock:
            for name in self.created:
                self.storage.files.pop(name, None)
        self.created = []

    def release(self) -> None:
        pass


class MemoryStorage(Storage):
    """An in-memory checkpoint location named ``url`` (for messages)."""

    supports_writes = True
    atomic_replace = False

    def __init__(self, url: str = "memory"):
        super().__init__()
        self.url = url
        self.files: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _put(self, name: str, data: bytes) -> None:
        with self._lock:
            self.files[name] = data

    def _get(self, name: str, what: str) -> bytes:
        with self._lock:
            data = self.files.get(name)
        if data is None:
            raise CheckpointNotFoundError(f"{what} {self.url}/{name} is missing")
        return data

    def size(self, name: str, what: str = "file") -> int:
        return len(self._get(name, what))

    def read_into(self, name: str, offset: int, out, what: str = "") -> None:
        mv = memoryview(out).cast("B")
        data = self._get(name, "data file")
        if offset + len(mv) > len(data):
            raise CorruptionError(f"{self.url}/{name}: unexpected end of file while reading {what}")
        copy_into(mv, memoryview(data)[offset:offset + len(mv)])  # no bytes slice copy, and the GIL released
        with self._lock:
            self.bytes_read += len(mv)
            self.reads += 1

    def read_all(self, name: str, limit: int, what: str = "file") -> bytes:
        data = self._get(name, what)
        if len(data) > limit:
            raise FormatError(f"{what} {self.url}/{name} has {len(data)} bytes, more than the {limit}-byte limit")
        return data

    def list(self) -> list[str]:
        with self._lock:
            return sorted(self.files)

    def begin_save(self, *, overwrite: bool) -> MemoryStaging:
        if METADATA_FILE in self.files and not overwrite:
            raise CheckpointExistsError(f"a checkpoint already exists at {self.url!r}; pass overwrite=True to replace "
                                        "it (the old one stays readable until the new one is committed)")
        return MemoryStaging(self, f"{self.url}/save-{secrets.token_hex(6)}")

    def writer_at(self, location: str) -> MemoryFiles:
        return MemoryFiles(self, location)

    def begin_in_place(self, rank: int) -> MemoryFiles:
        return MemoryFiles(self, self.url)
