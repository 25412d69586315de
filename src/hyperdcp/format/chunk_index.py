"""The binary chunk index of format version 2: every stored chunk of a checkpoint as integer arrays.

Specified in docs/FORMAT.md ("Format version 2: the chunk index"). The index is a safetensors file
(8-byte little-endian header length, JSON header, raw little-endian arrays; no pickle) whose arrays are:

=================  =====  ==========  =========================================================
name               dtype  shape       meaning
=================  =====  ==========  =========================================================
tensor.dtype       I64    (T,)        index into the record's ``index.dtypes`` list
tensor.ndim        I64    (T,)        number of dimensions (<= 64)
tensor.shape       I64    (T, D)      global shape; dimensions past ``ndim`` are 1
tensor.chunks      I64    (T,)        number of chunks (chunks are stored tensor by tensor)
chunk.offsets      I64    (N, D)      box offsets; past ``ndim``: 0
chunk.lengths      I64    (N, D)      box lengths; past ``ndim``: 1
chunk.file         I64    (N,)        index into the record's data ``files``
chunk.begin        I64    (N,)        absolute first byte of the chunk in its file
chunk.end          I64    (N,)        one past its last byte
chunk.checksums    U64    (B,)        xxh3-64 of every checksum block, chunk by chunk
=================  =====  ==========  =========================================================

``T`` is the number of tensors (the record's ``index.tensors`` names them, in order), ``D`` the largest
``ndim`` (0 when there is none), ``N`` the number of chunks and ``B`` the sum over chunks of their block
counts (``max(1, ceil(bytes / block_bytes))``). :func:`decode` validates everything with numpy passes
over whole arrays (no per-chunk Python work) and raises :class:`~hyperdcp.errors.FormatError` naming the
file and what is wrong. :class:`ChunkIndex` is also the array view of any :class:`Metadata`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from itertools import chain
from typing import Sequence

import numpy as np

from ..core import dtypes
from ..core.boxes import check_exact_cover, grid_tiles
from ..errors import CheckpointError, FormatError
from .checksums import n_blocks

INDEX_FORMAT = "hyperdcp-chunk-index"
INDEX_VERSION = "2"
#: array name -> (safetensors dtype, numpy little-endian dtype, rank)
ARRAYS: dict[str, tuple[str, str, int]] = {
    "tensor.dtype": ("I64", "<i8", 1),
    "tensor.ndim": ("I64", "<i8", 1),
    "tensor.shape": ("I64", "<i8", 2),
    "tensor.chunks": ("I64", "<i8", 1),
    "chunk.offsets": ("I64", "<i8", 2),
    "chunk.lengths": ("I64", "<i8", 2),
    "chunk.file": ("I64", "<i8", 1),
    "chunk.begin": ("I64", "<i8", 1),
    "chunk.end": ("I64", "<i8", 1),
    "chunk.checksums": ("U64", "<u8", 1),
}
MAX_DIMS = 64
MAX_NUMEL = 1 << 62
MAX_TENSOR_BYTES = 1 << 62


@dataclass
class ChunkIndex:
    """Every tensor and chunk of a checkpoint as arrays (row t: tensor t; row i: chunk i).

    Chunks are grouped by tensor in tensor order: tensor t owns rows ``first[t]:first[t + 1]``. The
    block checksums of chunk i are ``checksums[sum_first[i]:sum_first[i + 1]]``.
    """

    names: list[str]
    dtype_names: list[str]
    dtype: np.ndarray  # (T,) int64
    ndim: np.ndarray  # (T,) int64
    shape: np.ndarray  # (T, D) int64
    chunks: np.ndarray  # (T,) int64
    offsets: np.ndarray  # (N, D) int64
    lengths: np.ndarray  # (N, D) int64
    file: np.ndarray  # (N,) int64
    begin: np.ndarray  # (N,) int64
    end: np.ndarray  # (N,) int64
    checksums: np.ndarray  # (B,) uint64
    first: np.ndarray = field(init=False, repr=False)
    sum_first: np.ndarray = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.first = np.zeros(len(self.chunks) + 1, np.int64)
        np.cumsum(self.chunks, out=self.first[1:])

    @property
    def num_tensors(self) -> int:
        return len(self.names)

    @property
    def num_chunks(self) -> int:
        return len(self.begin)

    def block_starts(self, block_bytes: int) -> np.ndarray:
        """(N + 1,) start of each chunk's checksums in :attr:`checksums` (computed once)."""
        if self.sum_first is None:
            nb = np.maximum(1, -(-(self.end - self.begin) // block_bytes))
            self.sum_first = np.zeros(len(nb) + 1, np.int64)
            np.cumsum(nb, out=self.sum_first[1:])
        return self.sum_first

    def tensor_id(self) -> np.ndarray:
        """(N,) the tensor of each chunk."""
        return np.repeat(np.arange(len(self.names), dtype=np.int64), self.chunks)

    # -- encoding --------------------------------------------------------------------------
    def encode(self) -> bytes:
        """The index file: a safetensors file of :data:`ARRAYS` (header padded to 8 bytes)."""
        doc: dict = {"__metadata__": {"format": INDEX_FORMAT, "version": INDEX_VERSION}}
        parts, pos = [], 0
        for name, (code, np_dtype, _) in ARRAYS.items():
            a = np.ascontiguousarray(self._array(name), dtype=np_dtype)
            doc[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [pos, pos + a.nbytes]}
            parts.append(a.data.cast("B") if a.nbytes else b"")
            pos += a.nbytes
        head = json.dumps(doc, separators=(",", ":")).encode("utf-8")
        head += b" " * (-len(head) % 8)
        return b"".join([struct.pack("<Q", len(head)), head, *parts])

    def _array(self, name: str) -> np.ndarray:
        return getattr(self, name.split(".", 1)[1])  # "tensor.chunks" -> self.chunks, "chunk.file" -> self.file


def from_tables(names: Sequence[str], dtypes_: Sequence[str], shapes: Sequence[tuple[int, ...]],
                tables: Sequence) -> ChunkIndex:
    """The index of per-tensor chunk tables (``ChunkTable``-like: offsets, lengths, file, begin, end,
    checksums as hex strings or uint64 arrays); used when a Metadata was built tensor by tensor."""
    T = len(names)
    ndim = np.array([len(s) for s in shapes], np.int64)
    D = int(ndim.max()) if T else 0
    shape = np.ones((T, D), np.int64)
    counts = np.array([len(c.begin) for c in tables], np.int64)
    N = int(counts.sum())
    offs, lens = np.zeros((N, D), np.int64), np.ones((N, D), np.int64)
    pos = 0
    for t, (s, c) in enumerate(zip(shapes, tables)):
        nd, n = len(s), int(counts[t])
        shape[t, :nd] = s
        if nd and n:
            offs[pos:pos + n, :nd] = c.offsets
            lens[pos:pos + n, :nd] = c.lengths
        pos += n
    cat = (lambda k: np.concatenate([np.asarray(getattr(c, k), np.int64) for c in tables]) if N
           else np.zeros(0, np.int64))
    sums = [c.checksums for c in tables]
    flat = np.concatenate([s.as_uint64() if isinstance(s, HexChecksums) else hex_to_uint64(s) for s in sums]) \
        if T else np.zeros(0, np.uint64)
    table = sorted(set(dtypes_))
    code = {d: i for i, d in enumerate(table)}
    return ChunkIndex(list(names), table, np.array([code[d] for d in dtypes_], np.int64), ndim, shape, counts,
                      offs, lens, cat("file"), cat("begin"), cat("end"), flat)


def hex_to_uint64(sums: Sequence[str]) -> np.ndarray:
    """Block checksums written as 16 hex digits each (format 1, write results) as uint64."""
    return np.frombuffer(bytes.fromhex("".join(sums)), ">u8").astype(np.uint64) if len(sums) else np.zeros(0, np.uint64)


class HexChecksums(Sequence):
    """Chunk i's block checksums as the hex string of format 1 (``checksums[i]``), from uint64 arrays."""

    def __init__(self, flat: np.ndarray, starts: np.ndarray):
        self.flat, self.starts = flat, starts  # starts: (n + 1,)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.flat[self.starts[i]:self.starts[i + 1]].astype(">u8").tobytes().hex()

    def as_uint64(self) -> np.ndarray:
        return self.flat[self.starts[0]:self.starts[-1]]


# -- decoding ----------------------------------------------------------------------------------
def decode(raw: bytes, where: str, names: list[str], dtype_names: list[str], file_sizes: np.ndarray,
           block_bytes: int) -> ChunkIndex:
    """Parse and strictly validate an index file (see the module docstring); FormatError naming ``where``.

    ``names``/``dtype_names`` come from the (already validated) commit record, ``file_sizes`` are the
    sizes of its data files, ``block_bytes`` its checksum block size.
    """
    def bad(why: str) -> FormatError:
        return FormatError(f"chunk index {where}: {why}; the index is damaged or was not written by hyperdcp -- "
                           "restore the checkpoint's files or load another checkpoint")

    arrays = _read_arrays(memoryview(raw), bad)
    T, Tn = len(arrays["tensor.ndim"]), len(names)
    if T != Tn:
        raise bad(f"it describes {T} tensors but the commit record names {Tn}")
    for k in ("tensor.dtype", "tensor.chunks"):
        if arrays[k].shape != (T,):
            raise bad(f"array {k} has shape {list(arrays[k].shape)}, expected [{T}]")
    shape = arrays["tensor.shape"]
    D = shape.shape[1]
    if shape.shape[0] != T:
        raise bad(f"array tensor.shape has shape {list(shape.shape)}, expected [{T}, D]")
    N = len(arrays["chunk.begin"])
    for k in ("chunk.offsets", "chunk.lengths"):
        if arrays[k].shape != (N, D):
            raise bad(f"array {k} has shape {list(arrays[k].shape)}, expected [{N}, {D}]")
    for k in ("chunk.file", "chunk.end"):
        if arrays[k].shape != (N,):
            raise bad(f"array {k} has shape {list(arrays[k].shape)}, expected [{N}]")
    ndim, code, counts = arrays["tensor.ndim"], arrays["tensor.dtype"], arrays["tensor.chunks"]
    offs, lens = arrays["chunk.offsets"], arrays["chunk.lengths"]
    f, b, e, sums = arrays["chunk.file"], arrays["chunk.begin"], arrays["chunk.end"], arrays["chunk.checksums"]

    # tensors: dtype codes, ranks, shapes (padding 1), sizes without overflow
    if T and ((ndim < 0) | (ndim > MAX_DIMS)).any():
        raise bad(f"tensor {names[_first(~((ndim >= 0) & (ndim <= MAX_DIMS)))]!r} has a rank outside [0, {MAX_DIMS}]")
    if D != (int(ndim.max()) if T else 0):
        raise bad(f"arrays are {D} dimensions wide but the largest tensor rank is {int(ndim.max()) if T else 0}")
    if T and ((code < 0) | (code >= len(dtype_names))).any():
        raise bad(f"tensor {names[_first((code < 0) | (code >= len(dtype_names)))]!r} names a dtype outside the "
                  "record's dtype list")
    used = np.arange(D)[None, :] < ndim[:, None]  # (T, D)
    if ((shape < 0) | (~used & (shape != 1))).any():
        raise bad(f"tensor {names[_first(((shape < 0) | (~used & (shape != 1))).any(axis=1))]!r} has an invalid shape")
    isz = np.array([dtypes.ITEMSIZE[d] for d in dtype_names], np.int64)[code] if T else np.zeros(0, np.int64)
    numel = np.ones(T, np.int64)
    for d in range(D):  # overflow-free: refuse before a product could pass 2^62
        s = shape[:, d]
        over = (s > 0) & (numel > MAX_NUMEL // np.maximum(s, 1))
        if over.any():
            raise bad(f"tensor {names[_first(over)]!r} declares an absurd size")
        numel = numel * s
    if T and (numel > MAX_TENSOR_BYTES // isz).any():
        raise bad(f"tensor {names[_first(numel > MAX_TENSOR_BYTES // isz)]!r} declares an absurd size")

    # chunk counts
    if T and (counts < 0).any():
        raise bad(f"tensor {names[_first(counts < 0)]!r} has a negative chunk count")
    if T and (counts > N).any() or int(counts.sum()) != N:
        raise bad(f"the tensors' chunk counts do not add up to the {N} chunks stored")
    empty_listed = (numel == 0) & (counts > 0)
    if empty_listed.any():
        raise bad(f"tensor {names[_first(empty_listed)]!r} is empty but lists chunks")
    unlisted = (numel > 0) & (counts == 0)
    if unlisted.any():
        raise bad(f"tensor {names[_first(unlisted)]!r} lists no chunks")
    tid = np.repeat(np.arange(T, dtype=np.int64), counts)
    first = np.zeros(T + 1, np.int64)
    np.cumsum(counts, out=first[1:])

    def chunk_bad(mask: np.ndarray, what: str) -> FormatError:
        i = _first(mask)
        t = int(tid[i])
        return bad(f"chunk {i - int(first[t])} of tensor {names[t]!r} {what}")

    if N:
        # boxes inside their tensor (overflow-free comparisons), padding 0 / 1
        cu = used[tid]
        sh = shape[tid]
        outside = ((offs < 0) | (lens <= 0) | (lens > sh) | (offs > sh - lens)).any(axis=1)
        if outside.any():
            raise chunk_bad(outside, "has a box outside the tensor's shape (or an empty box)")
        pad = (~cu & ((offs != 0) | (lens != 1))).any(axis=1)
        if pad.any():
            raise chunk_bad(pad, "has padding dimensions that are not offset 0 / length 1")
        # byte ranges: file in range, inside the file, sized to the box
        nfiles = len(file_sizes)
        if ((f < 0) | (f >= nfiles)).any():
            raise chunk_bad((f < 0) | (f >= nfiles), f"names file index {int(f[_first((f < 0) | (f >= nfiles))])}, "
                            f"outside the record's {nfiles} data files")
        size = isz[tid].copy()  # lengths fit the tensor: no overflow
        for d in range(D):
            size *= lens[:, d]
        if ((b < 0) | (e < 0)).any():
            raise chunk_bad((b < 0) | (e < 0), "has a negative byte offset")
        if (e - b != size).any():
            raise chunk_bad(e - b != size, "has a byte range whose length does not match its box and dtype")
        fs = np.asarray(file_sizes, np.int64)[f]
        past = b > fs - size
        if past.any():
            i = _first(past)
            raise chunk_bad(past, f"ends at byte {int(b[i]) + int(size[i])}, past the end of its data file "
                            f"({int(fs[i])} bytes)")
        order = np.lexsort((b, f))
        fo, bo, eo = f[order], b[order], e[order]
        lap = (fo[1:] == fo[:-1]) & (bo[1:] < eo[:-1])
        if lap.any():
            j = int(order[_first(lap) + 1])
            raise chunk_bad(np.arange(N) == j, "overlaps another chunk in the same data file")
        # block checksums: exactly one per block
        nb = np.maximum(1, -(-size // block_bytes))
        if (nb > len(sums)).any() or int(nb.sum()) != len(sums):
            raise bad(f"array chunk.checksums holds {len(sums)} block checksums but the chunks need "
                      f"{int(nb.sum()) if not (nb > len(sums)).any() else 'more'}")
        sum_first = np.zeros(N + 1, np.int64)
        np.cumsum(nb, out=sum_first[1:])
        # boxes tile each tensor exactly: distinct boxes (free when each tensor's boxes are in increasing
        # order, as writers store them), then a grid (fast) or the general check
        rising = _increasing(tid, offs)
        if not rising:
            keys = np.lexsort(tuple(offs[:, d] for d in range(D - 1, -1, -1)) + (tid,))
            so, st = offs[keys], tid[keys]
            dup = (st[1:] == st[:-1]) & (so[1:] == so[:-1]).all(axis=1)
            if dup.any():
                raise chunk_bad(np.arange(N) == int(keys[_first(dup) + 1]), "repeats another chunk's box")
        tiled = grid_tiles(tid, offs, lens, shape, presorted=rising) | (numel == 0)
        for t in np.flatnonzero(~tiled).tolist():
            nd, sl = int(ndim[t]), slice(int(first[t]), int(first[t + 1]))
            try:
                check_exact_cover(names[t], tuple(int(x) for x in shape[t, :nd]), offs[sl, :nd], lens[sl, :nd])
            except CheckpointError as ex:
                raise bad(f"the chunks do not tile tensor {names[t]!r} exactly ({ex})") from None
    else:
        if len(sums):
            raise bad(f"array chunk.checksums holds {len(sums)} block checksums for no chunks")
        sum_first = np.zeros(1, np.int64)
    out = ChunkIndex(names, dtype_names, code, ndim, shape, counts, offs, lens, f, b, e, sums)
    out.sum_first = sum_first
    return out


def _increasing(tid: np.ndarray, offs: np.ndarray) -> bool:
    """Whether each tensor's boxes are in strictly increasing lexicographic order of their offsets
    (hence distinct), checked in O(N * D) without sorting."""
    if len(tid) < 2:
        return True
    same = tid[1:] == tid[:-1]
    if not offs.shape[1]:
        return not same.any()
    diff = offs[1:] - offs[:-1]  # offsets are in [0, 2^62]: no overflow
    nz = diff != 0
    lead = diff[np.arange(len(diff)), np.argmax(nz, axis=1)]  # the first differing dimension's step
    return bool((~same | (lead > 0)).all())


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _read_arrays(mv: memoryview, bad) -> dict[str, np.ndarray]:
    """The arrays of a safetensors index file: exactly :data:`ARRAYS`, back to back, nothing else."""
    size = len(mv)
    if size < 8:
        raise bad(f"truncated: {size} bytes, shorter than a safetensors header length")
    (n,) = struct.unpack_from("<Q", mv, 0)
    if n > size - 8:
        raise bad(f"truncated: its header declares {n} bytes but the file has {size - 8} after the length")
    try:
        doc = json.loads(bytes(mv[8:8 + n]).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad(f"its header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise bad("its header is not a JSON object")
    meta = doc.pop("__metadata__", None)
    if meta != {"format": INDEX_FORMAT, "version": INDEX_VERSION}:
        raise bad(f"its __metadata__ is not {{'format': {INDEX_FORMAT!r}, 'version': {INDEX_VERSION!r}}}")
    if set(doc) != set(ARRAYS):
        extra, missing = sorted(set(doc) - set(ARRAYS)), sorted(set(ARRAYS) - set(doc))
        raise bad(f"its arrays are not exactly {sorted(ARRAYS)} (missing {missing[:3]}, unexpected {extra[:3]})")
    data_start, data_len = 8 + n, size - 8 - n
    spans, out = [], {}
    for name, (code, np_dtype, rank) in ARRAYS.items():
        v = doc[name]
        if not isinstance(v, dict) or set(v) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"array {name} must have exactly dtype, shape and data_offsets")
        if v["dtype"] != code:
            raise bad(f"array {name} has dtype {str(v['dtype'])[:20]!r}, expected {code}")
        shp, offs = v["shape"], v["data_offsets"]
        if (type(shp) is not list or len(shp) != rank or any(type(s) is not int or not 0 <= s < 1 << 40 for s in shp)):
            raise bad(f"array {name} must have a shape of {rank} non-negative integer(s)")
        if type(offs) is not list or len(offs) != 2 or any(type(o) is not int for o in offs) \
                or not 0 <= offs[0] <= offs[1] <= data_len:
            raise bad(f"array {name} has data_offsets outside the file's {data_len} data bytes (truncated?)")
        nbytes = 8
        for s in shp:
            nbytes *= s
        if nbytes != offs[1] - offs[0]:
            raise bad(f"array {name}: shape {shp} does not match its {offs[1] - offs[0]} bytes")
        spans.append((offs[0], offs[1]))
        out[name] = np.frombuffer(mv, np_dtype, count=nbytes // 8, offset=data_start + offs[0]).reshape(shp)
    spans.sort()
    pos = 0
    for lo, hi in spans:
        if lo != pos:
            raise bad("its arrays overlap or leave gaps in the data")
        pos = hi
    if pos != data_len:
        raise bad(f"it has {data_len - pos} bytes after its last array (or is truncated)")
    return out


def index_from_plan(plan, rows: np.ndarray, gfile: np.ndarray, gbegin: np.ndarray, gend: np.ndarray,
                    sums: Sequence[str], block_bytes: int) -> ChunkIndex:
    """The index of a save from its global plan (``GlobalPlan``) and the writers' results, vectorised.

    ``rows[u]`` is unique chunk u's row in the concatenated results ``gfile``/``gbegin``/``gend`` (absolute
    file indices) and ``sums`` (one hex string per result row, 16 digits per block of ``block_bytes``).
    """
    specs = plan.tensors
    T = len(specs)
    shapes = [s.shape for s in specs]  # per tensor, never per chunk
    ndim = np.fromiter(map(len, shapes), np.int64, count=T)
    D = int(ndim.max()) if T else 0
    shape = np.ones((T, D), np.int64)
    if T and D:
        flat_dims = np.fromiter(chain.from_iterable(shapes), np.int64, count=int(ndim.sum()))
        tid_dims = np.repeat(np.arange(T), ndim)
        first_dim = np.zeros(T + 1, np.int64)
        np.cumsum(ndim, out=first_dim[1:])
        shape[tid_dims, np.arange(len(flat_dims)) - first_dim[tid_dims]] = flat_dims
    names = [s.fqn for s in specs]
    dts = [s.dtype for s in specs]
    table = sorted(set(dts))
    code_of = {d: i for i, d in enumerate(table)}
    code = np.fromiter(map(code_of.__getitem__, dts), np.int64, count=T)
    counts = np.diff(plan.tensor_ranges()).astype(np.int64)
    tid = plan.u_tidx.astype(np.int64)
    used = np.arange(D)[None, :] < ndim[tid][:, None]
    offs = np.where(used, plan.u_offsets[:, :D], 0).astype(np.int64)
    lens = np.where(used, plan.u_lengths[:, :D], 1).astype(np.int64)
    # block checksums: the hex strings of all result rows as one uint64 array, gathered per unique chunk
    nblk = np.maximum(1, -(-(gend - gbegin) // block_bytes)).astype(np.int64)
    flat = hex_to_uint64(sums)
    start = np.zeros(len(nblk) + 1, np.int64)
    np.cumsum(nblk, out=start[1:])
    if int(start[-1]) != len(flat):
        raise ValueError(f"the writers reported {len(flat)} block checksums for chunks of {int(start[-1])} blocks")
    take = nblk[rows]
    out_start = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(take, out=out_start[1:])
    if len(rows) == len(nblk) and (take == 1).all() and np.array_equal(rows, np.arange(len(rows))):
        sel = flat
    else:
        sel = flat[np.repeat(start[:-1][rows] - out_start[:-1], take) + np.arange(int(out_start[-1]), dtype=np.int64)]
    out = ChunkIndex(names, table, code, ndim, shape, counts, offs, lens, gfile[rows].astype(np.int64),
                     gbegin[rows].astype(np.int64), gend[rows].astype(np.int64), sel)
    out.sum_first = out_start
    return out


__all__ = ["ARRAYS", "INDEX_FORMAT", "ChunkIndex", "HexChecksums", "decode", "from_tables", "hex_to_uint64",
           "index_from_plan", "n_blocks"]
