"""What a load, inspect, verify, diff or convert reads from: :class:`Source`, :class:`ChunkReader`,
:func:`open_source`.

A source is one readable checkpoint of some kind (``"hyperdcp"``, ``"huggingface"``), described by one
:class:`~hyperdcp.format.metadata.Metadata` whatever its kind. Call order::

    src = open_source(path)          # rank 0 (or a tool): probes the kinds in order, parses the metadata
    raw = src.to_bytes()             # rank 0 -> every rank (share_source does both, errors everywhere)
    src = source_from_bytes(raw)     # every other rank
    files = src.reader()             # per load: checks each data file once, then ranged reads
    files.read_into(fidx, offset, out, what) ... files.close()

:class:`ChunkReader` reads data files through a :class:`~hyperdcp.storage.base.Storage` (local
directories: :class:`~hyperdcp.storage.local.LocalStorage`, each file opened once per load, never through
a symlink; a HuggingFace hub snapshot's links into its own ``blobs/`` are resolved by the source
beforehand and passed as ``links``), checked against the size the metadata records and, for verifiable
sources, against their safetensors header. Every read is counted (``bytes_read``) so benchmarks can
report read amplification.
"""

from __future__ import annotations

import json
import os
import threading
from abc import ABC, abstractmethod
from typing import Callable, ClassVar

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptionError, StorageError
from ..format.metadata import Metadata
from ..format.record_v2 import is_index_file
from ..storage.base import Storage
from ..storage.commit import read_metadata_bytes
from ..storage.data_file import chunk_name, read_header
from ..storage.local import LocalStorage


class ChunkReader:
    """Ranged reads of the data files of one source under ``root`` (a local directory), through a Storage.

    Every byte goes through ``storage`` (default: the :class:`~hyperdcp.storage.local.LocalStorage` of
    ``root``: files opened once, ``O_NOFOLLOW`` relative to the directory, read with ``preadv`` straight
    into the caller's buffer). ``check_headers``: compare each file's safetensors header with the metadata
    (hyperdcp-written files; foreign sources have headers of their own). ``links``: file index -> an
    already validated absolute path to read instead of ``root/name`` (HuggingFace hub snapshots), read
    through the LocalStorage of its directory.

    Call order: ``fd(fidx)`` (checks the file once: size, header; a no-op afterwards) ->
    ``read_into(fidx, offset, out, what)`` ... -> ``close()``. Safe to use from several threads.
    """

    def __init__(self, root: str, metadata: Metadata, *, check_headers: bool = True,
                 links: dict[int, str] | None = None, storage: Storage | None = None):
        self.root = os.fspath(root)
        self.meta = metadata
        self.check_headers = check_headers
        self.links = links or {}
        self.storage = storage if storage is not None else LocalStorage(self.root)
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0
        self._by_file: dict[int, dict[str, tuple]] | None = None
        self._where: dict[int, tuple[Storage, str]] = {}  # checked file index -> (its storage, its name there)
        self._link_dirs: dict[str, LocalStorage] = {}  # directory of linked files -> its storage

    def path(self, fidx: int) -> str:
        """The path of data file ``fidx`` (for messages)."""
        return os.path.join(self.root, self.meta.files[fidx].name)

    def _located(self, fidx: int) -> tuple[Storage, str]:
        """The storage holding data file ``fidx`` and its name there (a linked file: its directory's)."""
        link = self.links.get(fidx)
        if link is None:
            return self.storage, self.meta.files[fidx].name
        parent, name = os.path.split(link)
        st = self._link_dirs.get(parent)
        if st is None:
            st = self._link_dirs[parent] = LocalStorage(parent)
        return st, name

    def fd(self, fidx: int, first: tuple[int, int] | None = None, into=None) -> int:
        """Check data file ``fidx`` once (it exists, is a regular file of the recorded size, and its header
        matches); returns ``fidx`` (the handle :meth:`read_into` takes). ``first``: the ``(offset, nbytes)``
        about to be read, which a remote reader may fetch with the check in one request, into ``into`` (where
        that read goes) when given (both ignored here)."""
        if fidx in self._where:
            return fidx
        with self._lock:
            if fidx in self._where:
                return fidx
            path = self.path(fidx)
            st, name = self._located(fidx)
            try:
                # no-follow, non-blocking (a FIFO planted under a data file's name cannot hang the open),
                # regular files only: LocalStorage opens every file that way
                size = st.size(name, "data file")
            except CheckpointNotFoundError:
                raise self._missing(path) from None
            want = self.meta.files[fidx].nbytes
            if size != want:
                raise CorruptionError(
                    f"data file {path} has {size} bytes but the metadata records {want} (truncated or replaced)"
                )
            if self.check_headers:  # hyperdcp-written files (not foreign sources)
                self._check_header(fidx, lambda n, off: st.fetch(name, off, n), path)
            self._where[fidx] = (st, name)
            return fidx

    def _missing(self, path: str) -> Exception:
        """A data file the metadata lists is gone: a concurrent overwrite, or real damage.

        Data file names are unique per save, so when the checkpoint at ``root`` now lists other files the
        load raced a save that replaced it; the load never mixes the two versions.
        """
        try:
            now = [f["name"] for f in json.loads(read_metadata_bytes(self.root).decode("utf-8")).get("files", [])
                   if not is_index_file(f["name"])]  # format 2 lists its chunk index among the files
        except Exception:  # noqa: BLE001 - only decides which message to give
            now = None
        if now is not None and now != [f.name for f in self.meta.files]:
            return StorageError(
                f"data file {path} is gone: the checkpoint at {self.root!r} was replaced by another save while this "
                "load was reading it (it now lists other data files); nothing was mixed -- load it again"
            )
        return CorruptionError(f"data file {path} is missing; the checkpoint is damaged")

    def _check_header(self, fidx: int, pread: Callable[[int, int], bytes], path: str) -> None:
        """The file's safetensors header must describe exactly the chunks the metadata puts in it.

        ``pread(n, offset)`` reads the file (not counted in ``bytes_read``). The header is not covered by the
        chunk checksums, so this is what turns a damaged header into an error naming the file instead of a
        checkpoint that no longer opens with other tools.
        """
        file_meta: dict = {}
        entries, _ = read_header(pread, self.meta.files[fidx].nbytes, f"data file {path}", file_meta)
        if file_meta.get("format") != "hyperdcp":
            raise CorruptionError(
                f"data file {path}: its header's __metadata__ is {file_meta!r}, not {{'format': 'hyperdcp'}}; the "
                "file is corrupted or was replaced; restore it or load another checkpoint"
            )
        if self._by_file is None:
            by_file: dict[int, dict[str, tuple]] = {}
            for fqn, t in self.meta.tensors.items():
                c = t.chunks
                for i in range(len(c)):
                    box = c.box(i)
                    name = chunk_name(fqn, box.offsets, box.lengths == tuple(t.shape))
                    by_file.setdefault(int(c.file[i]), {})[name] = (t.dtype, box.lengths, int(c.begin[i]),
                                                                    int(c.end[i]))
            self._by_file = by_file
        want = self._by_file.get(fidx, {})
        if entries != want:
            bad = sorted(k for k in set(entries) | set(want) if entries.get(k) != want.get(k))
            raise CorruptionError(
                f"data file {path}: its safetensors header does not match the metadata (entry {bad[0]!r} "
                f"differs{'' if len(bad) == 1 else f', and {len(bad) - 1} more'}); the file is corrupted or was "
                "replaced; restore it or load another checkpoint"
            )

    def read_into(self, fidx: int, offset: int, out, what: str = "") -> None:
        """Fill ``out`` (a writable bytes-like) from ``offset``; a short read is corruption."""
        self.fd(fidx)
        st, name = self._where[fidx]
        st.read_into(name, offset, out, what)
        n = memoryview(out).nbytes
        with self._lock:
            self.bytes_read += n
            self.reads += 1

    def close(self) -> None:
        """Close every file this reader opened (its storages reopen them on a later read)."""
        with self._lock:
            self._where.clear()
            stores = [self.storage, *self._link_dirs.values()]
            self._link_dirs.clear()
        for st in stores:
            st.close()


