"""The public entry points: :func:`save`, :func:`load`, :func:`read_metadata`."""

from __future__ import annotations

import os
from typing import Any

from .coordination import default_coordinator
from .coordination.base import Coordinator
from .format.metadata import Metadata
from .loading import LoadResult
from .loading import load as _load
from .options import LoadOptions, SaveOptions, resolve
from .planning.save_plan import PlanCache
from .saving import SaveResult, persist, stage
from .storage.commit import load_metadata
from .storage.remote import is_remote, load_remote_metadata, local_path, local_save_path

#: plans of recent saves in this process, keyed by the structure of every rank's state dict
DEFAULT_PLAN_CACHE = PlanCache()

#: the old name of :func:`hyperdcp.coordination.default_coordinator`
coordinator_for = default_coordinator


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
    """The validated metadata of a checkpoint (a path or an fsspec URL); needs no process group."""
    return load_remote_metadata(os.fspath(path)) if is_remote(path) else load_metadata(local_path(path))
