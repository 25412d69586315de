"""The exception hierarchy, whole. Every error hyperdcp raises derives from :class:`CheckpointError`.

Messages name the tensor, file or rank involved and say what to do about it. Some classes also derive
from the built-in exception of the same meaning, so generic handlers catch them:
:class:`CheckpointNotFoundError` is a ``FileNotFoundError``, :class:`CheckpointExistsError` a
``FileExistsError``, :class:`FormatError` and :class:`MismatchError` are ``ValueError`` subclasses, and
:class:`AsyncSaveTimeoutError` is a ``TimeoutError``.

    try:
        hyperdcp.load(sd, path)
    except FileNotFoundError:   # CheckpointNotFoundError: no checkpoint at path
        ...
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Root of every error raised by hyperdcp."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint exists at the given path."""


class IncompleteCheckpointError(CheckpointError):
    """The directory exists but holds no valid commit record (metadata): the save never finished."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A complete checkpoint already exists where a save was asked to write."""


class FormatError(CheckpointError, ValueError):
    """The metadata or a data file violates the format specification (docs/FORMAT.md)."""


class UnsupportedVersionError(FormatError):
    """The checkpoint was written by a newer format version than this library reads."""


class CorruptionError(CheckpointError):
    """Stored bytes do not match their checksum, or a file is shorter than the metadata says."""


class StateDictError(CheckpointError):
    """The state dict cannot be saved or loaded as given (bad value type, key clash, missing key...)."""


class MismatchError(StateDictError, ValueError):
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


class AsyncSaveError(CheckpointError):
    """An async save failed in its persist process; ``remote_traceback`` holds that process's traceback."""

    remote_traceback: str = ""
    original_type: str = ""


class SaveInProgressError(AsyncSaveError):
    """An async save is already in flight on this rank and the caller asked not to wait for it."""


class PersistProcessDiedError(AsyncSaveError, CoordinationError):
    """The persist process of this rank died during a save."""


class PersistProcessStuckError(PersistProcessDiedError):
    """The persist process of this rank was stopped or blocked in the kernel without progress (see
    :meth:`hyperdcp.async_saving.worker.PersistWorker.stuck`); it was killed, the save not committed."""


class AsyncSaveTimeoutError(AsyncSaveError, TimeoutError):
    """``SaveFuture.result(timeout)`` expired; the save itself goes on."""


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
    "AsyncSaveError",
    "SaveInProgressError",
    "PersistProcessDiedError",
    "PersistProcessStuckError",
    "AsyncSaveTimeoutError",
]
