"""Per-block checksums (xxh3-64) of chunk bytes, computed while writing and verified while reading.

A chunk's bytes are split into blocks of ``block_bytes`` counted from the chunk's first byte; each
block has one 64-bit checksum, written as 16 lowercase hex digits. Blocks let a ranged read verify
what it read without reading the whole chunk.
"""

from __future__ import annotations

import xxhash


def n_blocks(nbytes: int, block_bytes: int) -> int:
    """Number of checksum blocks covering ``nbytes`` (an empty chunk still has one, of b"")."""
    return max(1, -(-nbytes // block_bytes))


def block_digests(data, block_bytes: int) -> str:
    """Hex checksums of consecutive blocks of ``data`` (bytes-like)."""
    mv = memoryview(data).cast("B")
    n = n_blocks(len(mv), block_bytes)
    return "".join("%016x" % xxhash.xxh3_64_intdigest(mv[i * block_bytes : (i + 1) * block_bytes]) for i in range(n))


def block_range(start: int, stop: int, block_bytes: int, chunk_bytes: int) -> tuple[int, int]:
    """The byte range, within a chunk, of the whole blocks that cover ``[start, stop)``."""
    lo = (start // block_bytes) * block_bytes
    hi = min(-(-stop // block_bytes) * block_bytes, chunk_bytes)
    return lo, hi


def verify_blocks(data, first_block: int, checksums: str, block_bytes: int) -> int | None:
    """Check whole blocks starting at block ``first_block``; return the first bad block or None."""
    mv = memoryview(data).cast("B")
    n = max(1, -(-len(mv) // block_bytes))
    for i in range(n):
        want = checksums[16 * (first_block + i) : 16 * (first_block + i + 1)]
        if "%016x" % xxhash.xxh3_64_intdigest(mv[i * block_bytes : (i + 1) * block_bytes]) != want:
            return first_block + i
    return None
