"""Load planning: intersect the boxes a rank needs with the chunks on disk.

For each destination box, the tensor's :class:`~hyperdcp.core.boxes.BoxIndex` yields the stored
chunks it overlaps; each overlap becomes a :class:`Piece`: which chunk, which sub-box (global
coordinates) and where it lands. Reads are then planned per chunk as the smallest byte span of the
chunk that contains every piece needed from it (widened to whole checksum blocks when verifying).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core import dtypes
from ..core.boxes import Box, BoxIndex
from ..core.shards import LocalShard, ShardedTensor
from ..errors import MismatchError
from ..format.checksums import block_range
from ..format.metadata import Metadata, TensorMeta


@dataclass
class Piece:
    """One overlap: the part ``box`` of stored chunk ``chunk`` of tensor ``fqn`` goes to ``dst``."""

    fqn: str
    chunk: int
    box: Box  # global coordinates
    dst: LocalShard | None  # None when the piece is for another rank (read-once)
    dst_dtype: str = ""


@dataclass
class ChunkRead:
    """One ranged read: bytes ``[lo, hi)`` of a stored chunk, serving ``pieces``."""

    fqn: str
    chunk: int
    file: int
    begin: int  # absolute file offset of the chunk
    lo: int  # within-chunk byte range to read
    hi: int
    pieces: list[Piece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


class TensorIndex:
    """Per-tensor BoxIndex, built on first use."""

    def __init__(self, meta: Metadata):
        self.meta = meta
        self._idx: dict[str, BoxIndex] = {}

    def get(self, fqn: str) -> BoxIndex:
        idx = self._idx.get(fqn)
        if idx is None:
            t = self.meta.tensors[fqn]
            idx = self._idx[fqn] = BoxIndex(t.shape, t.chunks.offsets, t.chunks.lengths)
        return idx


def check_compatible(fqn: str, target: ShardedTensor, stored: TensorMeta, allow_cast: bool) -> None:
    if tuple(stored.shape) != tuple(target.shape):
        raise MismatchError(
            f"tensor {fqn!r}: the checkpoint has global shape {list(stored.shape)} but the state dict expects "
            f"{list(target.shape)}; load into a tensor of the saved shape"
        )
    if stored.dtype != target.dtype and not allow_cast:
        raise MismatchError(
            f"tensor {fqn!r}: the checkpoint stores {stored.dtype} but the state dict holds {target.dtype}; pass "
            "allow_cast=True to convert on load, or load into a tensor of the stored dtype"
        )


def pieces_for(target: ShardedTensor, index: BoxIndex, stored: TensorMeta) -> list[Piece]:
    out = []
    for shard in target.shards:
        if shard.box.numel == 0:
            continue
        for c in index.query(shard.box).tolist():
            inter = shard.box.intersect(stored.chunks.box(c))
            if inter is not None:
                out.append(Piece(target.fqn, c, inter, shard, target.dtype))
    return out


def chunk_strides(lengths, itemsize: int) -> tuple[int, ...]:
    st, acc = [], itemsize
    for n in reversed(lengths):
        st.append(acc)
        acc *= int(n)
    return tuple(reversed(st))


def byte_span(chunk_box: Box, piece: Box, itemsize: int) -> tuple[int, int]:
    """Within-chunk [start, stop) bytes from the piece's first to its last element."""
    st = chunk_strides(chunk_box.lengths, itemsize)
    rel0 = [a - b for a, b in zip(piece.offsets, chunk_box.offsets)]
    first = sum(r * s for r, s in zip(rel0, st))
    last = sum((r + n - 1) * s for r, n, s in zip(rel0, piece.lengths, st))
    return first, last + itemsize


def group_reads(meta: Metadata, pieces: list[Piece], verify: bool) -> list[ChunkRead]:
    """One read per stored chunk, covering every piece needed from it."""
    reads: dict[tuple[str, int], ChunkRead] = {}
    for p in pieces:
        t = meta.tensors[p.fqn]
        cb = t.chunks.box(p.chunk)
        isz = dtypes.itemsize(t.dtype)
        s, e = byte_span(cb, p.box, isz)
        r = reads.get((p.fqn, p.chunk))
        if r is None:
            r = reads[(p.fqn, p.chunk)] = ChunkRead(
                p.fqn, p.chunk, int(t.chunks.file[p.chunk]), int(t.chunks.begin[p.chunk]), s, e
            )
        else:
            r.lo, r.hi = min(r.lo, s), max(r.hi, e)
        r.pieces.append(p)
    out = list(reads.values())
    if verify:
        for r in out:
            t = meta.tensors[r.fqn]
            size = int(t.chunks.end[r.chunk] - t.chunks.begin[r.chunk])
            r.lo, r.hi = block_range(r.lo, r.hi, meta.checksum_block_bytes, size)
    return out


def src_view(buf: np.ndarray, read: ChunkRead, chunk_box: Box, piece: Box, stored_dtype: str,
             typed: bool) -> np.ndarray:
    """A strided view of ``piece`` inside a buffer holding bytes ``[read.lo, read.hi)`` of the chunk."""
    isz = dtypes.itemsize(stored_dtype)
    st = chunk_strides(chunk_box.lengths, isz)
    s, _ = byte_span(chunk_box, piece, isz)
    if typed:
        return np.ndarray(piece.lengths, dtype=dtypes.to_numpy(stored_dtype), buffer=buf, offset=s - read.lo,
                          strides=st)
    return np.ndarray(byte_shape(piece.lengths, isz), dtype=np.uint8, buffer=buf, offset=s - read.lo,
                      strides=st + (1,) if len(st) < _NP_MAXDIMS else st[:-1] + (1,))


_NP_MAXDIMS = 64


def byte_shape(lengths: tuple[int, ...], isz: int) -> tuple[int, ...]:
    """The shape of a box's bytes as uint8: its lengths and a byte axis; for a 64-dim box (numpy's
    limit) the byte axis is folded into the last dimension instead (C order: the same bytes)."""
    if len(lengths) < _NP_MAXDIMS:
        return tuple(lengths) + (isz,)
    return tuple(lengths[:-1]) + (lengths[-1] * isz,)


def dst_view(shard: LocalShard, piece: Box, dtype: str, typed: bool) -> np.ndarray:
    isz = dtypes.itemsize(dtype)
    rel = piece.relative_to(shard.box)
    if typed:
        arr = shard.data.view(dtypes.to_numpy(dtype)).reshape(shard.box.lengths)
    else:
        arr = shard.data.reshape(byte_shape(shard.box.lengths, isz))
        if len(rel.lengths) >= _NP_MAXDIMS:
            sl = rel.slices()
            return arr[sl[:-1] + (slice(sl[-1].start * isz, sl[-1].stop * isz),)]
    return arr[rel.slices()]
