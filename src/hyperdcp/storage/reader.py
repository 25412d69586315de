"""Deprecated: the verified data-file reader moved to :mod:`hyperdcp.sources.base` (``ChunkReader``)."""

from ..sources.base import ChunkReader, DataFiles  # noqa: F401

__all__ = ["ChunkReader", "DataFiles"]
