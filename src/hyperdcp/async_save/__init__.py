"""Deprecated package path: async saves live in :mod:`hyperdcp.async_saving` (``hyperdcp.async_save`` is the
function). Old imports of public names (``from hyperdcp.async_save import SaveFuture``) still resolve here."""

from __future__ import annotations

_MOVED = {"saver": "session", "persist_process": "child/worker", "future": "future", "staging": "staging"}


def __getattr__(name: str):
    import importlib

    pkg = importlib.import_module("hyperdcp.async_saving")
    if name in pkg.__all__:
        return getattr(pkg, name)
    if name in _MOVED:
        raise AttributeError(f"hyperdcp.async_save.{name} moved to hyperdcp.async_saving.{_MOVED[name]}; "
                             "import it from there")
    raise AttributeError(f"module 'hyperdcp.async_save' has no attribute {name!r}; async saves live in "
                         "hyperdcp.async_saving")
