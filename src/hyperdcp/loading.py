"""The load flow behind :func:`hyperdcp.load`.

1. rank 0 reads the metadata and sends it to all ranks (validated on each);
2. each rank walks its state dict: every tensor leaf becomes destination boxes (its local shards),
   intersected with the stored chunks through a per-tensor index; plain values are taken from the
   metadata;
3. the needed bytes are read -- by this rank, or once cluster-wide and exchanged
   (:mod:`hyperdcp.exchange`) -- verified against their checksums and copied into place;
4. a final exchange makes an error on any rank fail the load on every rank.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from . import adapters
from .adapters.state_dict import TENSOR, LoadLeaf, leaves_for_load
from .coordination.base import Coordinator, run_checked
from .core.boxes import Box
from .core.shards import LocalShard, ShardedTensor
from .errors import CorruptionError, MismatchError, StateDictError
from .exchange import read_once
from .format.metadata import Metadata
from .options import LoadOptions
from .planning.load_plan import ChunkRead, Piece, TensorIndex, check_compatible, dst_view, group_reads, pieces_for, src_view
from .storage.checksum import verify_blocks
from .storage.reader import DataFiles
from .storage.threads import run_all
from .sources.base import rename_keys, share_source
from .results import LoadResult


def fetch_metadata(coord: Coordinator, path: str) -> Metadata:
    """Rank 0 reads the commit record, every rank validates it; errors raise on every rank.

    A remote URL (fsspec) must hold a committed hyperdcp checkpoint: HuggingFace sources and unmerged
    rank files of no-collectives async saves are detected on local paths only.
    """
    meta, wrong_path = fetch_metadata_checked(coord, path)
    if wrong_path is not None:
        raise wrong_path
    return meta


def fetch_metadata_checked(coord: Coordinator, path: str) -> tuple[Metadata, Exception | None]:
    """:func:`fetch_metadata`, and this rank's error if it named another path than rank 0 (None if not).

    With several ranks, rank 0's path digest rides on the metadata broadcast (no extra collective); the
    caller raises the error in its next checked step, so it surfaces on every rank.
    """
    source, wrong = share_source(coord, path)
    return source.metadata, wrong


def copy_piece(buf: np.ndarray, read: ChunkRead, meta: Metadata, piece: Piece) -> None:
    """Copy one piece out of a buffer holding bytes [read.lo, read.hi) of its chunk."""
    t = meta.tensors[piece.fqn]
    cb = t.chunks.box(piece.chunk)
    cast = piece.dst_dtype != t.dtype
    src = src_view(buf, read, cb, piece.box, t.dtype, typed=cast)
    dst = dst_view(piece.dst, piece.box, piece.dst_dtype, typed=cast)
    np.copyto(dst, src, casting="unsafe")


def read_chunk(files: DataFiles, meta: Metadata, read: ChunkRead, verify: bool, direct_ok: bool = True,
               out: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
    """Read (and verify) bytes [lo, hi) of a stored chunk as a flat uint8 array.

    Returns (buffer, direct): direct when the bytes were read straight into their destination.
    ``out`` (a flat uint8 array of ``read.nbytes``) is the buffer to read into instead of a new one.
    """
    t = meta.tensors[read.fqn]
    what = f"tensor {read.fqn!r} chunk {t.chunks.box(read.chunk)}"
    files.fd(read.file)  # size and header checked against the file before any buffer is sized from the metadata
    direct = _direct_target(read, meta) if out is None and direct_ok and len(read.pieces) == 1 else None
    buf = direct if direct is not None else out if out is not None else _buffer(read.nbytes, what)
    files.read_into(read.file, read.begin + read.lo, buf, what)
    if verify:
        B = meta.checksum_block_bytes
        bad = verify_blocks(buf, read.lo // B, t.chunks.checksums[read.chunk], B)
        if bad is not None:
            raise CorruptionError(
                f"checksum mismatch in {files.path(read.file)} for {what} (block {bad}, bytes "
                f"{read.begin + bad * B}..): the data file is corrupted; restore it or load another checkpoint"
            )
    return buf, direct is not None


def _buffer(nbytes: int, what: str) -> np.ndarray:
    from .errors import StorageError

    try:
        return np.empty(nbytes, dtype=np.uint8)
    except MemoryError:
        raise StorageError(f"out of memory allocating a {nbytes}-byte read buffer for {what}; free memory, or lower "
                           "read_threads (each thread stages at most STAGING_BYTES)") from None


#: bytes one read thread stages at most for destinations it cannot read into directly (strided, cast,
#: partial chunks); at least two checksum blocks, so a verified read never re-reads much
STAGING_BYTES = 32 << 20


def bounded_reads(meta: Metadata, read: ChunkRead, verify: bool, bound: int = 0) -> list[ChunkRead]:
    """``read`` cut into reads of at most about ``bound`` bytes (plus checksum-block widening), each serving
    row-slabs of the pieces; ``[read]`` when it is small enough. Memory stays bounded whatever the size of
    the chunk or the strides of the destination."""
    from .core import dtypes
    from .planning.load_plan import chunk_strides
    from .storage.checksum import block_range
    B = meta.checksum_block_bytes
    bound = max(int(bound or STAGING_BYTES), 2 * B if verify else 1)
    if read.nbytes <= bound:
        return [read]
    t = meta.tensors[read.fqn]
    cb = t.chunks.box(read.chunk)
    isz = dtypes.itemsize(t.dtype)
    size = int(t.chunks.end[read.chunk] - t.chunks.begin[read.chunk])
    strides = chunk_strides(cb.lengths, isz)
    out: list[ChunkRead] = []
    from .planning.load_plan import byte_span

    for p in read.pieces:
        for box in _cut(cb, p.box, strides, isz, bound):
            lo, hi = byte_span(cb, box, isz)
            if verify:
                lo, hi = block_range(lo, hi, B, size)
            out.append(ChunkRead(read.fqn, read.chunk, read.file, read.begin, lo, hi,
                                 [Piece(p.fqn, p.chunk, box, p.dst, p.dst_dtype)]))
    return out


def _cut(cb: "Box", box: "Box", strides: tuple[int, ...], isz: int, bound: int) -> list["Box"]:
    """Sub-boxes of ``box`` whose byte spans in the chunk are at most ``bound`` (one element at least)."""
    from .core.boxes import Box
    from .planning.load_plan import byte_span
    s, e = byte_span(cb, box, isz)
    if e - s <= bound:
        return [box]
    d = next((i for i, n in enumerate(box.lengths) if n > 1), None)
    if d is None:
        return [box]
    slab = Box(box.offsets, box.lengths[:d] + (1,) + box.lengths[d + 1:])
    s1, e1 = byte_span(cb, slab, isz)
    out: list[Box] = []
    if e1 - s1 <= bound:  # whole slabs along d, k at a time
        k = max(1, (bound - (e1 - s1)) // strides[d] + 1)
        for a in range(0, box.lengths[d], k):
            n = min(k, box.lengths[d] - a)
            out.append(Box(box.offsets[:d] + (box.offsets[d] + a,) + box.offsets[d + 1:],
                           box.lengths[:d] + (n,) + box.lengths[d + 1:]))
        return out
    for a in range(box.lengths[d]):  # one slab is too big: cut each along the next dimensions
        one = Box(box.offsets[:d] + (box.offsets[d] + a,) + box.offsets[d + 1:], slab.lengths)
        out.extend(_cut(cb, one, strides, isz, bound))
    return out


def _direct_target(read: ChunkRead, meta: Metadata) -> np.ndarray | None:
    """The destination memory itself, when the read is a whole chunk landing contiguously uncast."""
    p = read.pieces[0]
    t = meta.tensors[p.fqn]
    size = int(t.chunks.end[p.chunk] - t.chunks.begin[p.chunk])
    if p.dst is None or p.dst_dtype != t.dtype or read.lo != 0 or read.hi != size or p.box != t.chunks.box(p.chunk):
        return None
    view = dst_view(p.dst, p.box, p.dst_dtype, typed=False)
    if not view.flags.c_contiguous:
        return None
    return view.reshape(-1)


def execute_local_reads(files: DataFiles, meta: Metadata, reads: list[ChunkRead], opts: LoadOptions) -> None:
    def one(r: ChunkRead) -> None:
        if len(r.pieces) == 1 and _direct_target(r, meta) is not None:
            subs = [r]  # straight into the destination: no staging buffer
        else:
            subs = bounded_reads(meta, r, opts.verify_checksums)
        # one staging buffer per read, reused by its bounded sub-reads
        stage = _buffer(max(s.nbytes for s in subs), f"tensor {r.fqn!r}") if len(subs) > 1 else None
        for sub in subs:
            out = stage[: sub.nbytes] if stage is not None else None
            buf, direct = read_chunk(files, meta, sub, opts.verify_checksums, out=out)
            if not direct:
                for p in sub.pieces:
                    if p.dst is not None:
                        copy_piece(buf, sub, meta, p)
            del buf

    run_all(one, sorted(reads, key=lambda r: (r.file, r.begin + r.lo)), opts.read_threads)


@dataclass
class LoadTargets:
    """This rank's destinations: tensors to fill, values to set, and what is missing."""

    tensors: dict[str, ShardedTensor]
    values: list[tuple[LoadLeaf, Any]]
    missing: list[str]
    pieces: list[Piece]
    used: set[str]


