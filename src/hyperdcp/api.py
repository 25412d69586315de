"""The public entry points: :func:`save`, :func:`load`, :func:`read_metadata`."""

from __future__ import annotations

import os
import sys
from typing import Any

from .coordination.base import Coordinator, LocalCoordinator
from .format.metadata import Metadata
from .results import LoadResult
from .loading import load as _load
from .options import LoadOptions, SaveOptions, resolve
from .planning.save_plan import PlanCache
from .saving import SaveResult, persist, stage
from .sources import open_source
from .storage.remote import local_save_path

#: plans of recent saves in this process, keyed by the structure of every rank's state dict
DEFAULT_PLAN_CACHE = PlanCache()


def coordinator_for(process_group: Any = None, timeout: float | None = None) -> Coordinator:
    """torch.distributed when it is initialized (in the given group), else a single process."""
    if sys.modules.get("torch") is not None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from .coordination.torch_dist import TorchCoordinator

            return TorchCoordinator(process_group, timeout)
    if process_group is not None:
        from .errors import CoordinationError

        raise CoordinationError("a process_group was given but torch.distributed is not initialized; call "
                                "torch.distributed.init_process_group() first, or drop process_group=")
    return LocalCoordinator()


def save(state_dict: Any, path: str | os.PathLike, *, options: SaveOptions | None = None,
         coordinator: Coordinator | None = None, **overrides: Any) -> SaveResult:
    """Save a (sharded) state dict to the checkpoint directory ``path``. Every rank calls it.

    Each unique shard is written once, by one rank, balanced by bytes; the call returns after the
    checkpoint is committed on every rank. Options: :class:`SaveOptions` fields, as ``options=`` or
    keywords (e.g. ``overwrite=True``).
    """
    path = local_save_path(path)  # remote URLs: UnsupportedStorageError (save locally and upload)
    opts = resolve(SaveOptions, options, overrides)
    coord = coordinator or coordinator_for(opts.process_group, opts.timeout)
    coord.arrive(f"save to {path!r}")
    try:
        staged = stage(state_dict, coord)
    except Exception as e:  # noqa: BLE001 - reported on every rank by persist
        staged = e
    return persist(coord, staged, path, opts, DEFAULT_PLAN_CACHE)


def load(state_dict: Any, path: str | os.PathLike, *, options: LoadOptions | None = None,
         coordinator: Coordinator | None = None, **overrides: Any) -> LoadResult:
    """Load the checkpoint at ``path`` into ``state_dict`` in place, whatever its layout. Every rank calls it.

    Each rank receives exactly the regions its tensors hold (N-d box intersection with the stored
    chunks), verified against their checksums. Options: :class:`LoadOptions` fields (``strict``,
    ``allow_cast``, ``verify_checksums``, ...).
    """
    opts = resolve(LoadOptions, options, overrides)
    coord = coordinator or coordinator_for(opts.process_group, opts.timeout)
    coord.arrive(f"load of {os.fspath(path)!r}")
    return _load(state_dict, os.fspath(path), coord, opts)


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The validated metadata of any source; needs no process group.

    Args:
        path: a hyperdcp checkpoint (a path or an fsspec URL), a HuggingFace ``.safetensors`` file, model
            directory or hub cache snapshot.

    Returns:
        its :class:`Metadata` (tensors, chunks, files, values), the same shape for every kind of source.

    Example::

        meta = hyperdcp.read_metadata("ckpt/step-100")
        sorted(meta.tensors)
    """
    return open_source(path).metadata
