"""Copying between host buffers without holding the GIL.

``memoryview`` slice assignment and ``bytes`` slicing copy with the GIL held, so a 16 MiB copy on one
reading thread stops every other thread of the process (the one issuing the next request among them).
numpy's copy releases it.
"""

from __future__ import annotations

import numpy as np

from .shards import flat_bytes


def copy_into(dst, src, offset: int = 0) -> None:
    """Copy all of ``src`` into ``dst`` from byte ``offset`` (both C-contiguous bytes-likes; ``dst`` writable)."""
    s = flat_bytes(src) if isinstance(src, np.ndarray) else np.frombuffer(src, dtype=np.uint8)
    d = np.frombuffer(memoryview(dst).cast("B"), dtype=np.uint8)
    np.copyto(d[offset : offset + s.size], s)


def same_memory(a, b) -> bool:
    """Whether bytes-likes ``a`` and ``b`` are the very same bytes (same start, same length)."""
    x = np.frombuffer(memoryview(a).cast("B"), dtype=np.uint8)
    y = np.frombuffer(memoryview(b).cast("B"), dtype=np.uint8)
    return x.size == y.size and (x.size == 0 or x.ctypes.data == y.ctypes.data)


__all__ = ["copy_into", "same_memory"]
