"""The public entry points: :func:`save`, :func:`load`, :func:`read_metadata`.

Each resolves its options, picks the coordinator (torch.distributed when initialized, else one process)
and calls a flow: save -> ``saving.stage`` then ``saving.persist``; load -> ``loading.load``.
"""

from __future__ import annotations

import os
from typing import Any

from . import _runtime
from .adapters import flatten_tree
from .coordination import default_coordinator
from .coordination.base import Coordinator
from .format.metadata import Metadata
from .loading import load as _load
from .options import LoadOptions, SaveOptions, resolve
from .planning.save_plan import PlanCache
from .results import LoadResult
from .saving import SaveResult, persist, stage
from .sources import open_source
from .storage.urls import save_path, storage_options_scope


def plan_cache() -> PlanCache:
    """The plans of recent saves in this process, keyed by the structure of every rank's state dict
    (the ``planning.plan_cache`` slot of :mod:`hyperdcp._runtime`, shared with async saves)."""
    return _runtime.slot("planning.plan_cache", PlanCache)


def __getattr__(name: str) -> Any:
    if name == "DEFAULT_PLAN_CACHE":  # the old module global: now the process-wide slot
        return plan_cache()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: the old name of :func:`hyperdcp.coordination.default_coordinator`
coordinator_for = default_coordinator


def save(state_dict: Any, path: str | os.PathLike, *, options: SaveOptions | None = None,
         coordinator: Coordinator | None = None, **overrides: Any) -> SaveResult:
    """Save a (sharded) state dict to the checkpoint directory ``path``. Every rank calls it.

    Each unique shard is written once, by one rank, balanced by bytes; the call returns after the
    checkpoint is committed on every rank.

    Args:
        state_dict: a nested dict (or an object with ``state_dict()``) of tensors (torch Tensor, DTensor,
            numpy array) and plain values.
        path: the checkpoint directory (local; for a remote URL save locally and upload).
        options: :class:`SaveOptions`; any of its fields may also be given as a keyword (``overwrite=True``).
        coordinator: the ranks' coordinator (default: torch.distributed when initialized, else one process).

    Returns:
        The :class:`SaveResult` of this rank (bytes and files it wrote, whether the plan was cached).

    Raises:
        CheckpointExistsError: a complete checkpoint is at ``path`` and ``overwrite`` is False.
        StateDictError: a value cannot be saved, or ranks disagree on the state dict (every rank raises).
        StorageError: the directory cannot be written (disk full, permissions).
        CoordinationError: a rank failed or did not arrive within ``timeout``.

    Example:
        >>> res = hyperdcp.save({"w": np.arange(4.0)}, "ckpt/step-100")  # doctest: +SKIP
        >>> res.bytes_written  # doctest: +SKIP
        32
    """
    path = save_path(path)  # s3:// URLs as given; other URLs: UnsupportedStorageError (save locally and upload)
    opts = resolve(SaveOptions, options, overrides)
    coord = coordinator or coordinator_for(opts.process_group, opts.timeout)
    coord.arrive(f"save to {path!r}")
    try:
        state_dict, _ = flatten_tree(state_dict, for_load=False)  # a JAX pytree -> {key: array}
        staged = stage(state_dict, coord)
    except Exception as e:  # noqa: BLE001 - reported on every rank by persist
        staged = e
    return persist(coord, staged, path, opts, plan_cache())


def load(state_dict: Any, path: str | os.PathLike, *, options: LoadOptions | None = None,
         coordinator: Coordinator | None = None, **overrides: Any) -> LoadResult:
    """Load the checkpoint at ``path`` into ``state_dict`` in place, whatever its layout. Every rank calls it.

    Each rank receives exactly the regions its tensors hold (N-d box intersection with the stored
    chunks), verified against their checksums.

    Args:
        state_dict: the destination, laid out as this job wants (any mesh, placements, world size); or a
            JAX pytree of arrays / ``jax.ShapeDtypeStruct``s with shardings (new arrays in ``.state``).
        path: a hyperdcp checkpoint directory, a HuggingFace safetensors file or directory, or an fsspec URL
            (a torch DCP directory with ``source="torch-dcp"``).
        options: :class:`LoadOptions`; any of its fields may also be given as a keyword (``strict=False``).
        coordinator: the ranks' coordinator (default: torch.distributed when initialized, else one process).

    Returns:
        The :class:`LoadResult` of this rank (bytes read, missing and unused keys, ``.state``: the loaded tree).

    Raises:
        CheckpointNotFoundError: nothing at ``path`` (also a ``FileNotFoundError``).
        IncompleteCheckpointError: the save at ``path`` never committed.
        MismatchError: keys, shapes or dtypes differ from the checkpoint (``strict``, ``allow_cast``).
        CorruptionError: stored bytes do not match their checksums.

    Example:
        >>> sd = {"w": np.zeros(4)}
        >>> hyperdcp.load(sd, "ckpt/step-100")  # doctest: +SKIP
        >>> sd["w"]  # doctest: +SKIP
        array([0., 1., 2., 3.])
    """
    opts = resolve(LoadOptions, options, overrides)
    coord = coordinator or coordinator_for(opts.process_group, opts.timeout)
    flat, rebuild = flatten_tree(state_dict, for_load=True)  # a JAX pytree -> {key: target}
    coord.arrive(f"load of {os.fspath(path)!r}")
    with storage_options_scope(opts.storage_options):
        result = _load(flat, os.fspath(path), coord, opts)
    if rebuild is not None:  # JAX arrays are immutable: the loaded tree is new, the target untouched
        result.state = rebuild(flat)
    return result


def read_metadata(path: str | os.PathLike, *, source: str = "auto") -> Metadata:
    """The validated metadata of any source; needs no process group.

    Args:
        path: a hyperdcp checkpoint (a path or an fsspec URL), a HuggingFace ``.safetensors`` file, model
            directory or hub cache snapshot.
        source: ``"auto"`` or one kind: ``"hyperdcp"``, ``"huggingface"``, ``"torch-dcp"`` (opt-in, see LoadOptions).

    Returns:
        its :class:`Metadata` (tensors, chunks, files, values), the same shape for every kind of source.

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        IncompleteCheckpointError: no valid commit record (the save never finished).
        FormatError: the commit record violates docs/FORMAT.md.

    Example::

        meta = hyperdcp.read_metadata("ckpt/step-100")
        sorted(meta.tensors)
    """
    return open_source(path, kind=source).metadata
