"""The collective save flow shared by :func:`hyperdcp.save` and the async persist processes.

Call order (every rank of the coordinator; ``staged`` from :func:`hyperdcp.saving.stage.stage`):

1. exchange plan and content digests (what differs between ranks is stored per rank, see docs/FORMAT.md
   "Per-rank entries") and the path digest;
2. rank 0 ``storage.begin_save(overwrite)`` (lock, staging location), cached plan or not: one exchange;
3. global planning on rank 0 (or the cached plan), assignments scattered;
4. every rank :func:`~hyperdcp.saving.write.write_assigned` into ``storage.writer_at(location)``;
5. rank 0 :func:`build_metadata` and ``staging.commit(record)``.

Each step is an exchange in which an error on any rank fails the save on every rank, and rank 0 aborts
the staging (the previous checkpoint is untouched).
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import numpy as np
import xxhash

from ..coordination import wire  # core/wire.py once it exists (P3)
from ..coordination.base import (
    Coordinator,
    _everywhere,
    all_gather_checked,
    broadcast_checked,
    pack_status,
    unpack_status,
)
from ..format import values as values_codec
from ..format.chunk_index import index_from_plan
from ..format.metadata import FileMeta, IndexedTensors, Metadata
from ..format.record_v2 import index_file_name
from ..format.safetensors import save_token
from ..options import SaveOptions
from ..planning.save_plan import GlobalPlan, LocalPlan, PerRank, PlanCache, classify_per_rank, plan_global
from ..results import SaveResult
from ..storage.base import SaveStaging, Storage
from ..storage.identity import DIGEST_BYTES, mismatch_among, path_digest
from ..storage.local import LocalStorage
from ..storage.urls import storage_for
from . import write
from .stage import StagedState


def build_metadata(plan: GlobalPlan, results: list[bytes], values: dict, opts: SaveOptions,
                   per_rank_values: Sequence[str] = ()) -> Metadata:
    """Join the global plan with every rank's write results into the checkpoint metadata.

    ``values`` are rank 0's; those named in ``per_rank_values`` are taken from every rank's result
    instead (each rank sends its own, see :func:`persist`). Vectorised: the chunk table is built as
    arrays (a :class:`~hyperdcp.format.chunk_index.ChunkIndex`); tensors are viewed through it.
    """
    W = plan.world_size
    named: list = []  # [name, bytes] of every data file, rank by rank
    nfiles = np.zeros(len(results), np.int64)
    fl, bl, el, sums = [], [], [], []
    pr_set = set(per_rank_values)
    pr_vals: dict[str, dict[int, Any]] = {k: {} for k in sorted(pr_set)}
    for r, raw in enumerate(results):  # one message per rank: nothing here is per chunk
        head, arr = wire.unpack(raw)
        if pr_set:
            for k, v in head.get("values", {}).items():
                if k in pr_set:
                    pr_vals[k][r] = values_codec.decode(v, f"value {k!r} sent by rank {r}")
        named.extend(head["files"])
        nfiles[r] = len(head["files"])
        fl.append(arr["file"])
        bl.append(arr["begin"])
        el.append(arr["end"])
        sums.extend(head.get("checksums", []))
    files = [FileMeta(n, int(b)) for n, b in named]
    counts = np.array([len(x) for x in fl], np.int64)
    rank_start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    gfile, gbegin, gend = (np.concatenate(x) if x else np.zeros(0, np.int64) for x in (fl, bl, el))
    gfile = gfile + np.repeat(np.cumsum(nfiles) - nfiles, counts)  # file indices of the rank -> of the checkpoint
    g = rank_start[plan.u_writer] + plan.u_slot  # unique chunk -> its row in the concatenated results
    meta = Metadata(
        world_size=W,
        files=files,
        tensors={},
        values={k: v for k, v in values.items() if k not in pr_set},
        checksum_block_bytes=opts.checksum_block_bytes,
        user=dict(opts.user_metadata),
        per_rank_values={k: v for k, v in pr_vals.items() if v},
        per_rank_tensors=dict(plan.per_rank),
    )
    meta.index = index_from_plan(plan, g, gfile, gbegin, gend, sums, opts.checksum_block_bytes)
    meta.tensors = IndexedTensors(meta.index, opts.checksum_block_bytes)  # type: ignore[assignment]
    return meta


def persist(coord: Coordinator, staged: StagedState | BaseException, path: str, opts: SaveOptions,
            cache: PlanCache | None, storage: Storage | None = None) -> SaveResult:
    """Plan, write and commit one checkpoint. Every rank of ``coord`` calls it.

    ``storage`` is where the checkpoint goes (default: :class:`~hyperdcp.storage.local.LocalStorage` of
    ``path``); ``path`` is what every rank must agree on and what the result reports.
    """
    t0 = time.perf_counter()
    W, rank = coord.world_size, coord.rank
    storage = storage if storage is not None else storage_for(path, opts.storage_options)
    staging: SaveStaging | None = None
    committed = False  # whether this rank wrote the commit record (never abort after it)

    content = b""

    def fail_local():
        nonlocal content
        if isinstance(staged, BaseException):
            raise staged
        if W == 1:
            return staged.plan.digest(W)
        content = staged.content()
        # every rank must save to the same path: its digest rides on this exchange, last
        return staged.plan.digest(W) + xxhash.xxh3_128(content).digest() + path_digest(path)

    try:
        records = all_gather_checked(coord, "staging the state dict", fail_local)
        if W > 1:
            wrong = mismatch_among(path, [r[-DIGEST_BYTES:] for r in records], rank, "save")
            if wrong is not None:
                raise _everywhere(wrong)
            records = [r[:-DIGEST_BYTES] for r in records]
        assert isinstance(staged, StagedState)
        digests = [r[:16] for r in records]
        per_rank = PerRank()
        if any(r[16:] != records[0][16:] for r in records):  # some content differs: find what, store it per rank
            tables = coord.gather(content, 0)
            per_rank = PerRank.from_bytes(broadcast_checked(
                coord, "comparing what the ranks save", lambda: classify_per_rank(tables, W).to_bytes(), 0))
        # the plan depends on the tensors stored per rank, never on the values: their digests are compared
        # at every save, cached or not
        key = PlanCache.key(digests + ([per_rank.tensor_key()] if per_rank.tensors else []))
        cached = cache.get(key) if (cache is not None and opts.plan_cache) else None

        def prepare() -> bytes:
            nonlocal staging
            if rank == 0:
                staging = storage.begin_save(overwrite=opts.overwrite)
            return (b"1" if cached is not None else b"0") + (staging.location.encode() if staging else b"")

        replies = all_gather_checked(coord, f"preparing the save to {path!r}", prepare)
        location = replies[0][1:].decode()
        hit = all(r[:1] == b"1" for r in replies)

        gplan: GlobalPlan | None = None
        if hit:
            if rank == 0:
                gplan = cached
                assignment = gplan.assignments[0]
            else:
                assignment = cached
        else:
            gathered = coord.gather(staged.plan.to_bytes(), 0)
            parts, exc = None, None
            if rank == 0:
                try:
                    tables: dict = {}
                    gplan = plan_global([LocalPlan.from_bytes(b, tables) for b in gathered], per_rank.tensors)
                    parts = [pack_status(wire.pack({}, {"a": a}), None) for a in gplan.assignments]
                except Exception as e:  # noqa: BLE001
                    exc = e
                    parts = [pack_status(None, e)] * W
            msg = coord.scatter(parts, 0)
            if exc is not None:
                raise exc
            assignment = wire.unpack(unpack_status(msg, coord, "global planning", 0))[1]["a"]
            if cache is not None and opts.plan_cache:
                cache.put(key, gplan if rank == 0 else assignment)

        wexc, result = None, b""
        try:
            files = staging if staging is not None else storage.writer_at(location)
            result = write.write_assigned(files, rank, staged, assignment, opts,
                                          token=save_token(os.path.basename(location.rstrip("/"))),
                                          per_rank=per_rank.tensors)
            if per_rank.values:  # this rank's own copies of the values stored per rank travel with its results
                enc = staged.encoded_values()
                head, arr = wire.unpack(result)
                head["values"] = {k: enc[k] for k in per_rank.values if k in enc}
                result = wire.pack(head, arr)
        except Exception as e:  # noqa: BLE001
            wexc = e
        results = coord.gather(pack_status(result, wexc), 0)

        meta: Metadata | None = None

        def commit() -> bytes:
            nonlocal meta, committed
            bad = [r for r, m in enumerate(results) if m[:1] != b"\x00"]
            if bad:
                unpack_status(results[bad[0]], coord, f"writing data files of {path!r}", bad[0])
            meta = build_metadata(gplan, [m[1:] for m in results], staged.values, opts, per_rank.values)
            index_name = index_file_name(save_token(os.path.basename(location.rstrip("/"))))
            record, index = meta.encode(index_name)
            if index is not None:  # format 2: the chunk index is an ordinary file of the save, written first
                with staging.create(index_name, "chunk index") as w:
                    w.write(index)
            staging.commit(record)
            committed = True
            return b""

        broadcast_checked(coord, f"committing {path!r}", commit if rank == 0 else None, 0, local=wexc)
        if wexc is not None:
            raise wexc
    except BaseException as e:
        if committed:  # the record is in place: the checkpoint is complete, and its files must stay
            note = getattr(e, "add_note", None)  # Python 3.11+
            if note is not None:
                note(f"The checkpoint {path!r} was committed before this error and is complete; a rank that "
                     "failed after the commit did not hear of it.")
        elif staging is not None:
            staging.abort()
        raise
    finally:
        if staging is not None:
            staging.release()
    mine = wire.unpack(result)[0]["files"] if result else []
    result = SaveResult(
        path=storage.root if isinstance(storage, LocalStorage) else storage.url,
        rank=rank,
        world_size=W,
        bytes_written=sum(int(b) for _, b in mine),
        files_written=[n for n, _ in mine],
        plan_cache_hit=hit,
        seconds=time.perf_counter() - t0,
        _metadata=meta,
    )
    from ..logs import log_save

    log_save(result)  # in a persist process (async saves) this logs nowhere: the SaveFuture logs instead
    return result
