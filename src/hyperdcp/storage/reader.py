"""Ranged, verified reads from a checkpoint's data files.

Files are opened once per load, never through a symlink, and checked against the size the metadata
records. Every read is counted (``bytes_read``) so benchmarks can report read amplification.
"""

from __future__ import annotations

import json
import os
import threading

from ..errors import CorruptionError, FormatError, StorageError
from ..format.metadata import Metadata
from .commit import read_metadata_bytes
from .data_file import chunk_name, read_header
from .safe_open import open_dir, open_regular


class DataFiles:
    def __init__(self, root: str, metadata: Metadata):
        self.root = os.fspath(root)
        self.meta = metadata
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0
        self._by_file: dict[int, dict[str, tuple]] | None = None
        self._dir_fd: int | None = None

    def path(self, fidx: int) -> str:
        return os.path.join(self.root, self.meta.files[fidx].name)

    def _dir(self) -> int:
        """The checkpoint directory, opened once per load: every data file is opened relative to it."""
        if self._dir_fd is None:
            self._dir_fd = open_dir(self.root)
        return self._dir_fd

    def fd(self, fidx: int) -> int:
        with self._lock:
            fd = self._fds.get(fidx)
            if fd is not None:
                return fd
            path = self.path(fidx)
            name = self.meta.files[fidx].name
            try:
                # no-follow, non-blocking (a FIFO planted under a data file's name cannot hang the open),
                # regular files only
                fd, size = open_regular(path, "data file", dir_fd=self._dir(), name=name, missing=FileNotFoundError)
            except FileNotFoundError:
                raise self._missing(path) from None
            want = self.meta.files[fidx].nbytes
            if size != want:
                os.close(fd)
                raise CorruptionError(
                    f"data file {path} has {size} bytes but the metadata records {want} (truncated or replaced)"
                )
            try:
                if getattr(self.meta, "has_checksums", True):  # hyperdcp-written files (not foreign sources)
                    self._check_header(fidx, fd, path)
            except BaseException:
                os.close(fd)
                raise
            self._fds[fidx] = fd
            return fd

    def _missing(self, path: str) -> Exception:
        """A data file the metadata lists is gone: a concurrent overwrite, or real damage.

        Data file names are unique per save, so when the checkpoint at ``root`` now lists other files the
        load raced a save that replaced it; the load never mixes the two versions.
        """
        try:
            now = [f["name"] for f in json.loads(read_metadata_bytes(self.root).decode("utf-8")).get("files", [])]
        except Exception:  # noqa: BLE001 - only decides which message to give
            now = None
        if now is not None and now != [f.name for f in self.meta.files]:
            return StorageError(
                f"data file {path} is gone: the checkpoint at {self.root!r} was replaced by another save while this "
                "load was reading it (it now lists other data files); nothing was mixed -- load it again"
            )
        return CorruptionError(f"data file {path} is missing; the checkpoint is damaged")

    def _check_header(self, fidx: int, fd: int, path: str) -> None:
        """The file's safetensors header must describe exactly the chunks the metadata puts in it.

        The header is not covered by the chunk checksums, so this is what turns a damaged header into
        an error naming the file instead of a checkpoint that no longer opens with other tools.
        """
        file_meta: dict = {}
        entries, _ = read_header(fd, self.meta.files[fidx].nbytes, f"data file {path}", file_meta)
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
                    by_file.setdefault(int(c.file[i]), {})[name] = (t.dtype, box.lengths, int(c.begin[i]), int(c.end[i]))
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
        mv = memoryview(out).cast("B")
        fd = self.fd(fidx)
        done = 0
        while done < len(mv):
            try:
                n = os.preadv(fd, [mv[done:]], offset + done)
            except OSError as e:
                raise StorageError(f"reading data file {self.path(fidx)} failed: {e.strerror or e} (errno {e.errno}) "
                                   f"while reading {what}; check the storage device and retry") from None
            if n <= 0:
                raise CorruptionError(f"{self.path(fidx)}: unexpected end of file while reading {what}")
            done += n
        with self._lock:
            self.bytes_read += done
            self.reads += 1

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            if self._dir_fd is not None:
                os.close(self._dir_fd)
                self._dir_fd = None
