"""The exception hierarchy. Every error hyperdcp raises derives from :class:`CheckpointError`.

Messages name the tensor, file or rank involved and say what to do about it.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Root of every error raised by hyperdcp."""


class CheckpointNotFoundError(CheckpointError):
    """No checkpoint exists at the given path."""


class IncompleteCheckpointError(CheckpointError):
    """The directory exists but holds no valid commit record (metadata): the save never finished."""


class CheckpointExistsError(CheckpointError):
    """A complete checkpoint already exists where a save was asked to write."""


class FormatError(CheckpointError):
    """The metadata or a data file violates the format specification (docs/FORMAT.md)."""


class UnsupportedVersionError(FormatError):
    """The checkpoint was written by a newer format version than this library reads."""


class CorruptionError(CheckpointError):
    """Stored bytes do not match their checksum, or a file is shorter than the metadata says."""


class StateDictError(CheckpointError):
    """The state dict cannot be saved or loaded as given (bad value type, key clash, missing key...)."""


class MismatchError(StateDictError):
    """State dict and checkpoint (or ranks among themselves) disagree on keys, shapes, dtypes or boxes."""


class StorageError(CheckpointError):
    """The storage layer failed (disk full, permission denied, read-only target...)."""


class UnsupportedStorageError(StorageError):
    """The storage location cannot be used for this operation (e.g. saving to a remote URL)."""


class CoordinationError(CheckpointError):
    """Ranks could not agree: a rank failed, died or never arrived within the timeout."""


class RemoteRankError(CoordinationError):
    """Another rank failed; ``rank_errors`` maps each failing rank to its error text."""

    def __init__(self, message: str, rank_errors: dict[int, str] | None = None):
        super().__init__(message)
        self.rank_errors = dict(rank_errors or {})


__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CheckpointExistsError",
    "FormatError",
    "UnsupportedVersionError",
    "CorruptionError",
    "StateDictError",
    "MismatchError",
    "StorageError",
    "UnsupportedStorageError",
    "CoordinationError",
    "RemoteRankError",
]
