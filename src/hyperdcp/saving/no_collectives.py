"""The no-collectives mode: each rank writes its own data files and a rank metadata file, alone.

Call order (each rank, no communication; see "Async save, no-collectives mode" in docs/FORMAT.md)::

    persist_alone(path, rank, world_size, staged, mine, values_encoded, opts, save_id)
        files = storage.begin_in_place(rank)          # the checkpoint directory itself
        -> this rank's data files (write_assigned), then its rank file ``hyperdcp.rank-<rank>.json``
           last, atomically (temporary name, fsync, rename, directory fsync)
    finalize(path)      # any process, once every rank is done: the merged record as hyperdcp.json

The checkpoint counts as complete when the rank files of every rank ``0..world_size-1`` exist and carry
the same ``save_id``; :func:`merge_at` joins them (:func:`hyperdcp.format.rank_files.merge`).
"""

from __future__ import annotations

import time

import numpy as np
import xxhash

from ..coordination import wire  # core/wire.py once it exists (P3)
from ..errors import CheckpointExistsError
from ..format import rank_files
from ..format.metadata import METADATA_FILE, Metadata, max_metadata_bytes
from ..format.record_v2 import index_file_name, is_index_file
from ..format.safetensors import save_token
from ..options import SaveOptions
from ..results import SaveResult
from ..storage.base import Storage
from ..storage.urls import storage_for
from . import write
from .stage import StagedState


def persist_alone(path: str, rank: int, world_size: int, staged: StagedState, mine: np.ndarray,
                  values_encoded: dict, opts: SaveOptions, save_id: str, storage: Storage | None = None) -> SaveResult:
    """Write this rank's share of a checkpoint with no communication at all."""
    t0 = time.perf_counter()
    storage = storage if storage is not None else storage_for(path, opts.storage_options)
    files = storage.begin_in_place(rank)
    path = files.location
    mine_file = rank_files.rank_file_name(rank)
    present = files.list()
    existing = METADATA_FILE in present or mine_file in present
    if existing and not opts.overwrite:
        raise CheckpointExistsError(
            f"rank {rank}: a checkpoint already exists at {path!r}; pass overwrite=True (in the no-collectives mode "
            "the old checkpoint is not loadable while it is rewritten) or save to a new path"
        )
    if existing:
        for e in present:
            if (e == mine_file or e.startswith(f"r{rank:05d}-")
                    or (rank == 0 and (e == METADATA_FILE or is_index_file(e)))):
                files.remove(e)
    result = write.write_assigned(files, rank, staged, mine, opts, save_token(save_id))
    head, arr = wire.unpack(result)
    tensors: dict = {}
    for j, i in enumerate(mine.tolist()):
        st, sh = staged.chunks[i]
        t = tensors.setdefault(st.fqn, {"dtype": st.dtype, "shape": list(st.shape), "offsets": [], "lengths": [],
                                        "file": [], "begin": [], "end": [], "checksums": []})
        t["offsets"].append(list(sh.box.offsets))
        t["lengths"].append(list(sh.box.lengths))
        t["file"].append(int(arr["file"][j]))
        t["begin"].append(int(arr["begin"][j]))
        t["end"].append(int(arr["end"][j]))
        t["checksums"].append(head["checksums"][j])
    doc = {
        "format": rank_files.RANK_FORMAT, "version": 1, "save_id": save_id, "rank": rank, "world_size": world_size,
        "checksum_block_bytes": opts.checksum_block_bytes, "files": head["files"], "tensors": tensors,
        "all_tensors": [[t.fqn, t.dtype, list(t.shape)] for t in staged.plan.tensors],
        "values": values_encoded, "values_every_rank": True, "whole": _whole_digests(staged),
        "user": dict(opts.user_metadata), "created_unix": time.time(),
    }
    files.put(mine_file, rank_files.encode_rank_doc(doc), "rank metadata file")  # last: this rank is done
    return SaveResult(path, rank, world_size, sum(int(b) for _, b in head["files"]), [n for n, _ in head["files"]],
                      False, time.perf_counter() - t0)


def _whole_digests(staged: StagedState) -> dict[str, str]:
    """xxh3-64 of every tensor this rank holds whole: the merge checks that all holders agree."""
    return {st.fqn: "%016x" % xxhash.xxh3_64_intdigest(sh.data) for st, sh in staged.chunks
            if sh.box.lengths == tuple(st.shape) and not any(sh.box.offsets)}


def merge_at(storage: Storage) -> Metadata:
    """Join every rank file at ``storage`` into one :class:`Metadata`; raise if the checkpoint is incomplete."""
    cap = max_metadata_bytes()
    names = [n for n in storage.list() if rank_files.is_rank_file(n)]
    return rank_files.merge({n: storage.read_all(n, cap, "rank metadata file") for n in names}, storage.url)


def finalize(path: str, storage: Storage | None = None) -> Metadata:
    """Write the merged metadata of a complete no-collectives checkpoint as its ``hyperdcp.json``.

    Call it once, from any one process, after every rank's ``async_save(..., coordination="none")``
    future has completed (loads of an unfinalized save merge the rank files on the fly).

    Args:
        path: the checkpoint directory every rank saved to.
        storage: where it lives (default: the local directory ``path``).

    Returns:
        the committed :class:`~hyperdcp.Metadata`.

    Raises:
        IncompleteCheckpointError: a rank's record is missing (names the ranks); FormatError: a damaged
        rank record; MismatchError: ranks saved one whole tensor with different contents.

    Example::

        hyperdcp.finalize("ckpt/step-100")
    """
    storage = storage if storage is not None else storage_for(path)
    try:
        meta = merge_at(storage)
        files = storage.begin_in_place(0)
        token = save_token("\0".join(f.name for f in meta.files))
        record, index = meta.encode(index_file_name(token))
        if index is not None:  # format 2: its chunk index first (atomic: finalize may run again)
            files.put(index_file_name(token), index, "chunk index")
        files.put(METADATA_FILE, record)
    finally:
        storage.close()
    return meta
