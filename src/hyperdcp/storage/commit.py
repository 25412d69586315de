"""Deprecated: the local commit protocol lives in :mod:`hyperdcp.storage.local_commit` (behind
:class:`hyperdcp.storage.local.LocalStorage`); reading a checkpoint's metadata moves to the hyperdcp
source (``hyperdcp.sources``).

This module re-exports the former names, and keeps :func:`read_metadata_bytes` / :func:`load_metadata`
/ :func:`is_complete` (with their error texts and the no-collectives rank-file fallback) until the
hyperdcp source replaces them.
"""

from __future__ import annotations

import os

from ..errors import CheckpointError, CheckpointNotFoundError, FormatError, IncompleteCheckpointError
from ..format import rank_files
from ..format.metadata import METADATA_FILE, Metadata, max_metadata_bytes
from .local import LocalStorage
from .local_commit import (
    NO_EXCHANGE_ENV,
    SaveTarget,
    _rename_swap,
    _rmtree,
    fsync_dir,
    interrupted_saves,
    recover_interrupted_overwrite,
    recover_under,
    torch_dcp_message,
)
from .safe_open import read_regular


def merged_metadata_bytes(path: str) -> bytes | None:
    """The merged metadata of a no-collectives checkpoint directory, or None if ``path`` has no rank files."""
    storage = LocalStorage(path)
    try:
        try:
            names = [n for n in os.listdir(path) if rank_files.is_rank_file(n)]
        except OSError:
            return None
        if not names:
            return None
        cap = max_metadata_bytes()
        return rank_files.merge({n: storage.read_all(n, cap, "rank metadata file") for n in names}, path).to_json()
    finally:
        storage.close()


def read_metadata_bytes(path: str) -> bytes:
    """The raw commit record of the checkpoint at ``path``; clear errors when there is none."""
    path = os.fspath(path)
    recover_interrupted_overwrite(path)  # an overwrite killed between its two renames (no RENAME_EXCHANGE)
    if not os.path.exists(path):
        if interrupted_saves(path):
            raise IncompleteCheckpointError(
                f"incomplete checkpoint at {path!r}: a save to it was interrupted before it committed (only its "
                "temporary directory exists); load an earlier checkpoint, or save again to clean it up"
            )
        raise CheckpointNotFoundError(f"no checkpoint at {path!r}: the path does not exist; check the path and step")
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{path!r} is a file, not a checkpoint directory")
    meta = os.path.join(path, METADATA_FILE)
    try:
        return read_regular(meta, "metadata file", max_metadata_bytes(), missing=FileNotFoundError)
    except FileNotFoundError:
        merged = merged_metadata_bytes(path)  # no-collectives async saves: merge rank files
        if merged is not None:
            return merged
        if torch_dcp_message(path):
            raise FormatError(torch_dcp_message(path)) from None
        raise IncompleteCheckpointError(
            f"incomplete checkpoint at {path!r}: it has no {METADATA_FILE} (the save did not finish or this is "
            "not a hyperdcp checkpoint); load an earlier checkpoint"
        ) from None


def load_metadata(path: str) -> Metadata:
    path = os.fspath(path)
    return Metadata.from_json(read_metadata_bytes(path), where=os.path.join(path, METADATA_FILE),
                              index=lambda name, n: read_regular(os.path.join(path, name), "chunk index", n))


def is_complete(path: str) -> bool:
    try:
        load_metadata(path)
        return True
    except CheckpointError:
        return False


__all__ = ["NO_EXCHANGE_ENV", "SaveTarget", "fsync_dir", "interrupted_saves", "is_complete", "load_metadata",
           "merged_metadata_bytes", "read_metadata_bytes", "recover_interrupted_overwrite", "recover_under",
           "torch_dcp_message", "_exchange", "_rmtree"]

_exchange = _rename_swap  # its former name