def rename_keys(meta: Metadata, key_map: Callable[[str], str | None]) -> Metadata:
    """A copy of ``meta`` with every key renamed through ``key_map`` (None drops the key): :meth:`Metadata.renamed`."""
    return meta.renamed(key_map)


#: the old name of :class:`ChunkReader`
DataFiles = ChunkReader


class Source(ABC):
    """A readable checkpoint of some kind. Rank 0 opens it; :meth:`to_bytes` travels to the others.

    Call order: ``probe(path)`` (None: this kind reads it) -> ``open(path)`` -> ``metadata`` and
    ``reader()`` on the opening rank, or ``to_bytes()`` -> :func:`source_from_bytes` on the others.
    """

    #: "hyperdcp" | "huggingface"
    kind: ClassVar[str]
    #: where the data files live: a local directory or a URL
    root: str
    #: tensors, chunks, files and values, one shape for every kind
    metadata: Metadata
    #: hyperdcp block checksums are present (loads verify them, verify_checkpoint checks them)
    verifiable: bool

    @classmethod
    @abstractmethod
    def probe(cls, path: str) -> str | None:
        """None when this kind reads ``path``, else why not (one short clause for the error message)."""

    @classmethod
    @abstractmethod
    def open(cls, path: str) -> "Source":
        """Read and validate the source's metadata at ``path``; clear errors naming the path."""

    @abstractmethod
    def payload(self) -> bytes:
        """What another rank needs to rebuild this source (see :meth:`from_payload`)."""

    @classmethod
    @abstractmethod
    def from_payload(cls, raw: bytes) -> "Source":
        """The source :meth:`payload` describes, validated again on this rank."""

    def reader(self) -> ChunkReader:
        """A reader of this source's data files (remote URLs read through fsspec)."""
        from ..storage.urls import is_remote
        from .remote import open_files

        if is_remote(self.root):
            return open_files(self.root, self.metadata)
        return ChunkReader(self.root, self.metadata, check_headers=self.verifiable)

    def to_bytes(self) -> bytes:
        """``kind NUL payload``: what rank 0 sends to every rank (:func:`source_from_bytes`)."""
        return self.kind.encode() + b"\0" + self.payload()


