"""The save flow shared by :func:`hyperdcp.save` and the async persist processes.

1. *stage*: adapters turn the state dict into chunks with host bytes plus plain values;
2. *persist*: exchange plan and content digests (what differs between ranks is stored per rank, see
   docs/FORMAT.md "Per-rank entries"); rank 0 takes the target (lock, temporary directory); global
   planning (or the cached plan); every rank writes its assigned chunks with checksums and fsyncs;
   rank 0 assembles the metadata and commits. Each step is an exchange in which an error on any rank
   fails the save on every rank, and rank 0 removes the temporary directory.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import xxhash

from . import adapters
from .adapters.state_dict import TENSOR, iter_leaves
from .coordination import wire
from .coordination.base import Coordinator, _everywhere, all_gather_checked, broadcast_checked, pack_status, unpack_status
from .core import dtypes
from .core.shards import LocalShard, ShardedTensor, check_shard_buffer
from .errors import StateDictError
from .format import values as values_codec
from .format.metadata import MAX_DIMS, MAX_TENSOR_BYTES, ChunkTable, FileMeta, Metadata, TensorMeta
from .options import SaveOptions
from .path_identity import DIGEST_BYTES, mismatch_among, path_digest
from .planning.save_plan import GlobalPlan, LocalPlan, PerRank, PlanCache, classify_per_rank, content_table, plan_global
from .storage.commit import SaveTarget, load_metadata
from .storage.data_file import ChunkToWrite, chunk_name, data_file_name, save_token, write_data_file
from .storage.threads import run_all


@dataclass
class StagedState:
    """One rank's contribution to a save: host chunks in plan order, and plain values."""

    plan: LocalPlan
    chunks: list[tuple[ShardedTensor, LocalShard]]
    values: dict[str, Any]
    #: the values encoded (tagged JSON); computed when first needed
    encoded: dict[str, list] | None = None

    def encoded_values(self) -> dict[str, list]:
        if self.encoded is None:
            self.encoded = {k: values_codec.encode(v, k) for k, v in self.values.items()}
        return self.encoded

    def content(self) -> bytes:
        """This rank's content table: a digest of every tensor it holds whole and of every value.

        Compared across ranks to find what differs between them (and so is stored per rank): a tensor
        every rank claims to hold whole (a plain tensor, a replicated DTensor) is checked, not trusted.
        """
        tkeys, tdig = [], []
        for st, sh in self.chunks:
            if sh.box.lengths == tuple(st.shape) and not any(sh.box.offsets):
                tkeys.append(st.fqn)
                tdig.append(xxhash.xxh3_64_intdigest(sh.data))
        enc = self.encoded_values()
        vkeys = sorted(enc)
        return content_table(tkeys, tdig, vkeys, [values_codec.digest(enc[k]) for k in vkeys])

    @property
    def nbytes(self) -> int:
        return sum(sh.data.size for _, sh in self.chunks)


def check_storable(fqn: str, shape: tuple[int, ...], dtype: str) -> None:
    """Refuse, before anything is written, a tensor the format cannot store (so every save loads)."""
    if not fqn:
        raise StateDictError("a tensor is stored under the empty key ''; hyperdcp names every tensor by a non-empty "
                             "key: put it in the state dict under a name")
    if len(shape) > MAX_DIMS:
        raise StateDictError(f"tensor {fqn!r} has {len(shape)} dimensions; the format stores at most {MAX_DIMS}: "
                             "reshape it before saving")
    numel = 1
    for s in shape:
        numel *= int(s)
    if numel * dtypes.itemsize(dtype) > MAX_TENSOR_BYTES:
        raise StateDictError(f"tensor {fqn!r} of shape {list(shape)} is larger than the format's "
                             f"{MAX_TENSOR_BYTES}-byte limit per tensor")


def stage(state_dict: Any, ctx: Coordinator) -> StagedState:
    """Describe ``state_dict`` for saving (no copies of CPU tensors; device tensors come to host)."""
    if not isinstance(state_dict, dict) and not hasattr(state_dict, "state_dict"):
        raise StateDictError(f"the state dict must be a dict (or an object with state_dict()), got {type(state_dict).__name__}")
    tensors, vals, enc = [], {}, {}
    for fqn, kind, v in iter_leaves(state_dict):
        if kind == TENSOR:
            st = adapters.to_sharded(fqn, v, ctx, for_load=False)
            check_storable(fqn, st.shape, st.dtype)
            for sh in st.shards:
                check_shard_buffer(fqn, sh, st.dtype)
            tensors.append(st)
        else:
            enc[fqn] = values_codec.encode(v, fqn)
            vals[fqn] = v
    plan, chunks = LocalPlan.build(tensors, list(vals))
    return StagedState(plan, chunks, vals, enc)