_DROP, _ABSENT = object(), object()


def saved_rank(fqn: str, saved: Sequence[int], meta: Metadata, coord: Coordinator, opts: LoadOptions) -> Any:
    """The saving rank whose copy of per-rank entry ``fqn`` this rank loads, ``_DROP`` or ``_ABSENT``.

    With the world size of the save each rank takes its own copy (``_ABSENT`` when it saved none);
    otherwise ``opts.per_rank`` decides, and without it the load fails naming the key.
    """
    saved = tuple(int(r) for r in saved)
    if meta.world_size == coord.world_size:
        return coord.rank if coord.rank in saved else _ABSENT
    how = opts.per_rank
    if how is None:
        raise MismatchError(
            f"{fqn!r} was saved per rank (it differed between the {meta.world_size} saving ranks, or only ranks "
            f"{list(saved[:8])}{' ...' if len(saved) > 8 else ''} held it), and this load runs on {coord.world_size} "
            "ranks, so which saved copy each rank should get is not defined. Pass per_rank='rank0' (every rank "
            "takes the copy of the lowest saving rank), per_rank='drop' (leave it as it is), or "
            "per_rank=fn(key, rank, world_size, saved_ranks) returning the saving rank to take"
        )
    if how == "rank0":
        return saved[0]
    if how == "drop":
        return _DROP
    got = how(fqn, coord.rank, coord.world_size, saved)
    if got is None:
        return _DROP
    if type(got) is not int or got not in saved:
        raise MismatchError(
            f"per_rank returned {got!r} for {fqn!r} on rank {coord.rank}; it must return one of the saving ranks "
            f"{list(saved[:8])}{' ...' if len(saved) > 8 else ''} or None"
        )
    return got


