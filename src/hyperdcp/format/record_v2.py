"""Format version 2: a JSON commit record (``hyperdcp.json``) that names a binary chunk index file.

The record keeps what is small or textual (files, tensor names, dtypes, values, user metadata) and the
index (:mod:`.chunk_index`) holds every shape and chunk as little-endian integer arrays. The record names
the index in its ``files`` list (last entry, so that any storage that keeps "the files the record lists"
keeps it) and in its ``index`` member with its size and xxh3-64. Writers write the index first, the
record last (the commit point is unchanged). See docs/FORMAT.md, "Format version 2".
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

import numpy as np
import xxhash

from ..core import dtypes
from . import values as values_codec
from .chunk_index import ChunkIndex, decode
from .metadata import (
    CHECKSUM_ALGORITHM,
    FILE_NAME_RE,
    FORMAT_NAME,
    METADATA_FILE,
    FileMeta,
    IndexedTensors,
    Metadata,
    _per_rank_doc,
    max_metadata_bytes,
    sign_json,
)

#: records of at least this many chunks are written as format 2 (override: HYPERDCP_INDEX_MIN_CHUNKS; 0: always)
DEFAULT_INDEX_MIN_CHUNKS = 1024
INDEX_RE = re.compile(r"^hyperdcp-index-[0-9a-z]{1,64}\.safetensors$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def index_min_chunks() -> int:
    """The chunk count from which saves write format 2 (``HYPERDCP_INDEX_MIN_CHUNKS``, default 1024)."""
    try:
        return max(0, int(os.environ.get("HYPERDCP_INDEX_MIN_CHUNKS", DEFAULT_INDEX_MIN_CHUNKS)))
    except ValueError:
        return DEFAULT_INDEX_MIN_CHUNKS


def index_file_name(token: str) -> str:
    """``hyperdcp-index-<token>.safetensors``: per save, like data file names (``token``: letters, digits)."""
    return f"hyperdcp-index-{token.lower()}.safetensors"


def is_index_file(name: str) -> bool:
    return bool(INDEX_RE.fullmatch(name))


def encode_v2(meta: Metadata, index_name: str) -> tuple[bytes, bytes]:
    """The format-2 record of ``meta`` and its index file's bytes (write the index first)."""
    if not is_index_file(index_name):
        raise ValueError(f"{index_name!r} is not a chunk index file name (hyperdcp-index-<token>.safetensors)")
    ix = meta.chunk_index()
    blob = ix.encode()
    doc: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": 2,
        "library_version": meta.library_version,
        "created_unix": meta.created_unix,
        "world_size": meta.world_size,
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, "block_bytes": meta.checksum_block_bytes},
        "files": [{"name": f.name, "bytes": f.nbytes} for f in meta.files] + [{"name": index_name, "bytes": len(blob)}],
        "index": {"name": index_name, "bytes": len(blob), "xxh3_64": "%016x" % xxhash.xxh3_64_intdigest(blob),
                  "tensors": list(ix.names), "dtypes": list(ix.dtype_names)},
        "values": {k: values_codec.encode(v, k) for k, v in meta.values.items()},
        "user": meta.user,
    }
    if meta.per_rank_values or meta.per_rank_tensors:
        doc["per_rank"] = _per_rank_doc(meta)
    return sign_json(doc), blob


def parse_index(doc: dict, files: list[FileMeta], block: int, where: str,
                index: bytes | Callable[[str, int], bytes] | None, bad) -> tuple[list[FileMeta], IndexedTensors,
                                                                                 ChunkIndex]:
    """The data files and tensors of a format-2 record ``doc`` (its ``files`` already parsed as ``files``).

    ``index`` is the index file's bytes or ``read(name, nbytes)``; its size and checksum are checked
    against the record before it is decoded.
    """
    spec = doc.get("index")
    if not isinstance(spec, dict) or set(spec) != {"name", "bytes", "xxh3_64", "tensors", "dtypes"}:
        raise bad("a format-2 record needs an 'index' object with exactly name, bytes, xxh3_64, tensors and dtypes")
    name, nbytes, digest = spec["name"], spec["bytes"], spec["xxh3_64"]
    if type(name) is not str or not is_index_file(name) or not FILE_NAME_RE.fullmatch(name):
        raise bad("index.name is not a chunk index file name (hyperdcp-index-<token>.safetensors)")
    if type(nbytes) is not int or not 0 <= nbytes <= 1 << 40:
        raise bad("index.bytes must be an integer in [0, 2^40]")
    if nbytes > max_metadata_bytes():
        raise bad(f"its chunk index declares {nbytes} bytes, more than the {max_metadata_bytes()}-byte limit "
                  "(raise HYPERDCP_MAX_METADATA_BYTES if the checkpoint is genuine)")
    if type(digest) is not str or not _HEX16.fullmatch(digest):
        raise bad("index.xxh3_64 must be 16 lowercase hex digits")
    if not files or files[-1].name != name or files[-1].nbytes != nbytes:
        raise bad(f"the last entry of files must be the chunk index {name!r} with its {nbytes} bytes")
    names, codes = spec["tensors"], spec["dtypes"]
    pos = dict(zip(names, range(len(names)))) if type(names) is list and set(map(type, names)) <= {str} else None
    if pos is None or len(pos) != len(names) or "" in pos:
        raise bad("index.tensors must list distinct non-empty tensor names")
    if type(codes) is not list or not all(type(c) is str and c in dtypes.ITEMSIZE for c in codes) \
            or len(set(codes)) != len(codes):
        raise bad("index.dtypes must list distinct known dtypes")
    ipath = f"{os.path.dirname(where) or '.'}/{name}" if where.endswith(METADATA_FILE) else f"{where}: {name}"
    if index is None:
        raise bad(f"it is a format-2 record and its chunk index {name} was not read with it (read checkpoints with "
                  "hyperdcp.read_metadata or open_source)")
    try:
        raw = index(name, nbytes) if callable(index) else index
    except FileNotFoundError:  # CheckpointNotFoundError too: the record is there, so the checkpoint is damaged
        raise bad(f"its chunk index {ipath} is missing") from None
    if len(raw) != nbytes:
        raise bad(f"its chunk index {ipath} has {len(raw)} bytes but the record says {nbytes} (truncated or replaced)")
    if "%016x" % xxhash.xxh3_64_intdigest(raw) != digest:
        raise bad(f"its chunk index {ipath} does not match the checksum the record gives it (corrupted or replaced)")
    data = files[:-1]
    sizes = np.array([f.nbytes for f in data], np.int64)
    ix = decode(raw, ipath, names, codes, sizes, block)
    return data, IndexedTensors(ix, block, pos), ix