@dataclass
class SaveResult:
    """What :func:`hyperdcp.save` returns on every rank."""

    path: str
    rank: int
    world_size: int
    bytes_written: int  # by this rank
    files_written: list[str]
    plan_cache_hit: bool
    seconds: float
    _metadata: Metadata | None = field(default=None, repr=False)

    @property
    def metadata(self) -> Metadata:
        """The committed metadata (read from disk on ranks other than 0)."""
        if self._metadata is None:
            self._metadata = load_metadata(self.path)
        return self._metadata

    def __repr__(self) -> str:
        return (f"SaveResult(path={self.path!r}, rank={self.rank}, world_size={self.world_size}, "
                f"bytes_written={self.bytes_written}, files_written={len(self.files_written)}, "
                f"plan_cache_hit={self.plan_cache_hit}, seconds={self.seconds:.3f})")

def _write_assigned(tmp: str, rank: int, staged: StagedState, assignment: np.ndarray, opts: SaveOptions,
                    token: str = "", per_rank: dict[str, np.ndarray] | None = None) -> bytes:
    """Write this rank's assigned chunks into 1..files_per_rank data files; return the result message.

    ``token`` (unique per save, the same on every rank) goes into the file names: see data_file_name.
    A chunk of a tensor in ``per_rank`` (fqn -> holders) is written as this rank's row of the stacked
    tensor (see :func:`~hyperdcp.planning.save_plan.plan_global`)."""
    todo = [staged.chunks[i] for i in assignment.tolist()]
    if not todo:
        empty = np.zeros(0, np.int64)
        return wire.pack({"files": [], "checksums": []}, {"file": empty, "begin": empty, "end": empty})
    sizes = np.array([sh.data.size for _, sh in todo], dtype=np.int64)
    nfiles = max(1, min(opts.files_per_rank, len(todo)))
    cut = np.searchsorted(np.cumsum(sizes), np.arange(1, nfiles) * sizes.sum() / nfiles)
    groups = [g for g in np.split(np.arange(len(todo)), cut) if len(g)]
    jobs = []
    for fi, g in enumerate(groups):
        name = data_file_name(rank, fi, token)
        chunks = []
        for i in g.tolist():
            st, sh = todo[i]
            holders = per_rank.get(st.fqn) if per_rank else None
            if holders is not None:
                row = int(np.searchsorted(holders, rank))
                chunks.append(ChunkToWrite(chunk_name(st.fqn, (row,) + tuple(sh.box.offsets), False), st.dtype,
                                           (1,) + tuple(sh.box.lengths), sh.data))
                continue
            whole = sh.box.lengths == tuple(st.shape)
            chunks.append(ChunkToWrite(chunk_name(st.fqn, sh.box.offsets, whole), st.dtype, sh.box.lengths, sh.data))
        jobs.append((name, chunks))
    written = run_all(lambda j: write_data_file(tmp, j[0], j[1], opts.checksum_block_bytes), jobs, len(jobs))
    fidx = np.concatenate([np.full(len(g), fi, np.int64) for fi, g in enumerate(groups)])
    begin = np.concatenate([np.array(w.begin, np.int64) for w in written])
    end = np.concatenate([np.array(w.end, np.int64) for w in written])
    order = np.concatenate(groups)
    inv = np.empty(len(order), np.int64)
    inv[order] = np.arange(len(order))
    sums = [s for w in written for s in w.checksums]
    return wire.pack(
        {"files": [[w.name, w.nbytes] for w in written], "checksums": [sums[i] for i in inv.tolist()]},
        {"file": fidx[inv], "begin": begin[inv], "end": end[inv]},
    )


