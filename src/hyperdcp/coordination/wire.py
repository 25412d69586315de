"""Deprecated: the wire envelope moved to :mod:`hyperdcp.core.wire` (planning must not import coordination)."""

from ..core.wire import pack, unpack  # noqa: F401 - old import path

__all__ = ["pack", "unpack"]
