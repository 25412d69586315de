"""Asynchronous saves: stage in the training process, persist in a long-lived process per rank.

    fut = hyperdcp.async_save(state_dict, "ckpt/step-200")   # returns once staging is done
    res = fut.result(timeout=600)                            # committed on all ranks

Modules, in call order: :mod:`.session` (one per process and group: rendezvous, submit, plan-cache sync)
-> :mod:`.staging` (copy into one reused shared-memory area) -> :mod:`.worker` (the handle on the persist
process) -> :mod:`.child` (the persist process: plan, write, commit). See :mod:`.session` for the
coordination modes.
"""

from __future__ import annotations

import os
from typing import Any

from ..async_save.rank_files import finalize
from ..coordination.base import Coordinator
from ..errors import (
    AsyncSaveError,
    AsyncSaveTimeoutError,
    PersistProcessDiedError,
    PersistProcessStuckError,
    SaveInProgressError,
)
from ..options import ASYNC_MODES as MODES
from ..options import AsyncSaveOptions, SaveOptions, resolve
from .future import SaveFuture
from .session import DEFAULT_MODE, open_session, shutdown


def async_save(state_dict: Any, path: str | os.PathLike, *, options: SaveOptions | None = None,
               coordinator: Coordinator | None = None, coordination: str | None = None, wait: bool | None = None,
               exchange_dir: str | os.PathLike | None = None, async_options: AsyncSaveOptions | None = None,
               **overrides: Any) -> SaveFuture:
    """Save ``state_dict`` to ``path`` in the background. Every rank calls it, in the same order.

    Returns once this rank's shards are copied into its staging area (so the state dict may change
    right away); planning, coordination, writing and the commit run in this rank's persist process.
    At most one save is in flight per rank: a second call waits for the first.

    Args:
        state_dict: the (nested) state dict, as for :func:`hyperdcp.save`.
        path: the checkpoint directory (local; for a remote URL save locally and upload).
        options: :class:`~hyperdcp.SaveOptions`; any of its fields may also be given as a keyword.
        coordinator: the ranks' coordinator (default: torch.distributed when initialized, else one process).
        coordination: ``"gloo"`` (default), ``"file"`` or ``"none"``; see :mod:`hyperdcp.async_saving.session`.
        wait: wait for an in-flight save of this rank (default True); False raises instead.
        exchange_dir: ``"file"`` mode: the shared directory for the exchanges (default: next to ``path``).
        async_options: :class:`~hyperdcp.AsyncSaveOptions` holding the three above (keywords win).

    Returns:
        A :class:`SaveFuture`; ``result(timeout)`` returns the :class:`~hyperdcp.SaveResult` once the
        checkpoint is committed on every rank.

    Raises:
        SaveInProgressError: ``wait=False`` and a save is still in flight on this rank.
        StateDictError: staging failed (a value that cannot be saved); the other ranks' futures fail too.
        UnsupportedStorageError: ``path`` is a remote URL.

    Example:
        >>> fut = hyperdcp.async_save({"w": torch.ones(4)}, "ckpt/step-200")  # doctest: +SKIP
        >>> fut.result(timeout=600).bytes_written  # doctest: +SKIP
        16
    """
    given = {k: v for k, v in (("coordination", coordination), ("wait", wait), ("exchange_dir", exchange_dir))
             if v is not None}
    aopts = resolve(AsyncSaveOptions, async_options, given)
    if aopts.coordination not in MODES:
        raise ValueError(f"coordination must be one of {MODES}, got {aopts.coordination!r}")
    from ..coordination import default_coordinator as coordinator_for
    from ..storage.urls import save_path

    path = save_path(path)  # s3:// URLs as given (the persist process uploads); other URLs: UnsupportedStorageError
    if "://" in path and aopts.coordination == "file" and not aopts.exchange_dir:
        raise ValueError(f"async_save to {path!r} with coordination='file' needs exchange_dir= (a directory every "
                         "rank shares); the default lies next to the checkpoint, which an object store has not")
    opts = resolve(SaveOptions, options, overrides)
    coord = coordinator or coordinator_for(opts.process_group, opts.timeout)
    sess = open_session(coord, aopts.coordination)
    from ..adapters import flatten_tree

    state_dict, _ = flatten_tree(state_dict, for_load=False)  # a JAX pytree -> {key: array}
    xdir = os.fspath(aopts.exchange_dir) if aopts.exchange_dir else None
    return sess.save(state_dict, path, opts, aopts.wait, xdir)


__all__ = [
    "async_save",
    "shutdown",
    "finalize",
    "SaveFuture",
    "AsyncSaveOptions",
    "AsyncSaveError",
    "AsyncSaveTimeoutError",
    "PersistProcessDiedError",
    "PersistProcessStuckError",
    "SaveInProgressError",
    "MODES",
    "DEFAULT_MODE",
]
