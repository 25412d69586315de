"""The strict parser behind :meth:`hyperdcp.format.metadata.Metadata.from_json`.

Everything is validated before anything is used: the checksum trailer, version, names, dtypes, shapes,
chunk boxes (in bounds, tiling each tensor exactly), file names (plain names inside the checkpoint
directory), byte ranges (inside their file, sized to their box, not overlapping) and checksum strings.
A vectorised fast path checks well-formed tables; anything it rejects goes through the per-tensor path,
which finds and names the problem.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import xxhash

from ..core import dtypes
from ..core.boxes import check_exact_cover, grid_tiles
from ..errors import CheckpointError, FormatError, UnsupportedVersionError
from . import values as values_codec
from .checksums import n_blocks
from .chunk_index import _increasing
from .metadata import (
    _TRAILER_RE,
    _ZERO,
    CHECKSUM_ALGORITHM,
    FILE_NAME_RE,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_DIMS,
    MAX_NUMEL,
    MAX_TENSOR_BYTES,
    METADATA_FILE,
    ChunkTable,
    FileMeta,
    Metadata,
    TensorMeta,
)
from .record_v2 import parse_index


def parse(raw: bytes, where: str, index=None) -> Metadata:
    """Parse and strictly validate a commit record (:meth:`Metadata.from_json` wraps it).

    ``index``: a format-2 record's chunk index (bytes, or ``read(name, nbytes)``); see :mod:`.record_v2`.
    """
    def bad(why: str) -> FormatError:
        return FormatError(f"{where}: {why}; the metadata is damaged or was not written by hyperdcp")

    m = _TRAILER_RE.search(raw)
    if m is None:
        raise bad("missing or malformed metadata_checksum trailer (truncated file?)")
    zeroed = raw[: m.start(1)] + _ZERO + raw[m.end(1):]
    if b"%016x" % xxhash.xxh3_64_intdigest(zeroed) != m.group(1):
        raise bad("metadata_checksum does not match the file's contents (corrupted file)")
    doc = json.loads(raw.decode("utf-8"), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise bad(f"not a {FORMAT_NAME} metadata document")
    version = doc.get("format_version")
    if type(version) is not int or version < 1:
        raise bad(f"bad format_version {version!r}")
    if version > FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"{where}: checkpoint format version {version} is newer than this hyperdcp reads "
            f"(up to {FORMAT_VERSION}); upgrade hyperdcp to load it"
        )
    world = _int(doc.get("world_size"), "world_size", bad, lo=1, hi=1 << 31)
    ck = doc.get("checksum")
    if not isinstance(ck, dict) or ck.get("algorithm") != CHECKSUM_ALGORITHM:
        raise bad(f"checksum algorithm must be {CHECKSUM_ALGORITHM!r}")
    block = _int(ck.get("block_bytes"), "checksum.block_bytes", bad, lo=1, hi=1 << 40)

    files_doc = doc.get("files")
    if not isinstance(files_doc, list):
        raise bad("files must be a list")
    files, seen = [], set()
    for f in files_doc:
        if not isinstance(f, dict) or type(f.get("name")) is not str:
            raise bad("each file needs a name")
        name = f["name"]
        if not FILE_NAME_RE.fullmatch(name) or name == METADATA_FILE or name in seen:
            raise bad(f"file name {name!r} is not a plain, unique file name inside the checkpoint directory")
        seen.add(name)
        files.append(FileMeta(name, _int(f.get("bytes"), f"size of {name}", bad, lo=0, hi=1 << 60)))

    chunk_index = None
    if version == 2:  # the chunk table is in the index file (validated there, vectorised)
        if "tensors" in doc:
            raise bad("a format-2 record keeps its tensors in its chunk index, not in a 'tensors' member")
        files, tensors, chunk_index = parse_index(doc, files, block, where, index, bad)
        tms = []
    else:
        if "index" in doc:
            raise bad("a format-1 record has no 'index' member")
        tensors_doc = doc.get("tensors")
        if not isinstance(tensors_doc, dict):
            raise bad("tensors must be an object")
        tensors = _parse_tensors_fast(tensors_doc, len(files), block)
        if tensors is None:  # something is off: the per-tensor path finds and names it
            tensors = {name: _parse_tensor(name, t, len(files), block, bad) for name, t in tensors_doc.items()}
        tms = [tm for tm in tensors.values() if len(tm.chunks)]
    if tms:
        r = np.stack([np.concatenate([getattr(tm.chunks, k) for tm in tms]) for k in ("file", "begin", "end")], axis=1)
        sizes = np.array([f.nbytes for f in files], dtype=np.int64)
        if (r[:, 2] > sizes[r[:, 0]]).any():
            i = int(np.argmax(r[:, 2] > sizes[r[:, 0]]))
            raise bad(f"a chunk ends at byte {r[i, 2]} past the end of {files[r[i, 0]].name} ({sizes[r[i, 0]]} bytes)")
        r = r[np.lexsort((r[:, 1], r[:, 0]))]
        same = r[1:, 0] == r[:-1, 0]
        if (same & (r[1:, 1] < r[:-1, 2])).any():
            raise bad("two chunks overlap in the same data file")

    values_doc = doc.get("values")
    if not isinstance(values_doc, dict):
        raise bad("values must be an object")
    vals = {k: values_codec.decode(v, f"{where}: value {k!r}") for k, v in values_doc.items()}
    clash = [k for k in vals if k in tensors]
    if clash:
        raise bad(f"key {sorted(clash)[0]!r} is both a tensor and a value")
    user = doc.get("user", {})
    if not isinstance(user, dict):
        raise bad("user must be an object")
    lib = doc.get("library_version")
    created = doc.get("created_unix")
    pr_values, pr_tensors = _parse_per_rank(doc.get("per_rank"), tensors, vals, world, where, bad)
    return Metadata(
        world_size=world,
        files=files,
        tensors=tensors,
        values=vals,
        checksum_block_bytes=block,
        format_version=version,
        library_version=lib if isinstance(lib, str) else "?",
        created_unix=float(created) if type(created) in (int, float) else 0.0,
        user=user,
        per_rank_values=pr_values,
        per_rank_tensors=pr_tensors,
        index=chunk_index,
    )


def _parse_per_rank(doc: Any, tensors: dict[str, TensorMeta], vals: dict[str, Any], world: int, where: str,
                    bad) -> tuple[dict[str, dict[int, Any]], dict[str, tuple[int, ...]]]:
    """Validate the optional ``per_rank`` member: its values and the saving ranks of its tensors."""
    if doc is None:
        return {}, {}
    if (not isinstance(doc, dict) or not isinstance(doc.get("values", {}), dict)
            or not isinstance(doc.get("tensors", {}), dict)):
        raise bad("per_rank must be an object with 'values' and 'tensors' objects")

    def ranks_ok(rs: Any) -> bool:
        return (isinstance(rs, list) and len(rs) > 0 and all(type(r) is int and 0 <= r < world for r in rs)
                and all(a < b for a, b in zip(rs, rs[1:])))

    pr_tensors: dict[str, tuple[int, ...]] = {}
    for k, rs in doc.get("tensors", {}).items():
        t = tensors.get(k)
        if t is None:
            raise bad(f"per_rank tensor {k!r} is not among the tensors")
        if not ranks_ok(rs) or not t.shape or t.shape[0] != len(rs):
            raise bad(f"per_rank tensor {k!r}: its ranks must be distinct increasing ranks below world_size {world}, "
                      f"one per row of its leading dimension (shape {list(t.shape)})")
        pr_tensors[k] = tuple(rs)
    pr_values: dict[str, dict[int, Any]] = {}
    for k, items in doc.get("values", {}).items():
        if k in vals or k in tensors:
            raise bad(f"key {k!r} is both a per-rank value and a tensor or shared value")
        if not isinstance(items, list) or not all(isinstance(it, list) and len(it) == 2 for it in items):
            raise bad(f"per_rank value {k!r} must be a list of [rank, value] pairs")
        if not ranks_ok([it[0] for it in items]):
            raise bad(f"per_rank value {k!r}: ranks must be distinct increasing ranks below world_size {world}")
        pr_values[k] = {it[0]: values_codec.decode(it[1], f"{where}: value {k!r} of rank {it[0]}") for it in items}
    return pr_values, pr_tensors


def _parse_tensors_fast(doc: dict, nfiles: int, block: int) -> dict[str, TensorMeta] | None:
    """Validate every tensor entry at once, vectorised over all chunks; None if anything fails.

    Checks exactly what :func:`_parse_tensor` checks (which then runs to name the problem), but costs
    a few numpy passes instead of a few dozen numpy calls per tensor (100,000-tensor checkpoints).
    """
    names, codes, shapes, counts = [], [], [], []
    files, begins, ends, sums = [], [], [], []
    rows: dict[int, tuple[list, list]] = {}
    for name, t in doc.items():
        if type(name) is not str or not name or type(t) is not dict:
            return None
        code, shape, c = t.get("dtype"), t.get("shape"), t.get("chunks")
        if code not in dtypes.ITEMSIZE or type(shape) is not list or len(shape) > MAX_DIMS or type(c) is not dict:
            return None
        cols = [c.get(k) for k in ("offsets", "lengths", "file", "begin", "end", "checksums")]
        if any(type(x) is not list for x in cols):
            return None
        n = len(cols[2])
        if any(len(x) != n for x in cols):
            return None
        nd = len(shape)
        off_rows, len_rows = rows.setdefault(nd, ([], []))
        off_rows.extend(cols[0])
        len_rows.extend(cols[1])
        files.extend(cols[2])
        begins.extend(cols[3])
        ends.extend(cols[4])
        sums.extend(cols[5])
        names.append(name)
        codes.append(code)
        shapes.append(shape)
        counts.append(n)
    T = len(names)
    if T == 0:
        return {}
    try:
        ndims = np.array([len(sh) for sh in shapes], dtype=np.int64)
        D = int(ndims.max())
        shp = np.ones((T, D), dtype=np.int64)
        for nd in rows:
            sel = np.flatnonzero(ndims == nd)
            if nd:
                block_ = np.array([shapes[i] for i in sel])
                if block_.dtype.kind not in "iu":
                    return None
                shp[sel, :nd] = block_
        if (shp < 0).any():
            return None
        if not all(type(x) is int for sh in shapes for x in sh):
            return None
        numel = np.prod(shp.astype(object), axis=1) if D else np.ones(T, dtype=object)
        if any(v > MAX_NUMEL or v * dtypes.itemsize(cd) > MAX_TENSOR_BYTES for v, cd in zip(numel, codes)):
            return None
        numel = numel.astype(np.int64)
        counts_a = np.array(counts, dtype=np.int64)
        N = int(counts_a.sum())
        tid = np.repeat(np.arange(T), counts_a)
        first = np.cumsum(counts_a) - counts_a
        offs = np.zeros((N, D), dtype=np.int64)
        lens = np.ones((N, D), dtype=np.int64)
        for nd, (orows, lrows) in rows.items():
            sel = np.flatnonzero(ndims == nd)
            m = len(orows)
            if m == 0:
                continue
            pos = np.repeat(first[sel] - np.concatenate([[0], np.cumsum(counts_a[sel])[:-1]]),
                            counts_a[sel]) + np.arange(m)
            if nd:
                o, ln = np.array(orows), np.array(lrows)
                if o.shape != (m, nd) or ln.shape != (m, nd) or o.dtype.kind not in "iu" or ln.dtype.kind not in "iu":
                    return None
                offs[pos, :nd] = o
                lens[pos, :nd] = ln
            elif any(x != [] for x in orows) or any(x != [] for x in lrows):
                return None
        f, b, e = (np.array(x) if x else np.zeros(0, np.int64) for x in (files, begins, ends))
        if any(a.dtype.kind not in "iu" or a.shape != (N,) for a in (f, b, e)):
            return None
        f, b, e = f.astype(np.int64), b.astype(np.int64), e.astype(np.int64)
    except (ValueError, TypeError, OverflowError):
        return None
    isz = np.array([dtypes.itemsize(cd) for cd in codes], dtype=np.int64)
    if N:
        # no sum or product before every length is known to fit its dimension: nothing can overflow
        # (each box lies inside a tensor of at most MAX_TENSOR_BYTES bytes)
        if (lens <= 0).any() or (offs < 0).any() or (lens > shp[tid]).any() or (offs > shp[tid] - lens).any():
            return None
        if ((f < 0) | (f >= nfiles) | (b < 0) | (e < b)).any():
            return None
        size = lens.prod(axis=1) * isz[tid]
        if not np.array_equal(e - b, size):
            return None
        if not all(type(x) is str for x in sums):
            return None
        want = 16 * np.maximum(1, -(-size // block))
        if not np.array_equal(np.fromiter(map(len, sums), dtype=np.int64, count=N), want):
            return None
        if not _HEX.fullmatch("".join(sums)):
            return None
    if ((numel == 0) & (counts_a > 0)).any() or ((numel > 0) & (counts_a == 0)).any():
        return None
    # an exact tiling needs distinct boxes (grid_tiles assumes them: a repeated box can stand in for a
    # missing grid cell), then test it (grid fast, else general)
    if N and not _increasing(tid, offs):  # boxes in increasing order (as written) are distinct
        keys = np.lexsort(tuple(offs[:, d] for d in range(D - 1, -1, -1)) + (tid,))
        so, st = offs[keys], tid[keys]
        if ((st[1:] == st[:-1]) & (so[1:] == so[:-1]).all(axis=1)).any():
            return None
    tiled = grid_tiles(tid, offs, lens, shp) | (numel == 0)
    for t in np.flatnonzero(~tiled):
        sl = slice(first[t], first[t] + counts_a[t])
        nd = len(shapes[t])
        try:
            check_exact_cover(names[t], tuple(shapes[t]), offs[sl, :nd], lens[sl, :nd])
        except CheckpointError:
            return None
    out = {}
    for t, name in enumerate(names):
        sl = slice(first[t], first[t] + counts_a[t])
        nd = len(shapes[t])
        out[name] = TensorMeta(codes[t], tuple(shapes[t]),
                               ChunkTable(offs[sl, :nd], lens[sl, :nd], f[sl], b[sl], e[sl], sums[sl]))
    return out


def _int(v, what, bad, lo, hi) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise bad(f"{what} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _int_array(v, what, bad, shape) -> np.ndarray:
    if not isinstance(v, list):
        raise bad(f"{what} must be a list")
    try:
        a = np.array(v) if v else np.zeros(shape, dtype=np.int64)
    except (ValueError, TypeError, OverflowError):
        raise bad(f"{what} must hold integers") from None
    if a.size == 0 and a.shape == shape:
        return np.zeros(shape, dtype=np.int64)
    if a.dtype.kind not in "iu" or a.shape != shape:
        raise bad(f"{what} must hold integers in shape {shape}")
    return a.astype(np.int64, copy=False)


def _parse_tensor(name: str, t: Any, nfiles: int, block: int, bad) -> TensorMeta:
    if not isinstance(name, str) or not name:
        raise bad("tensor names must be non-empty strings")
    if not isinstance(t, dict):
        raise bad(f"tensor {name!r} must be an object")
    code = t.get("dtype")
    if code not in dtypes.ITEMSIZE:
        raise bad(f"tensor {name!r} has unknown dtype {code!r}")
    shape_doc = t.get("shape")
    if (not isinstance(shape_doc, list) or len(shape_doc) > MAX_DIMS
            or any(type(s) is not int or s < 0 for s in shape_doc)):
        raise bad(f"tensor {name!r} has an invalid shape {shape_doc!r}")
    shape = tuple(shape_doc)
    numel = 1
    for s in shape:
        numel *= s
    if numel > MAX_NUMEL or numel * dtypes.itemsize(code) > MAX_TENSOR_BYTES:
        raise bad(f"tensor {name!r} declares an absurd size {list(shape)} ({code})")
    c = t.get("chunks")
    if not isinstance(c, dict):
        raise bad(f"tensor {name!r} has no chunk table")
    files = c.get("file")
    n = len(files) if isinstance(files, list) else -1
    if n < 0:
        raise bad(f"tensor {name!r}: chunks.file must be a list")
    nd = len(shape)
    offsets = _int_array(c.get("offsets"), f"tensor {name!r} chunks.offsets", bad, (n, nd))
    lengths = _int_array(c.get("lengths"), f"tensor {name!r} chunks.lengths", bad, (n, nd))
    file = _int_array(files, f"tensor {name!r} chunks.file", bad, (n,))
    begin = _int_array(c.get("begin"), f"tensor {name!r} chunks.begin", bad, (n,))
    end = _int_array(c.get("end"), f"tensor {name!r} chunks.end", bad, (n,))
    sums = c.get("checksums")
    if not isinstance(sums, list) or len(sums) != n:
        raise bad(f"tensor {name!r}: chunks.checksums must list one string per chunk")
    if n and ((file < 0) | (file >= nfiles)).any():
        raise bad(f"tensor {name!r}: a chunk names a file index outside the file list")
    if n and ((lengths <= 0).any() if nd else False):
        raise bad(f"tensor {name!r}: chunks must not be empty")
    if n and nd:
        dims = np.array(shape, dtype=np.int64)
        outside = (offsets < 0) | (lengths > dims) | (offsets > dims - lengths)  # overflow-free
        if outside.any():
            i = int(np.argmax(outside.any(axis=1)))
            raise bad(f"tensor {name!r}: chunk {i} (offsets {offsets[i].tolist()}, lengths {lengths[i].tolist()}) "
                      f"lies outside its shape {list(shape)}")
    if n and ((begin < 0) | (end < begin)).any():
        raise bad(f"tensor {name!r}: a chunk has a negative byte range")
    size = dtypes.itemsize(code) * (lengths.prod(axis=1) if nd else np.ones(n, dtype=np.int64))
    if n and not np.array_equal(end - begin, size):
        raise bad(f"tensor {name!r}: a chunk's byte range does not match its box size")
    for i, s in enumerate(sums):
        want = 16 * n_blocks(int(end[i] - begin[i]), block)
        if type(s) is not str or len(s) != want or not _HEX.fullmatch(s):
            raise bad(f"tensor {name!r}: chunk {i} checksum string is malformed")
    if numel == 0:
        if n:
            raise bad(f"tensor {name!r} is empty but lists chunks")
    else:
        if n == 0:
            raise bad(f"tensor {name!r} lists no chunks")
        try:
            check_exact_cover(name, shape, offsets, lengths)
        except CheckpointError as e:
            raise bad(f"chunks do not tile tensor {name!r} exactly ({e})") from None
    return TensorMeta(code, shape, ChunkTable(offsets, lengths, file, begin, end, sums))


_HEX = re.compile(r"[0-9a-f]*")
