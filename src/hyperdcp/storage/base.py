"""Where one checkpoint's files live: one interface for save and load.

A :class:`Storage` is one checkpoint location (a local directory, a URL prefix). Names are the plain
file names the format validates (``hyperdcp.json``, ``r00000-<token>-00.safetensors``, ...), never
paths: every byte a save writes and a load reads goes through these methods.

Call order, load (every rank, any thread)::

    storage.size(name) -> storage.read_into(name, offset, out) ...   # exact reads; bytes_read counts them
    storage.read_all(name, limit)                                     # small files: commit record, index
    storage.close()

Call order, save (collective; the committer is rank 0)::

    committer:    staging = storage.begin_save(overwrite=...)         # checks the target, locks, stages
                  -> staging.location travels to every rank
    every writer: files = storage.writer_at(location)
                  w = files.create(name); w.write(b) ...; w.close()   # durable once close() returns
    committer:    staging.commit(record)   (or staging.abort() on any error)   # record written last
                  staging.release()                                   # always, in a finally

Call order, no-collectives save (each rank alone, see docs/FORMAT.md)::

    files = storage.begin_in_place(rank)          # files go straight under the checkpoint location
    files.create(name) ... ; files.put(rank file name, record)       # the rank's record last, atomically

``atomic_replace`` says whether an overwrite swaps the whole checkpoint at once (local: renameat2). A
store without it (object stores: :class:`~.object_store.ObjectStorage`)
still commits atomically in the format's sense -- the
checkpoint is complete iff its commit record is present and valid -- by writing data files under
per-save names and :meth:`SaveStaging.commit` putting the record last; ``location`` is then the final
prefix plus that token, so the interface needs no rename.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType


class FileWriter(ABC):
    """One file being written by one rank. Use as a context manager: an exception discards it."""

    #: the plain file name
    name: str

    @abstractmethod
    def write(self, data) -> None:
        """Append all of ``data`` (a bytes-like object)."""

    def write_borrowed(self, data) -> None:
        """Append all of ``data``, which the caller leaves unchanged until :meth:`close` returns: a writer may
        keep a view of it instead of a copy (an object store sends it from there). Default: :meth:`write`."""
        self.write(data)

    @abstractmethod
    def close(self) -> None:
        """Finish the file; it is durable (fsynced, uploaded) when this returns."""

    @abstractmethod
    def discard(self) -> None:
        """Stop writing without making the file durable (after an error); never raises."""

    def __enter__(self) -> "FileWriter":
        return self

    def __exit__(self, et: type | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if et is None:
            self.close()
        else:
            self.discard()


class SaveFiles(ABC):
    """Where one rank writes the files of one save (the staging location, or the checkpoint itself)."""

    #: what another rank passes to :meth:`Storage.writer_at` to write here (a directory, a prefix)
    location: str

    @abstractmethod
    def create(self, name: str, what: str = "data file") -> FileWriter:
        """A new file ``name`` (it must not exist); ``what`` names it in errors."""

    @abstractmethod
    def put(self, name: str, data: bytes, what: str = "metadata file") -> None:
        """Write a small file atomically and durably (readers see the old one or all of the new one)."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Delete file ``name`` (absent is fine)."""

    @abstractmethod
    def list(self) -> list[str]:
        """The names present, sorted."""


class SaveStaging(SaveFiles):
    """The committing side of one save: created by :meth:`Storage.begin_save` on the committer only."""

    @abstractmethod
    def commit(self, record: bytes) -> None:
        """Write the commit record last and make the checkpoint visible (atomically)."""

    @abstractmethod
    def abort(self) -> None:
        """Remove everything staged; a previous checkpoint at the location is untouched. Never raises."""

    @abstractmethod
    def release(self) -> None:
        """Give up what the save holds (a lock); idempotent, called after commit or abort."""


class Storage(ABC):
    """One checkpoint location: byte-range reads, a listing, and staged saves (see the module docstring)."""

    #: the location as the user named it (a path or a URL), for messages
    url: str
    #: whether :meth:`begin_save` can work here
    supports_writes: bool = False
    #: whether an overwrite replaces the whole checkpoint in one atomic step
    atomic_replace: bool = False

    def __init__(self) -> None:
        #: data bytes read by :meth:`read_into` and the number of those reads
        self.bytes_read = 0
        self.reads = 0

    @abstractmethod
    def size(self, name: str) -> int:
        """The size of file ``name``; CheckpointNotFoundError when it is missing."""

    @abstractmethod
    def read_into(self, name: str, offset: int, out, what: str = "") -> None:
        """Fill all of ``out`` (a writable bytes-like) from ``offset``; a short read is CorruptionError."""

    @abstractmethod
    def read_all(self, name: str, limit: int, what: str = "file") -> bytes:
        """The whole file ``name``, refused before reading when larger than ``limit`` bytes."""

    @abstractmethod
    def list(self) -> list[str]:
        """The file names at the location, sorted; CheckpointNotFoundError when it does not exist."""

    @abstractmethod
    def begin_save(self, *, overwrite: bool) -> SaveStaging:
        """Start a save (committer only): check the location, lock it, stage; UnsupportedStorageError if read-only."""

    @abstractmethod
    def writer_at(self, location: str) -> SaveFiles:
        """Write files of a save the committer staged at ``location`` (every writing rank)."""

    @abstractmethod
    def begin_in_place(self, rank: int) -> SaveFiles:
        """Write files straight under the location (no-collectives mode: each rank alone, record last)."""

    # -- a location holding many checkpoints (CheckpointManager's root); additive, optional ----------------
    def delete(self, name: str) -> None:
        """Delete the checkpoint ``name`` directly under this location, crash-safely.

        It stops being a complete checkpoint before any of its data goes (local: renamed to a hidden
        ``.<name>.hyperdcp-trash-<token>`` first; an object store: commit record first), so a kill midway
        leaves only leftovers that :meth:`sweep` removes. Absent is fine. Default: UnsupportedStorageError.
        """
        from ..errors import UnsupportedStorageError

        raise UnsupportedStorageError(f"{type(self).__name__} at {self.url!r} cannot delete checkpoints; "
                                      "delete them with the storage's own tools, or disable retention")

    def sweep(self) -> list[str]:
        """Remove what killed saves and deletions left directly under this location (temporaries no live
        save holds, trash); returns the names removed. Default: nothing to do."""
        return []

    def fetch(self, name: str, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of ``name`` in one request where the storage has requests (fewer at the end
        of the file); not counted in ``bytes_read`` (headers, probes)."""
        out = bytearray(max(0, min(n, self.size(name) - offset)))
        before, reads = self.bytes_read, self.reads
        self.read_into(name, offset, out)
        self.bytes_read, self.reads = before, reads
        return bytes(out)

    def exists(self) -> bool:
        """Whether anything is stored at the location (a checkpoint or the remains of a save)."""
        from ..errors import CheckpointNotFoundError

        try:
            return bool(self.list())
        except CheckpointNotFoundError:
            return False

    def close(self) -> None:  # noqa: B027 - an optional hook: the default does nothing
        """Release open handles (a storage stays usable: it reopens on the next read)."""
