"""Committed hyperdcp checkpoints (a local directory or an fsspec URL), and the unmerged rank files of
no-collectives async saves (merged in memory on open).

The error texts for what is not (yet) a checkpoint -- a missing path, an interrupted save, an overwrite
killed between its renames (restored on open), a torch DCP directory -- come from
:func:`hyperdcp.storage.commit.read_metadata_bytes`, which every open goes through.
"""

from __future__ import annotations

import os
import struct

from ..format.metadata import METADATA_FILE, Metadata
from ..format.rank_files import is_rank_file
from ..storage.urls import is_remote, local_path, url_join
from .base import Source
from .remote import read_remote_metadata_bytes


class HyperdcpSource(Source):
    """A hyperdcp checkpoint: its commit record (or its merged rank files) and its data files."""

    kind = "hyperdcp"
    verifiable = True

    def __init__(self, root: str, raw: bytes, metadata: Metadata | None = None, index: bytes | None = None):
        self.root = root
        self.raw = raw  # the commit record as stored: what other ranks receive
        #: a format-2 record's chunk index, read once by the opening rank and sent with the record
        self.index = index if index is not None else b""
        if metadata is None:
            read = None if index is not None else self._read_index
            metadata = Metadata.from_json(raw, where=self.record_path, index=index if index is not None else read)
        self.metadata = metadata

    def _read_index(self, name: str, nbytes: int) -> bytes:
        """Read a format-2 record's chunk index beside it, through the checkpoint's storage."""
        from ..storage.urls import storage_for

        storage = storage_for(self.root)
        try:
            self.index = storage.read_all(name, nbytes, "chunk index")
        finally:
            storage.close()
        return self.index

    @property
    def record_path(self) -> str:
        """Where the commit record is (for messages)."""
        return url_join(self.root, METADATA_FILE) if is_remote(self.root) else os.path.join(self.root, METADATA_FILE)

    @classmethod
    def probe(cls, path: str) -> str | None:
        if is_remote(path):
            return None  # URLs hold hyperdcp checkpoints only; a missing record is reported by open()
        p = local_path(path)
        if os.path.lexists(os.path.join(p, METADATA_FILE)):
            return None
        if os.path.isdir(p) and _has_rank_files(p):
            return None
        if not os.path.lexists(p):
            return "the path does not exist"
        return f"no {METADATA_FILE}"

    @classmethod
    def open(cls, path: str) -> "HyperdcpSource":
        if is_remote(path):
            root = os.fspath(path)
            return cls(root, read_remote_metadata_bytes(root))
        from ..storage.commit import read_metadata_bytes

        root = local_path(path)
        return cls(root, read_metadata_bytes(root))

    def payload(self) -> bytes:
        """``root NUL record``, or for format 2 ``root NUL "HDX2" <u64 record length> record index``."""
        head = self.root.encode("utf-8", "surrogateescape") + b"\0"
        if not self.index:
            return head + self.raw
        return head + _BUNDLE + struct.pack("<Q", len(self.raw)) + self.raw + self.index

    @classmethod
    def from_payload(cls, raw: bytes) -> "HyperdcpSource":
        root, _, record = raw.partition(b"\0")
        index = None
        if record[:4] == _BUNDLE:  # format 2: the index rank 0 read travels with the record
            (n,) = struct.unpack_from("<Q", record, 4) if len(record) >= 12 else (len(record),)
            record, index = record[12:12 + n], record[12 + n:]
        return cls(root.decode("utf-8", "surrogateescape"), record, index=index)


_BUNDLE = b"HDX2"


def _has_rank_files(path: str) -> bool:
    """Whether the directory ``path`` holds any rank metadata file (an unmerged no-collectives save)."""
    try:
        return any(is_rank_file(e) for e in os.listdir(path))
    except OSError:
        return False
