"""Asynchronous saves: stage in the training process, persist in a long-lived process per rank.

    fut = hyperdcp.async_save(state_dict, "ckpt/step-200")   # returns once staging is done
    meta = fut.result(timeout=600)                           # committed on all ranks

See :mod:`hyperdcp.async_save.saver` for the coordination modes.
"""

from .future import (AsyncSaveError, AsyncSaveTimeoutError, PersistProcessDiedError, PersistProcessStuckError, SaveFuture,
                     SaveInProgressError)
from .rank_files import finalize
from .saver import DEFAULT_MODE, MODES, async_save, shutdown

__all__ = [
    "async_save",
    "shutdown",
    "finalize",
    "SaveFuture",
    "AsyncSaveError",
    "AsyncSaveTimeoutError",
    "PersistProcessDiedError",
    "PersistProcessStuckError",
    "SaveInProgressError",
    "MODES",
    "DEFAULT_MODE",
]
