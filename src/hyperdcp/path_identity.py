"""Deprecated: moved to :mod:`hyperdcp.storage.identity` (this name re-exports it)."""

from .storage.identity import DIGEST_BYTES, mismatch_among, mismatch_with_source, path_digest

__all__ = ["DIGEST_BYTES", "mismatch_among", "mismatch_with_source", "path_digest"]