def _per_rank_view(st: ShardedTensor, saved: tuple[int, ...], row: int) -> ShardedTensor:
    """``st`` as row ``row`` of a tensor stored per rank (one leading dimension more, ``len(saved)`` rows)."""
    shards = [LocalShard(Box((row,) + sh.box.offsets, (1,) + sh.box.lengths), sh.data, None) for sh in st.shards]
    return ShardedTensor(st.fqn, st.dtype, (len(saved),) + tuple(st.shape), shards, st.finish, layout=None)


def plan_targets(leaves: list[LoadLeaf], meta: Metadata, coord: Coordinator, opts: LoadOptions) -> LoadTargets:
    index = TensorIndex(meta)
    out = LoadTargets({}, [], [], [], set())
    for leaf in leaves:
        fqn = leaf.fqn
        if leaf.kind == TENSOR:
            if fqn not in meta.tensors:
                if fqn in meta.values or fqn in meta.per_rank_values:
                    raise MismatchError(f"{fqn!r} is a tensor in the state dict but a plain value in the checkpoint")
                out.missing.append(fqn)
                continue
            st = adapters.to_sharded(fqn, leaf.value, coord, for_load=True)
            stored = meta.tensors[fqn]
            saved = meta.per_rank_tensors.get(fqn)
            if saved is not None:
                who = saved_rank(fqn, saved, meta, coord, opts)
                if who is _ABSENT:
                    out.missing.append(fqn)
                    continue
                if who is _DROP:
                    continue
                st = _per_rank_view(st, saved, saved.index(who))
            check_compatible(fqn, st, stored, opts.allow_cast)
            out.tensors[fqn] = st
            out.pieces.extend(pieces_for(st, index.get(fqn), stored))
        elif fqn in meta.per_rank_values:
            by_rank = meta.per_rank_values[fqn]
            who = saved_rank(fqn, sorted(by_rank), meta, coord, opts)
            if who is _ABSENT:
                out.missing.append(fqn)
                continue
            if who is _DROP:
                continue
            out.values.append((leaf, by_rank[who]))
        elif fqn in meta.values:
            out.values.append((leaf, meta.values[fqn]))
        elif fqn in meta.tensors:
            raise MismatchError(
                f"{fqn!r} is a plain value ({type(leaf.value).__name__}) in the state dict but a tensor in the "
                "checkpoint; put a tensor of the saved shape there to load it"
            )
        else:
            out.missing.append(fqn)
            continue
        out.used.add(fqn)
    return out


