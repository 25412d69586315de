"""Deprecated: the file-system coordinator moved to :mod:`hyperdcp.coordination.files`."""

from ..coordination.files import FileCoordinator, write_abort  # noqa: F401 - old import path

__all__ = ["FileCoordinator", "write_abort"]
