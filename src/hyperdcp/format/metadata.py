"""The global metadata file (``hyperdcp.json``): the commit record and the map of every stored chunk.

A checkpoint is complete iff this file is present and valid. It is strict JSON (specified in
docs/FORMAT.md) whose last member is ``"metadata_checksum"``: the xxh3-64 of the file's bytes with
that checksum's 16 hex digits replaced by zeros. Reading validates everything before anything is used:
version, names, dtypes, shapes, chunk boxes (in bounds, tiling each tensor exactly), file names (plain
names inside the checkpoint directory), byte ranges (inside their file, sized to their box, not
overlapping) and checksum strings.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import numpy as np
import xxhash

from .._version import __version__
from ..core import dtypes
from ..core.boxes import Box
from ..errors import CheckpointError, FormatError, MismatchError
from ..options import DEFAULT_BLOCK_BYTES
from . import values as values_codec
from .checksums import n_blocks  # noqa: F401 - re-exported (its former home)
from .chunk_index import ChunkIndex, HexChecksums, from_tables

FORMAT_NAME = "hyperdcp"
#: the newest format version this hyperdcp reads (it writes 1, or 2 with a chunk index: docs/FORMAT.md)
FORMAT_VERSION = 2
METADATA_FILE = "hyperdcp.json"
CHECKSUM_ALGORITHM = "xxh3-64"
_TRAILER_RE = re.compile(rb',"metadata_checksum":"([0-9a-f]{16})"\}\n?$')
_ZERO = b"0" * 16
FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")
MAX_DIMS = 64
MAX_NUMEL = 1 << 62
#: most bytes one tensor may declare (elements x item size); keeps every byte count inside int64
MAX_TENSOR_BYTES = 1 << 62
#: default cap on the size of a commit record or rank metadata file (override: HYPERDCP_MAX_METADATA_BYTES)
DEFAULT_MAX_METADATA_BYTES = 2 << 30


def max_metadata_bytes() -> int:
    """The largest metadata file readers accept (2 GiB unless ``HYPERDCP_MAX_METADATA_BYTES`` says otherwise)."""
    try:
        return max(1, int(os.environ.get("HYPERDCP_MAX_METADATA_BYTES", DEFAULT_MAX_METADATA_BYTES)))
    except ValueError:
        return DEFAULT_MAX_METADATA_BYTES


@dataclass
class ChunkTable:
    """The stored chunks of one tensor, column by column (row i is chunk i)."""

    offsets: np.ndarray  # (n, ndim) int64
    lengths: np.ndarray  # (n, ndim) int64
    file: np.ndarray  # (n,) int64: index into Metadata.files
    begin: np.ndarray  # (n,) int64: absolute byte offset of the chunk in its file
    end: np.ndarray  # (n,) int64
    checksums: list[str]  # per chunk: 16 hex digits per checksum block (format 2: a HexChecksums view)

    def __len__(self) -> int:
        return len(self.begin)

    def box(self, i: int) -> Box:
        return Box(tuple(int(x) for x in self.offsets[i]), tuple(int(x) for x in self.lengths[i]))


@dataclass
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    chunks: ChunkTable

    @property
    def nbytes(self) -> int:
        n = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        return n * dtypes.itemsize(self.dtype)


@dataclass
class FileMeta:
    name: str
    nbytes: int


@dataclass
class Metadata:
    """Everything a reader needs; see docs/FORMAT.md."""

    world_size: int
    files: list[FileMeta]
    tensors: dict[str, TensorMeta]
    values: dict[str, Any]
    checksum_block_bytes: int = DEFAULT_BLOCK_BYTES
    format_version: int = 1
    library_version: str = __version__
    created_unix: float = field(default_factory=time.time)
    user: dict[str, Any] = field(default_factory=dict)
    #: plain values stored per rank (they differed between ranks, or only some ranks held them):
    #: fqn -> {saving rank: value}
    per_rank_values: dict[str, dict[int, Any]] = field(default_factory=dict)
    #: tensors stored per rank (every holder held it whole, with different contents): fqn -> the saving
    #: ranks; the stored tensor has one leading dimension more, row i holding rank ``ranks[i]``'s copy
    per_rank_tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: the array view of every chunk (format 2 reads and vectorised saves set it; see :meth:`chunk_index`)
    index: ChunkIndex | None = field(default=None, repr=False, compare=False)

    def chunk_index(self) -> ChunkIndex:
        """Every tensor and chunk as arrays (:class:`~hyperdcp.format.chunk_index.ChunkIndex`), built once."""
        if self.index is None:
            names = list(self.tensors)
            ts = [self.tensors[n] for n in names]
            self.index = from_tables(names, [t.dtype for t in ts], [t.shape for t in ts], [t.chunks for t in ts])
        return self.index

    # -- summaries -------------------------------------------------------------------------
    @property
    def tensor_bytes(self) -> int:
        """Unique tensor bytes (each element once)."""
        if self.index is not None:
            ix = self.index
            isz = np.array([dtypes.itemsize(d) for d in ix.dtype_names], np.int64)
            return int((ix.shape.prod(axis=1) * isz[ix.dtype]).sum()) if ix.num_tensors else 0
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def data_file_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def num_chunks(self) -> int:
        if self.index is not None:
            return self.index.num_chunks
        return sum(len(t.chunks) for t in self.tensors.values())

    def keys(self) -> list[str]:
        return sorted(set(self.tensors) | set(self.values) | set(self.per_rank_values))

    def renamed(self, key_map: Callable[[str], str | None]) -> "Metadata":
        """A copy with every tensor and value key renamed through ``key_map`` (None drops the key).

        MismatchError when ``key_map`` returns something other than a non-empty str or None, or maps two
        keys to one name. (Entries stored per rank keep their names, as ``hyperdcp.hf.rename_keys`` did.)
        """
        seen: set[str] = set()

        def rename(d: dict) -> dict:
            out: dict = {}
            for old, v in d.items():
                new = key_map(old)
                if new is None:
                    continue
                if type(new) is not str or not new:
                    raise MismatchError(f"key_map returned {new!r} for {old!r}; it must return a non-empty str or None")
                if new in out or new in seen:
                    raise MismatchError(f"key_map maps two checkpoint keys to {new!r} (one of them {old!r}); make it "
                                        "one-to-one")
                out[new] = v
                seen.add(new)
            return out

        return replace(self, tensors=rename(self.tensors), values=rename(self.values), index=None)

    # -- encoding --------------------------------------------------------------------------
    def to_json(self) -> bytes:
        tensors = {}
        for name, t in self.tensors.items():
            c = t.chunks
            tensors[name] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "chunks": {
                    "offsets": c.offsets.tolist(),
                    "lengths": c.lengths.tolist(),
                    "file": c.file.tolist(),
                    "begin": c.begin.tolist(),
                    "end": c.end.tolist(),
                    "checksums": list(c.checksums),
                },
            }
        doc = {
            "format": FORMAT_NAME,
            "format_version": 1,  # the all-JSON form (format 2: encode())
            "library_version": self.library_version,
            "created_unix": self.created_unix,
            "world_size": self.world_size,
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "block_bytes": self.checksum_block_bytes},
            "files": [{"name": f.name, "bytes": f.nbytes} for f in self.files],
            "tensors": tensors,
            "values": {k: values_codec.encode(v, k) for k, v in self.values.items()},
            "user": self.user,
        }
        if self.per_rank_values or self.per_rank_tensors:
            doc["per_rank"] = _per_rank_doc(self)
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
        body = body[:-1] + b',"metadata_checksum":"' + _ZERO + b'"}\n'
        digest = b"%016x" % xxhash.xxh3_64_intdigest(body)
        return body[: -len(_ZERO) - 3] + digest + b'"}\n'

    def encode(self, index_name: str | None = None) -> tuple[bytes, bytes | None]:
        """The commit record, and the chunk index file to write before it (None: a format-1 record).

        With ``index_name`` and at least :func:`~hyperdcp.format.record_v2.index_min_chunks` chunks, the
        record is format 2 and names ``index_name`` (docs/FORMAT.md); else it is :meth:`to_json`.
        """
        from .record_v2 import encode_v2, index_min_chunks

        if index_name is None or self.num_chunks < index_min_chunks():
            return self.to_json(), None
        self.format_version = 2  # what is committed
        return encode_v2(self, index_name)

    @classmethod
    def from_json(cls, raw: bytes, where: str = METADATA_FILE, index: bytes | Callable[[str, int], bytes] | None = None
                  ) -> "Metadata":
        """Parse and strictly validate; raise a FormatError subclass naming ``where`` on any problem.

        ``index``: a format-2 record's chunk index, as bytes or as ``read(name, nbytes) -> bytes`` (the
        caller's storage); a format-2 record without it is refused (FormatError saying so).
        """
        from .validate import parse  # the strict parser (fast path + naming path) lives beside this module

        try:
            return parse(raw, where, index)
        except CheckpointError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError, MemoryError) as e:
            raise FormatError(f"{where}: invalid metadata ({type(e).__name__}: {e}); the file is damaged") from None


class IndexedTensors(Mapping):
    """``Metadata.tensors`` of a format-2 read or a vectorised save: TensorMeta objects made on access.

    A read-only mapping over a :class:`ChunkIndex` (no per-tensor objects until a tensor is looked up).
    """

    def __init__(self, index: ChunkIndex, block_bytes: int, positions: dict[str, int] | None = None):
        self._ix, self._block = index, block_bytes
        self._pos = positions  # name -> tensor row, built on first lookup
        self._made: dict[int, TensorMeta] = {}

    def _positions(self) -> dict[str, int]:
        if self._pos is None:
            self._pos = dict(zip(self._ix.names, range(len(self._ix.names))))
        return self._pos

    def __getitem__(self, name: str) -> TensorMeta:
        t = self._positions()[name]
        tm = self._made.get(t)
        if tm is None:
            ix = self._ix
            a, b, nd = int(ix.first[t]), int(ix.first[t + 1]), int(ix.ndim[t])
            starts = ix.block_starts(self._block)[a:b + 1]
            chunks = ChunkTable(ix.offsets[a:b, :nd], ix.lengths[a:b, :nd], ix.file[a:b], ix.begin[a:b], ix.end[a:b],
                                HexChecksums(ix.checksums, starts))  # type: ignore[arg-type]
            tm = self._made[t] = TensorMeta(ix.dtype_names[int(ix.dtype[t])], tuple(int(x) for x in ix.shape[t, :nd]),
                                            chunks)
        return tm

    def __contains__(self, name: object) -> bool:
        return name in self._positions()

    def __iter__(self) -> Iterator[str]:
        return iter(self._ix.names)

    def __len__(self) -> int:
        return len(self._ix.names)

    def __repr__(self) -> str:
        return f"IndexedTensors({len(self)} tensors, {self._ix.num_chunks} chunks)"


def sign_json(doc: dict) -> bytes:
    """Strict JSON of ``doc`` followed by its self-checksum trailer (as in ``hyperdcp.json``)."""
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
    body = body[:-1] + b',"metadata_checksum":"' + _ZERO + b'"}\n'
    digest = b"%016x" % xxhash.xxh3_64_intdigest(body)
    return body[: -len(_ZERO) - 3] + digest + b'"}\n'


def load_signed_json(raw: bytes, where: str) -> Any:
    """The document of a self-checksummed JSON file; FormatError naming ``where`` if it is damaged.

    Never echoes the file's contents: the error says what is wrong, not what is there.
    """
    m = _TRAILER_RE.search(raw)
    if m is None:
        raise FormatError(f"{where}: missing or malformed metadata_checksum trailer (truncated, edited or written by "
                          "an older hyperdcp); the file is damaged")
    zeroed = raw[: m.start(1)] + _ZERO + raw[m.end(1):]
    if b"%016x" % xxhash.xxh3_64_intdigest(zeroed) != m.group(1):
        raise FormatError(f"{where}: metadata_checksum does not match the file's contents (corrupted or edited file)")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError, MemoryError) as e:
        raise FormatError(f"{where}: not valid strict JSON ({type(e).__name__}); the file is damaged") from None


def _refuse_constant(c: str):
    raise ValueError(f"non-standard JSON constant {c}")


def _per_rank_doc(meta: Metadata) -> dict:
    """The ``per_rank`` member (see docs/FORMAT.md, "Per-rank entries")."""
    return {
        "values": {k: [[r, values_codec.encode(v, k)] for r, v in sorted(by_rank.items())]
                   for k, by_rank in meta.per_rank_values.items()},
        "tensors": {k: [int(r) for r in ranks] for k, ranks in meta.per_rank_tensors.items()},
    }
