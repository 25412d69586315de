"""Committed hyperdcp checkpoints (a local directory or an fsspec URL), and the unmerged rank files of
no-collectives async saves (merged in memory on open).

The error texts for what is not (yet) a checkpoint -- a missing path, an interrupted save, an overwrite
killed between its renames (restored on open), a torch DCP directory -- come from
:func:`hyperdcp.storage.commit.read_metadata_bytes`, which every open goes through.
"""

from __future__ import annotations

import os

from ..format.metadata import METADATA_FILE, Metadata
from ..format.rank_files import is_rank_file
from ..storage.urls import is_remote, local_path, url_join
from .base import Source
from .remote import read_remote_metadata_bytes


class HyperdcpSource(Source):
    """A hyperdcp checkpoint: its commit record (or its merged rank files) and its data files."""

    kind = "hyperdcp"
    verifiable = True

    def __init__(self, root: str, raw: bytes, metadata: Metadata | None = None):
        self.root = root
        self.raw = raw  # the commit record as stored: what other ranks receive
        self.metadata = metadata if metadata is not None else Metadata.from_json(raw, where=self.record_path)

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
        return self.root.encode("utf-8", "surrogateescape") + b"\0" + self.raw

    @classmethod
    def from_payload(cls, raw: bytes) -> "HyperdcpSource":
        root, _, record = raw.partition(b"\0")
        return cls(root.decode("utf-8", "surrogateescape"), record)


def _has_rank_files(path: str) -> bool:
    """Whether the directory ``path`` holds any rank metadata file (an unmerged no-collectives save)."""
    try:
        return any(is_rank_file(e) for e in os.listdir(path))
    except OSError:
        return False
