"""Deprecated: offline verification moved to :mod:`hyperdcp.tools.verify` (the report classes to
:mod:`hyperdcp.results`); this module re-exports them."""

from .results import BadChunk, VerifyReport
from .tools.verify import verify_checkpoint

__all__ = ["verify_checkpoint", "VerifyReport", "BadChunk"]