def kinds() -> list[type[Source]]:
    """The source kinds :func:`open_source` probes, in order."""
    from .huggingface import HuggingFaceSource
    from .hyperdcp import HyperdcpSource

    return [HyperdcpSource, HuggingFaceSource]


def opt_in_kinds() -> list[type[Source]]:
    """Kinds opened only when asked for by name (``kind="torch-dcp"``): never probed automatically."""
    from .torch_dcp import TorchDcpSource

    return [TorchDcpSource]


def source_from_bytes(raw: bytes) -> Source:
    """The source that :meth:`Source.to_bytes` encoded (on a rank other than the one that opened it)."""
    kind, sep, payload = bytes(raw).partition(b"\0")
    for cls in kinds() + opt_in_kinds():
        if sep and cls.kind.encode() == kind:
            return cls.from_payload(payload)
    raise CorruptionError(f"received a source description of unknown kind {kind[:40]!r} from rank 0; every rank "
                          "must run the same hyperdcp version")


def open_source(path, *, kind: str = "auto") -> Source:
    """Open the checkpoint at ``path`` (a directory, a ``.safetensors`` file or an fsspec URL).

    ``kind="auto"`` probes the kinds in order (hyperdcp, then HuggingFace); when none matches, the
    hyperdcp kind's own error (not found, incomplete save, torch DCP, ...) is raised with every other
    kind's reason appended. ``kind="hyperdcp"``, ``"huggingface"`` or ``"torch-dcp"`` opens that kind only (torch DCP is
    opt-in: reading it unpickles ``.metadata`` with a restricted unpickler, so ``"auto"`` never opens it).

    Args:
        path: a checkpoint directory, a ``.safetensors`` file, a HuggingFace model directory or hub
            snapshot, or an fsspec URL of a committed hyperdcp checkpoint.
        kind: ``"auto"`` or the name of one kind.

    Returns:
        a :class:`Source`: its ``metadata`` (tensors, chunks, values), ``verifiable``, and ``reader()``.

    Raises:
        CheckpointNotFoundError: nothing at ``path``; IncompleteCheckpointError: an interrupted save;
        FormatError: damaged metadata; ValueError: an unknown ``kind`` (the message lists the known ones).

    Example::

        src = hyperdcp.open_source("ckpt/step-100")
        src.kind, sorted(src.metadata.tensors)
    """
    path = os.fspath(path)
    table = kinds()
    names = [c.kind for c in table]
    if kind != "auto":
        table, names = table + opt_in_kinds(), names + [c.kind for c in opt_in_kinds()]
        if kind not in names:
            raise ValueError(f"unknown source kind {kind!r}; use 'auto' or one of {names}")
        return table[names.index(kind)].open(path)
    reasons = []
    for cls in table:
        why = cls.probe(path)
        if why is None:
            return cls.open(path)
        reasons.append((cls, why))
    first = table[0]  # its errors say most: missing path, interrupted save, torch DCP, recovery of an overwrite
    try:
        return first.open(path)
    except CheckpointError as e:
        rest = "; ".join(f"not {cls.kind}: {why}" for cls, why in reasons if cls is not first)
        if not rest:
            raise
        e.args = (f"{e} (other kinds tried: {rest})", *e.args[1:])
        raise e from None


def share_source(coord, path: str, kind: str = "auto") -> tuple[Source, Exception | None]:
    """Rank 0 opens the source at ``path`` and sends it to every rank; errors raise on every rank.

    With several ranks, rank 0's path digest rides on the same broadcast: the second value is this
    rank's error if it named another path than rank 0 (None if not), for the caller to raise in its
    next checked step so that it surfaces everywhere.
    """
    from ..coordination.base import broadcast_checked
    from ..path_identity import DIGEST_BYTES, mismatch_with_source, path_digest

    tag = coord.world_size > 1
    opened: list[Source] = []

    def read() -> bytes:
        opened.append(open_source(path, kind=kind))
        raw = opened[0].to_bytes()
        return path_digest(path) + raw if tag else raw

    raw = broadcast_checked(coord, f"reading the metadata of {path!r}", read, 0)
    wrong = None
    if tag:
        raw, wrong = raw[DIGEST_BYTES:], mismatch_with_source(path, raw[:DIGEST_BYTES], coord.rank, "load")
    return (opened[0] if opened else source_from_bytes(raw)), wrong