def build_metadata(plan: GlobalPlan, results: list[bytes], values: dict, opts: SaveOptions,
                   per_rank_values: Sequence[str] = ()) -> Metadata:
    """Join the global plan with every rank's write results into the checkpoint metadata.

    ``values`` are rank 0's; those named in ``per_rank_values`` are taken from every rank's result
    instead (each rank sends its own, see :func:`persist`).
    """
    W = plan.world_size
    files: list[FileMeta] = []
    file_base = np.zeros(W, np.int64)
    fl, bl, el, sums = [], [], [], []
    pr_set = set(per_rank_values)
    pr_vals: dict[str, dict[int, Any]] = {k: {} for k in sorted(pr_set)}
    for r, raw in enumerate(results):
        head, arr = wire.unpack(raw)
        for k, v in head.get("values", {}).items():
            if k in pr_set:
                pr_vals[k][r] = values_codec.decode(v, f"value {k!r} sent by rank {r}")
        file_base[r] = len(files)
        files.extend(FileMeta(n, int(b)) for n, b in head["files"])
        fl.append(arr["file"] + file_base[r])
        bl.append(arr["begin"])
        el.append(arr["end"])
        sums.extend(head.get("checksums", []))
    counts = np.array([len(x) for x in fl], np.int64)
    rank_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    gfile, gbegin, gend = (np.concatenate(x) if x else np.zeros(0, np.int64) for x in (fl, bl, el))
    g = rank_start[plan.u_writer] + plan.u_slot  # unique chunk -> its row in the concatenated results
    ufile, ubegin, uend = gfile[g], gbegin[g], gend[g]
    usums = [sums[i] for i in g.tolist()]
    ranges = plan.tensor_ranges()
    tensors = {}
    for t, spec in enumerate(plan.tensors):
        a, b = int(ranges[t]), int(ranges[t + 1])
        nd = len(spec.shape)
        tensors[spec.fqn] = TensorMeta(
            spec.dtype,
            spec.shape,
            ChunkTable(plan.u_offsets[a:b, :nd], plan.u_lengths[a:b, :nd], ufile[a:b], ubegin[a:b], uend[a:b], usums[a:b]),
        )
    return Metadata(
        world_size=W,
        files=files,
        tensors=tensors,
        values={k: v for k, v in values.items() if k not in pr_set},
        checksum_block_bytes=opts.checksum_block_bytes,
        user=dict(opts.user_metadata),
        per_rank_values={k: v for k, v in pr_vals.items() if v},
        per_rank_tensors=dict(plan.per_rank),
    )


def persist(coord: Coordinator, staged: StagedState | BaseException, path: str, opts: SaveOptions,
            cache: PlanCache | None) -> SaveResult:
    """Plan, write and commit one checkpoint. Every rank of ``coord`` calls it."""
    t0 = time.perf_counter()
    W, rank = coord.world_size, coord.rank
    target = SaveTarget(path, overwrite=opts.overwrite) if rank == 0 else None

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
            tmp = target.prepare() if target is not None else ""
            return (b"1" if cached is not None else b"0") + tmp.encode()

        replies = all_gather_checked(coord, f"preparing the save to {path!r}", prepare)
        tmp = replies[0][1:].decode()
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
            result = _write_assigned(tmp, rank, staged, assignment, opts, token=save_token(os.path.basename(tmp)),
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
            nonlocal meta
            bad = [r for r, m in enumerate(results) if m[:1] != b"\x00"]
            if bad:
                unpack_status(results[bad[0]], coord, f"writing data files of {path!r}", bad[0])
            meta = build_metadata(gplan, [m[1:] for m in results], staged.values, opts, per_rank.values)
            target.commit(meta.to_json())
            return b""

        broadcast_checked(coord, f"committing {path!r}", commit if rank == 0 else None, 0, local=wexc)
        if wexc is not None:
            raise wexc
    except BaseException:
        if target is not None:
            target.abort()
        raise
    finally:
        if target is not None:
            target.release()
    mine = wire.unpack(result)[0]["files"] if result else []
    result = SaveResult(
        path=os.path.abspath(os.fspath(path)),
        rank=rank,
        world_size=W,
        bytes_written=sum(int(b) for _, b in mine),
        files_written=[n for n, _ in mine],
        plan_cache_hit=hit,
        seconds=time.perf_counter() - t0,
        _metadata=meta,
    )
    from .logs import log_save

    log_save(result)  # in a persist process (async saves) this logs nowhere: the SaveFuture logs instead
    return result
