"""Data files as pure codecs: each one a valid safetensors file holding some chunks of some tensors.

No I/O here: the save flow writes what :func:`build_header` returns (``hyperdcp.saving.write``), and
readers pass :func:`read_header` a ``pread`` of their storage.

Layout (the safetensors format): 8-byte little-endian header length N, N bytes of JSON header padded
with spaces to a multiple of 8, then the chunks' bytes back to back. The header names each chunk
``"<fqn>"`` when it is the whole tensor, else ``"<fqn>@<o0>,<o1>,..."`` (its global offsets), with its
dtype, its own shape and its ``data_offsets``. ``__metadata__`` carries ``{"format": "hyperdcp"}``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import xxhash

from ..core import dtypes
from ..errors import CorruptionError, FormatError

#: largest header we accept when reading foreign safetensors files (the safetensors library uses 100 MB)
MAX_HEADER_BYTES = 100_000_000


@dataclass
class ChunkToWrite:
    name: str  # header name
    dtype: str
    shape: tuple[int, ...]  # the chunk's own shape
    data: np.ndarray  # flat uint8


def data_file_name(rank: int, index: int, token: str = "") -> str:
    """``r<rank:05d>-<token>-<index:02d>.safetensors``; ``token`` (letters and digits) is unique per save, so
    two saves to one path never share a data file name (a reader of one never opens the other's files).
    Without a token: the pre-token name ``r<rank:05d>-<index:02d>.safetensors``."""
    return f"r{rank:05d}-{token}-{index:02d}.safetensors" if token else f"r{rank:05d}-{index:02d}.safetensors"


def save_token(text: str) -> str:
    """A 12-hex-digit file-name token derived from a save's identity (a temporary directory, a save id)."""
    return "%012x" % (xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass")) & ((1 << 48) - 1))


def chunk_name(fqn: str, offsets: Sequence[int], whole: bool) -> str:
    return fqn if whole else f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


def build_header(chunks: Sequence[ChunkToWrite]) -> tuple[bytes, list[int]]:
    """The padded header bytes (length prefix included) and each chunk's relative start."""
    doc: dict = {"__metadata__": {"format": "hyperdcp"}}
    pos, starts = 0, []
    for c in chunks:
        if c.name in doc:
            raise FormatError(f"two chunks named {c.name!r} in one data file")
        n = c.data.size
        doc[c.name] = {"dtype": c.dtype, "shape": list(c.shape), "data_offsets": [pos, pos + n]}
        starts.append(pos)
        pos += n
    head = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head, starts


def read_header(pread: Callable[[int, int], bytes], file_size: int, where: str,
                file_metadata: dict | None = None) -> tuple[dict, int]:
    """Parse and validate a safetensors header; return (entries, data start). Never trusts sizes blindly.

    ``pread(nbytes, offset) -> bytes`` reads the file (fewer bytes only at its end); the storage behind it
    is the caller's (``hyperdcp.storage.data_file.read_header`` also takes a file descriptor).
    ``file_metadata``, when given, receives the header's ``__metadata__`` object.
    """
    if file_size < 8:
        raise FormatError(f"{where}: too short to be a safetensors file ({file_size} bytes)")
    prefix = pread(8, 0)
    if len(prefix) != 8:
        raise CorruptionError(f"{where}: file truncated inside its header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise FormatError(f"{where}: declared header size {n} is larger than the file "
                          f"or the {MAX_HEADER_BYTES}-byte limit")
    raw = pread(n, 8)
    if len(raw) != n:
        raise CorruptionError(f"{where}: file truncated inside its header")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"{where}: header is not valid JSON ({type(e).__name__}: {e}); the file is damaged") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: header is not a JSON object")
    data_start = 8 + n
    data_len = file_size - data_start
    entries = {}
    for k, v in doc.items():
        if k == "__metadata__":
            if not isinstance(v, dict):
                raise FormatError(f"{where}: __metadata__ must be an object")
            if file_metadata is not None:
                file_metadata.update(v)
            continue
        if (not isinstance(v, dict) or not isinstance(v.get("shape"), list)
                or not isinstance(v.get("data_offsets"), list)):
            raise FormatError(f"{where}: entry {k!r} lacks dtype/shape/data_offsets")
        shape, offs = v["shape"], v["data_offsets"]
        if any(type(s) is not int or s < 0 for s in shape) or len(shape) > 64:
            raise FormatError(f"{where}: entry {k!r} has an invalid shape {shape!r}")
        if len(offs) != 2 or any(type(o) is not int for o in offs) or not 0 <= offs[0] <= offs[1] <= data_len:
            raise FormatError(f"{where}: entry {k!r} has data_offsets {offs!r} "
                              f"outside the file's {data_len} data bytes")
        try:
            size = dtypes.itemsize(v.get("dtype"))
        except FormatError as e:
            raise FormatError(f"{where}: entry {k!r}: {e}") from None
        numel = 1
        for s in shape:
            numel *= s
        if numel * size != offs[1] - offs[0]:
            raise FormatError(f"{where}: entry {k!r} byte range does not match shape {shape} and dtype "
                              f"{v.get('dtype')}")
        entries[k] = (v["dtype"], tuple(shape), data_start + offs[0], data_start + offs[1])
    return entries, data_start
