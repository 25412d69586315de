"""Deprecated: data-file codecs live in :mod:`hyperdcp.format.safetensors`, writing in :mod:`hyperdcp.saving.write`.

This module re-exports the codecs; its :func:`read_header` also accepts a file descriptor (read with the
checkpoint's no-follow ``pread``), as it did before the move.
"""

from __future__ import annotations

from typing import Callable

from ..format.safetensors import MAX_HEADER_BYTES, ChunkToWrite, build_header, chunk_name, data_file_name, save_token
from ..format.safetensors import read_header as _read_header


def read_header(fd: int | Callable[[int, int], bytes], file_size: int, where: str,
                file_metadata: dict | None = None) -> tuple[dict, int]:
    """:func:`hyperdcp.format.safetensors.read_header` over a file descriptor or a ``pread(n, offset)`` callable."""
    if callable(fd):
        return _read_header(fd, file_size, where, file_metadata)
    from .safe_open import pread_exact  # OS read errors (EIO, ...) become StorageError naming the file

    return _read_header(lambda n, off: pread_exact(fd, n, off, where), file_size, where, file_metadata)


__all__ = ["MAX_HEADER_BYTES", "ChunkToWrite", "build_header", "chunk_name", "data_file_name", "read_header",
           "save_token"]
