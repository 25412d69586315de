"""Storage of your own for a URL scheme: :func:`register_storage`.

A checkpoint location ``<scheme>://...`` whose scheme is registered here is served by the registered
:class:`~hyperdcp.storage.base.Storage`: :func:`hyperdcp.save`, :func:`hyperdcp.async_save`,
:func:`hyperdcp.load`, :func:`hyperdcp.read_metadata`, the CheckpointManager and the tools all reach it
through :func:`~hyperdcp.storage.urls.storage_for`. Call order::

    register_storage("blob", "mypkg.blobstore:BlobStorage")   # once per process, before the first use
    hyperdcp.save(state, "blob://bucket/ckpt/step-100")        # BlobStorage("blob://...", storage_options)
    unregister_storage("blob")                                 # optional

The factory is named by its import path (``"module:attribute"``), a callable ``(url, storage_options) ->
Storage`` -- a Storage subclass with that constructor is one. A path, not an object, because async saves
write in persist processes (fresh interpreters, :mod:`hyperdcp.async_saving`): each save carries the
registrations made in the training process, and the persist process imports the same factory (so its
module must be importable there: installed, or on ``sys.path``, which persist processes inherit).

The registry is process-wide state: the ``storage.schemes`` slot of :mod:`hyperdcp._runtime`.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable

from .. import _runtime

#: schemes hyperdcp serves itself (local files, object stores); they cannot be registered
BUILTIN = ("file", "local", "s3", "s3a")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.\-]+$")


def _registry() -> dict[str, str]:
    return _runtime.slot("storage.schemes", dict)


def _path_of(factory: str | Callable[..., Any]) -> str:
    if isinstance(factory, str):
        return factory
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or not qualname or "<" in qualname or module == "__main__":
        raise ValueError(f"register_storage: {factory!r} has no import path (define it at module level of an "
                         "importable module, or pass 'module:attribute')")
    return f"{module}:{qualname}"


def resolve(path: str) -> Callable[..., Any]:
    """The callable that ``"module:attribute"`` names (attributes may be dotted: ``"mod:Class.make"``)."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"storage factory {path!r} is not of the form 'module:attribute'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"storage factory {path!r} is not callable")
    return obj


def register_storage(scheme: str, factory: str | Callable[..., Any]) -> None:
    """Serve ``<scheme>://...`` locations with ``factory(url, storage_options)`` (a :class:`Storage`).

    Args:
        scheme: the URL scheme, lower case (``"blob"`` for ``blob://...``); not one hyperdcp serves itself
            (``file``, ``local``, ``s3``, ``s3a``). Registering a scheme again replaces its factory.
        factory: ``"module:attribute"``, or a module-level callable (recorded by its import path).

    Raises:
        ValueError: a malformed or built-in scheme, or a factory that cannot be imported by path.

    Example::

        hyperdcp.storage.register_storage("blob", "mypkg.blobstore:BlobStorage")
        hyperdcp.save(state, "blob://bucket/ckpt/step-100")
    """
    if not isinstance(scheme, str) or not _SCHEME.match(scheme):
        raise ValueError(f"register_storage: scheme {scheme!r} must be lower-case letters, digits, '+', '-' or '.', "
                         "starting with a letter")
    if scheme in BUILTIN:
        raise ValueError(f"register_storage: {scheme!r} is served by hyperdcp itself; choose another scheme")
    path = _path_of(factory)
    got = resolve(path)  # fails here, not at the first save
    if not isinstance(factory, str) and got is not factory:
        raise ValueError(f"register_storage: {path!r} does not name {factory!r}; define it at module level")
    _registry()[scheme] = path


def unregister_storage(scheme: str) -> None:
    """Forget ``scheme`` (absent is fine)."""
    _registry().pop(scheme, None)


def registered() -> dict[str, str]:
    """scheme -> factory path of every registration (what an async save sends to its persist process)."""
    return dict(_registry())


def adopt(entries: dict[str, str] | None) -> None:
    """Make the registrations ``entries`` (from :func:`registered` in another process) this process's too."""
    for scheme, path in (entries or {}).items():
        if _registry().get(scheme) != path:
            register_storage(scheme, path)


def factory_for(scheme: str | None) -> Callable[..., Any] | None:
    """The factory registered for ``scheme``, or None."""
    path = _registry().get(scheme) if scheme else None
    return resolve(path) if path is not None else None


__all__ = ["BUILTIN", "adopt", "factory_for", "register_storage", "registered", "resolve", "unregister_storage"]
