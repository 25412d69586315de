"""The bottom every load reader shares: reading stored chunks and copying pieces into place.

- :func:`read_chunk`: bytes [lo, hi) of one stored chunk (checked file, exact read, verified blocks);
- :func:`copy_piece`: one piece out of such a buffer into its destination (strided, cast if asked);
- :func:`execute_local_reads`: a rank's own reads, in file order, over ``read_threads`` threads, with
  staging memory bounded by :data:`STAGING_BYTES` per thread (:func:`bounded_reads`);
- :func:`read_box`: one region of one tensor as C-ordered bytes (tools: diff, conversions).

Call order: plan the pieces (:mod:`hyperdcp.planning.load_plan`), group them into reads
(``group_reads``), then ``execute_local_reads`` (or read-once, which calls ``read_chunk`` and
``copy_piece`` itself). Nothing here talks to other ranks.
"""

from __future__ import annotations

import numpy as np

from ..core import dtypes
from ..core.boxes import Box
from ..core.shards import LocalShard, ShardedTensor
from ..errors import CorruptionError, StorageError
from ..format.metadata import Metadata
from ..options import LoadOptions
from ..planning.load_plan import (
    ChunkRead,
    Piece,
    TensorIndex,
    byte_span,
    chunk_strides,
    dst_view,
    group_reads,
    pieces_for,
    src_view,
)
from ..sources.base import ChunkReader as DataFiles
from ..storage.checksum import block_range, verify_blocks
from ..storage.threads import run_all


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
    direct = _direct_target(read, meta) if out is None and direct_ok and len(read.pieces) == 1 else None
    # size and header checked against the file before any buffer is sized from the metadata (a remote reader
    # may fetch this first read with the check, in one request of at most its request size, into its target)
    files.fd(read.file, (read.begin + read.lo, read.nbytes), direct if direct is not None else out)
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
    B = meta.checksum_block_bytes
    bound = max(int(bound or STAGING_BYTES), 2 * B if verify else 1)
    if read.nbytes <= bound:
        return [read]
    t = meta.tensors[read.fqn]
    cb = t.chunks.box(read.chunk)
    isz = dtypes.itemsize(t.dtype)
    size = int(t.chunks.end[read.chunk] - t.chunks.begin[read.chunk])
    strides = chunk_strides(cb.lengths, isz)
    if len(read.pieces) > 1 and strides[0] <= bound:
        return _row_slab_reads(read, cb, strides[0], isz, size, B if verify else 0, bound)
    out: list[ChunkRead] = []
    for p in read.pieces:
        for box in _cut(cb, p.box, strides, isz, bound):
            lo, hi = byte_span(cb, box, isz)
            if verify:
                lo, hi = block_range(lo, hi, B, size)
            out.append(ChunkRead(read.fqn, read.chunk, read.file, read.begin, lo, hi,
                                 [Piece(p.fqn, p.chunk, box, p.dst, p.dst_dtype)]))
    return out


def _row_slab_reads(read: ChunkRead, cb: "Box", row_bytes: int, isz: int, size: int, block: int,
                    bound: int) -> list[ChunkRead]:
    """Several pieces of one big chunk (e.g. column blocks of the same rows): cut the chunk into slabs of
    whole rows and let each slab's read serve every piece's part of it, so each byte is read once instead of
    once per piece. ``block``: checksum block to widen reads to (0: no verification)."""

    r0 = min(p.box.offsets[0] for p in read.pieces)
    r1 = max(p.box.offsets[0] + p.box.lengths[0] for p in read.pieces)
    k = max(1, bound // row_bytes)
    out: list[ChunkRead] = []
    for a in range(r0, r1, k):
        slab = Box((a,) + cb.offsets[1:], (min(k, r1 - a),) + cb.lengths[1:])
        parts = [(p, b) for p in read.pieces if (b := p.box.intersect(slab)) is not None]
        if not parts:
            continue
        spans = [byte_span(cb, b, isz) for _, b in parts]
        lo, hi = min(x for x, _ in spans), max(y for _, y in spans)
        if block:
            lo, hi = block_range(lo, hi, block, size)
        out.append(ChunkRead(read.fqn, read.chunk, read.file, read.begin, lo, hi,
                             [Piece(p.fqn, p.chunk, b, p.dst, p.dst_dtype) for p, b in parts]))
    return out


def _cut(cb: "Box", box: "Box", strides: tuple[int, ...], isz: int, bound: int) -> list["Box"]:
    """Sub-boxes of ``box`` whose byte spans in the chunk are at most ``bound`` (one element at least)."""
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


def read_box(files: DataFiles, meta: Metadata, fqn: str, box: Box, verify: bool = True,
             index: TensorIndex | None = None) -> np.ndarray:
    """The C-ordered bytes (flat uint8) of region ``box`` of tensor ``fqn``, through the verified reader
    ``files`` (:meth:`Source.reader`); ``verify``: check block checksums (False for unverifiable sources)."""
    t = meta.tensors[fqn]
    buf = np.empty(box.numel * dtypes.itemsize(t.dtype), np.uint8)
    if box.numel == 0:
        return buf
    st = ShardedTensor(fqn, t.dtype, t.shape, [LocalShard(box, buf)])
    index = index or TensorIndex(meta)
    reads = group_reads(meta, pieces_for(st, index.get(fqn), t), verify)
    execute_local_reads(files, meta, reads, LoadOptions(verify_checksums=verify, read_threads=1))
    return buf
