"""Deprecated: block checksums live in :mod:`hyperdcp.format.checksums` (this name re-exports them)."""

from ..format.checksums import block_digests, block_range, n_blocks, verify_blocks

__all__ = ["block_digests", "block_range", "n_blocks", "verify_blocks"]
