"""torch.distributed.checkpoint's call signatures over hyperdcp: code that calls dcp switches with an import.

    import hyperdcp.torch as dcp            # instead of: import torch.distributed.checkpoint as dcp
    dcp.save(state_dict, checkpoint_id="ckpt/step-100")
    fut = dcp.async_save(state_dict, checkpoint_id="ckpt/step-200")   # fut.result() once committed
    dcp.load(state_dict, checkpoint_id="ckpt/step-100")

Arguments keep torch's names: ``checkpoint_id=``, ``process_group=``, ``no_dist=`` (one process, no
collectives), ``storage_writer=``/``storage_reader=`` (torch's ``FileSystemWriter``/``FileSystemReader``,
or anything with a ``path`` or ``checkpoint_id``: only their path is used). ``planner=`` is refused:
hyperdcp plans itself (deduplicated writes, cross-layout reads); rename keys with
``LoadOptions(key_map=...)`` instead. Like dcp, a save to an existing checkpoint replaces it (the old one
stays intact until the new one committed; ``FileSystemWriter(overwrite=False)`` refuses instead). The
checkpoints are hyperdcp's format, not torch DCP's: load them with hyperdcp. No torch import here.
"""

from __future__ import annotations

import os
from typing import Any

from .api import load as _load
from .api import save as _save
from .async_saving import SaveFuture
from .async_saving import async_save as _async_save
from .coordination.local import LocalCoordinator
from .errors import StateDictError
from .results import LoadResult
from .saving import SaveResult


def _where(checkpoint_id: Any, storage: Any, role: str) -> str:
    path = None
    if storage is not None:
        path = getattr(storage, "checkpoint_id", None) or getattr(storage, "path", None)
        if path is None:
            raise StateDictError(f"{role}={type(storage).__name__}: hyperdcp takes only the path of a storage "
                                 "object (FileSystemWriter/FileSystemReader); pass checkpoint_id='<dir>' instead")
    if checkpoint_id is not None and path is not None and os.fspath(checkpoint_id) != os.fspath(path):
        raise StateDictError(f"checkpoint_id={os.fspath(checkpoint_id)!r} and {role} at {os.fspath(path)!r} name two "
                             "different checkpoints; pass one of them")
    where = checkpoint_id if checkpoint_id is not None else path
    if where is None:
        raise StateDictError(f"no checkpoint location: pass checkpoint_id='<dir>' (or {role}=FileSystem...(dir))")
    return os.fspath(where)


def _no_planner(planner: Any, call: str) -> None:
    if planner is not None:
        raise StateDictError(
            f"hyperdcp.torch.{call}(planner={type(planner).__name__}) is not supported: hyperdcp plans saves and loads "
            "itself (one writer per unique shard, reads by box intersection on any layout); drop planner=, and for "
            "a key renaming planner use hyperdcp.load(..., key_map=fn) (LoadOptions.key_map) instead"
        )


def _common(process_group: Any, no_dist: bool, kw: dict) -> dict:
    if no_dist:
        kw["coordinator"] = LocalCoordinator()
    elif process_group is not None:
        kw["process_group"] = process_group
    return kw


def save(state_dict: Any, *, checkpoint_id: str | os.PathLike | None = None, storage_writer: Any = None,
         planner: Any = None, process_group: Any = None, no_dist: bool = False, use_collectives: bool = True,
         **options: Any) -> SaveResult:
    """:func:`torch.distributed.checkpoint.save`'s signature; saves with :func:`hyperdcp.save` (every rank).
    ``options``: :class:`~hyperdcp.SaveOptions` fields."""
    _no_planner(planner, "save")
    if not use_collectives:
        raise StateDictError("hyperdcp.torch.save(use_collectives=False) is not supported: a synchronous hyperdcp save "
                             "coordinates its ranks; use hyperdcp.torch.async_save(..., use_collectives=False) (each "
                             "rank saves alone, see docs/FORMAT.md) or drop the argument")
    path = _where(checkpoint_id, storage_writer, "storage_writer")
    options.setdefault("overwrite", bool(getattr(storage_writer, "overwrite", True)))
    return _save(state_dict, path, **_common(process_group, no_dist, options))


def async_save(state_dict: Any, *, checkpoint_id: str | os.PathLike | None = None, storage_writer: Any = None,
               planner: Any = None, process_group: Any = None, no_dist: bool = False,
               async_checkpointer_type: Any = None, async_stager: Any = None, use_collectives: bool = True,
               **options: Any) -> SaveFuture:
    """:func:`torch.distributed.checkpoint.async_save`'s signature: a Future whose ``result()`` is the
    committed save. ``async_checkpointer_type``/``async_stager`` are accepted and unused (hyperdcp stages into
    shared memory and persists in a process of its own). ``use_collectives=False``: each rank saves alone
    (hyperdcp's ``coordination="none"``)."""
    _no_planner(planner, "async_save")
    path = _where(checkpoint_id, storage_writer, "storage_writer")
    options.setdefault("overwrite", bool(getattr(storage_writer, "overwrite", True)))
    if not use_collectives:
        options["coordination"] = "none"
    return _async_save(state_dict, path, **_common(process_group, no_dist, options))


def load(state_dict: Any, *, checkpoint_id: str | os.PathLike | None = None, storage_reader: Any = None,
         planner: Any = None, process_group: Any = None, no_dist: bool = False, **options: Any) -> LoadResult:
    """:func:`torch.distributed.checkpoint.load`'s signature: loads in place with :func:`hyperdcp.load`."""
    _no_planner(planner, "load")
    path = _where(checkpoint_id, storage_reader, "storage_reader")
    return _load(state_dict, path, **_common(process_group, no_dist, options))


__all__ = ["async_save", "load", "save"]