def _renamed(d: dict, key_map) -> dict:
    out = {}
    for k, v in d.items():
        new = key_map(k)
        if new is not None:
            out[new] = v
    return out


def load(state_dict: Any, path: str, coord: Coordinator, opts: LoadOptions) -> LoadResult:
    t0 = time.perf_counter()
    if opts.per_rank is not None and opts.per_rank not in ("rank0", "drop") and not callable(opts.per_rank):
        raise TypeError(f"per_rank must be None, 'rank0', 'drop' or fn(key, rank, world_size, saved_ranks), got "
                        f"{opts.per_rank!r}")
    source, wrong_path = share_source(coord, path)  # wrong_path: raised by the planning step, everywhere
    meta, files = source.metadata, source.reader()  # HF sources: the directory of the files; URLs: RemoteFiles
    if opts.key_map is not None:
        meta = rename_keys(meta, opts.key_map)
        if meta.per_rank_values or meta.per_rank_tensors:
            meta = replace(meta, per_rank_values=_renamed(meta.per_rank_values, opts.key_map),
                           per_rank_tensors=_renamed(meta.per_rank_tensors, opts.key_map))
    if not source.verifiable:  # HF safetensors files carry no hyperdcp checksums
        opts = replace(opts, verify_checksums=False)
    try:
        def plan():
            if wrong_path is not None:
                raise wrong_path
            if not isinstance(state_dict, dict) and not hasattr(state_dict, "state_dict"):
                raise StateDictError(
                    f"load needs a dict (or an object with state_dict()) to load into, got {type(state_dict).__name__}"
                )
            leaves, finish = leaves_for_load(state_dict)
            targets = plan_targets(leaves, meta, coord, opts)
            if targets.missing and opts.strict:
                raise MismatchError(
                    f"{len(targets.missing)} key(s) of the state dict are not in checkpoint {path!r}: "
                    f"{targets.missing[:10]}; pass strict=False to load the rest"
                )
            return targets, finish

        plan_what = f"planning the load of {path!r}"
        spread = opts.read_once and coord.world_size > 1
        if spread:  # a planning error travels with the read-once plan exchange
            targets = finish = plan_error = None
            try:
                targets, finish = plan()
            except Exception as e:  # noqa: BLE001 - raised on every rank by read_once
                plan_error = e
        else:
            targets, finish = run_checked(coord, plan_what, plan)

        def do_reads():
            if spread:
                read_once(files, meta, targets.pieces if targets else [], coord, opts,
                          list(targets.tensors.values()) if targets else None, plan_error, plan_what)
            else:
                reads = group_reads(meta, targets.pieces, opts.verify_checksums)
                execute_local_reads(files, meta, reads, opts)
            for st in targets.tensors.values():
                if st.finish is not None:
                    st.finish()
            # values are set only once every tensor arrived, so a failed load leaves them untouched
            for leaf, value in targets.values:
                leaf.set(value)
            finish()

        run_checked(coord, f"loading {path!r}", do_reads)
    finally:
        files.close()
    result = LoadResult(
        path=os.fspath(path),
        missing_keys=targets.missing,
        unused_keys=sorted(k for k in meta.keys() if k not in targets.used),
        bytes_read=files.bytes_read,
        seconds=time.perf_counter() - t0,
        metadata=meta,
    )
    from .logs import log_load

    log_load(result, targets.pieces, meta)
    return result
