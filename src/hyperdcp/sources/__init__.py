"""What a load, inspect, verify, diff or convert reads from (see :mod:`hyperdcp.sources.base`)."""

from .base import ChunkReader, Source, kinds, open_source, share_source, source_from_bytes

__all__ = ["ChunkReader", "Source", "kinds", "open_source", "share_source", "source_from_bytes"]
