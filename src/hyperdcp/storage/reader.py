"""Ranged, verified reads from a checkpoint's data files.

Files are opened once per load, never through a symlink, and checked against the size the metadata
records. Every read is counted (``bytes_read``) so benchmarks can report read amplification.
"""

from __future__ import annotations

import os
import stat
import threading

from ..errors import CorruptionError, FormatError, StorageError
from ..format.metadata import Metadata
from .data_file import chunk_name, read_header


class DataFiles:
    def __init__(self, root: str, metadata: Metadata):
        self.root = os.fspath(root)
        self.meta = metadata
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0
        self._by_file: dict[int, dict[str, tuple]] | None = None

    def path(self, fidx: int) -> str:
        return os.path.join(self.root, self.meta.files[fidx].name)

    def fd(self, fidx: int) -> int:
        with self._lock:
            fd = self._fds.get(fidx)
            if fd is not None:
                return fd
            path = self.path(fidx)
            try:
                # O_NONBLOCK: a FIFO planted under a data file's name must not hang the open
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                             | getattr(os, "O_NONBLOCK", 0))
            except FileNotFoundError:
                raise CorruptionError(f"data file {path} is missing; the checkpoint is damaged") from None
            except OSError as e:
                if e.errno == getattr(os, "ELOOP", -1) or os.path.islink(path):
                    raise FormatError(f"data file {path} is a symbolic link; hyperdcp never follows links inside a checkpoint") from None
                raise StorageError(f"cannot open data file {path}: {e.strerror or e}") from e
            st = os.fstat(fd)
            want = self.meta.files[fidx].nbytes
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise FormatError(f"{path} is not a regular file")
            if st.st_size != want:
                os.close(fd)
                raise CorruptionError(
                    f"data file {path} has {st.st_size} bytes but the metadata records {want} (truncated or replaced)"
                )
            try:
                if getattr(self.meta, "has_checksums", True):  # hyperdcp-written files (not foreign sources)
                    self._check_header(fidx, fd, path)
            except BaseException:
                os.close(fd)
                raise
            self._fds[fidx] = fd
            return fd

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
                raise StorageError(f"reading {self.path(fidx)} failed: {e.strerror or e}") from e
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
