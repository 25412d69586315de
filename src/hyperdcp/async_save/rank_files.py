"""Deprecated: the no-collectives mode moved. Rank-file codecs and their merge:
:mod:`hyperdcp.format.rank_files`; writing and finalizing: :mod:`hyperdcp.saving.no_collectives`.

This module re-exports those names and keeps the path-based helpers (:func:`merge`, :func:`has_rank_files`,
:func:`rank_file`) that loading and the tests use until the hyperdcp source replaces them.
"""

from __future__ import annotations

import os

from ..format.metadata import Metadata
from ..format.rank_files import PREFIX, RANK_FORMAT, SUFFIX, is_rank_file, rank_file_name
from ..saving.no_collectives import finalize, merge_at, persist_alone
from ..storage.local import LocalStorage


def rank_file(path: str, rank: int) -> str:
    """The path of ``rank``'s rank metadata file in checkpoint directory ``path``."""
    return os.path.join(path, rank_file_name(rank))


def has_rank_files(path: str) -> bool:
    """Whether the directory ``path`` holds any rank metadata file."""
    try:
        return any(is_rank_file(e) for e in os.listdir(path))
    except OSError:
        return False


def merge(path: str) -> Metadata:
    """Join every rank file of ``path`` into one :class:`Metadata`; raise if the checkpoint is incomplete."""
    storage = LocalStorage(path)
    try:
        return merge_at(storage)
    finally:
        storage.close()


def merged_metadata_bytes(path: str) -> bytes | None:
    """The merged metadata of a no-collectives checkpoint, or None if ``path`` has no rank files."""
    if not has_rank_files(path):
        return None
    return merge(path).to_json()


__all__ = ["PREFIX", "RANK_FORMAT", "SUFFIX", "finalize", "has_rank_files", "merge", "merged_metadata_bytes",
           "persist_alone", "rank_file"]
