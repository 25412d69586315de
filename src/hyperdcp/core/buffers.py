"""Copying between host buffers without holding the GIL.

``memoryview`` slice assignment and ``bytes`` slicing copy with the GIL held, so a 16 MiB copy on one
reading thread stops every other thread of the process (the one issuing the next request among them).
numpy's copy releases it.
"""

from __future__ import annotations

import numpy as np


def as_bytes_array(buf) -> np.ndarray:
    """``buf`` (any C-contiguous bytes-like) as a flat uint8 array over the same memory."""
    return np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)


def copy_into(dst, src, offset: int = 0) -> None:
    """Copy all of ``src`` into ``dst`` from byte ``offset`` (both bytes-like; ``dst`` writable)."""
    s = as_bytes_array(src)
    d = as_bytes_array(memoryview(dst).cast("B"))
    np.copyto(d[offset : offset + s.size], s)


__all__ = ["as_bytes_array", "copy_into"]
