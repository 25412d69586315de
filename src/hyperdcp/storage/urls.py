"""Checkpoint locations as paths or URLs: which storage serves them, and how names join them.

* :func:`is_remote`: a URL whose protocol is not ``file``/``local`` (read through fsspec);
* :func:`local_path`: the local path of a plain path or a ``file://``/``local://`` URL;
* :func:`url_join`: ``root/name`` for a validated plain file name;
* :func:`local_save_path` / :func:`save_path`: where a save may go (local paths, and ``s3://`` URLs for
  :func:`save_path`; other URLs raise :class:`~hyperdcp.errors.UnsupportedStorageError`);
* :func:`storage_for`: the :class:`~hyperdcp.storage.base.Storage` of a path or URL: local,
  :class:`~.object_store.ObjectStorage` for ``s3://``, the registered one for a scheme of
  :func:`~.schemes.register_storage`, :class:`~.fsspec.FsspecStorage` (read-only) otherwise;
* :func:`storage_options_scope`: the ``storage_options`` every storage made inside it gets (what
  ``hyperdcp.load(..., storage_options=)`` uses so that the sources need no extra argument).
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

from ..errors import UnsupportedStorageError
from .base import Storage

#: protocols read from the local file system (plain paths have none)
LOCAL_PROTOCOLS = ("file", "local")
_PROTOCOL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+)://")
#: protocols saved to and loaded from through :class:`~.object_store.ObjectStorage`
OBJECT_PROTOCOLS = ("s3", "s3a")
_OPTIONS: ContextVar[dict | None] = ContextVar("hyperdcp_storage_options", default=None)


def _protocol(path: str) -> str | None:
    m = _PROTOCOL.match(path)
    return m.group(1).lower() if m else None


def is_remote(path: str | os.PathLike) -> bool:
    """True for a URL read through fsspec: a protocol other than ``file``/``local``, or a chained URL."""
    if not isinstance(path, str):
        path = os.fspath(path)
        if not isinstance(path, str):
            return False
    if "::" in path and _PROTOCOL.match(path.split("::", 1)[1]):  # e.g. "simplecache::s3://bucket/ckpt"
        return True
    proto = _protocol(path)
    return proto is not None and proto not in LOCAL_PROTOCOLS


def local_path(path: str | os.PathLike) -> str:
    """The local file-system path of a plain path or a ``file://``/``local://`` URL (unchanged otherwise)."""
    path = os.fspath(path)
    proto = _protocol(path)
    if proto in LOCAL_PROTOCOLS:
        rest = path.split("://", 1)[1]
        if rest.startswith("localhost/"):
            rest = rest[len("localhost"):]
        return rest or os.sep
    return path


def url_join(root: str, name: str) -> str:
    """``root/name`` for a URL root (``name`` is a validated plain file name)."""
    return f"{root.rstrip('/')}/{name}"


def local_save_path(path: str | os.PathLike) -> str:
    """The local directory a save writes to; a remote URL raises :class:`UnsupportedStorageError`."""
    path = os.fspath(path)
    if is_remote(path):
        raise UnsupportedStorageError(
            f"cannot save to {path!r}: saving to remote storage is not supported yet; save to a local (or mounted) "
            "directory and upload it (e.g. with your storage's CLI or fsspec's put(..., recursive=True)); "
            "hyperdcp.load reads it back from the URL. Or serve the URL's scheme with a Storage of your own "
            "(hyperdcp.storage.register_storage)"
        )
    return local_path(path)


def is_object_store(path: str | os.PathLike) -> bool:
    """True for an ``s3://`` URL (saved and loaded through :class:`~.object_store.ObjectStorage`)."""
    return isinstance(path, str) and _protocol(path) in OBJECT_PROTOCOLS


def is_registered(path: str | os.PathLike) -> bool:
    """True for a URL whose scheme has a storage of its own (:func:`~.schemes.register_storage`)."""
    from .schemes import registered

    return isinstance(path, str) and _protocol(path) in registered()


def save_path(path: str | os.PathLike) -> str:
    """What a save writes to: an ``s3://`` URL or one of a registered scheme (:mod:`.schemes`) as given, else
    the local directory (:func:`local_save_path`)."""
    path = os.fspath(path)
    return path.rstrip("/") if is_object_store(path) or is_registered(path) else local_save_path(path)


@contextmanager
def storage_options_scope(options: dict | None) -> Iterator[None]:
    """Within the block, :func:`storage_for` gives ``options`` to every storage it makes (None: no change)."""
    if options is None:
        yield
        return
    token = _OPTIONS.set(dict(options))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def storage_for(path: str | os.PathLike, storage_options: dict | None = None) -> Storage:
    """:class:`~.local.LocalStorage` for a plain path or ``file://`` URL, :class:`~.object_store.ObjectStorage`
    for ``s3://`` URLs, the registered storage for a scheme of :func:`~.schemes.register_storage`,
    :class:`~.fsspec.FsspecStorage` for other URLs. ``storage_options``: the client's
    configuration (default: the enclosing :func:`storage_options_scope`, else the client's own)."""
    path = os.fspath(path)
    from .schemes import factory_for

    custom = factory_for(_protocol(path))
    if custom is not None:  # a scheme registered with register_storage
        return custom(path, storage_options if storage_options is not None else _OPTIONS.get())
    if is_object_store(path):
        from .object_store import ObjectStorage

        return ObjectStorage(path, storage_options if storage_options is not None else _OPTIONS.get())
    if is_remote(path):
        from .fsspec import FsspecStorage

        return FsspecStorage(path)
    from .local import LocalStorage

    return LocalStorage(local_path(path))


__all__ = ["LOCAL_PROTOCOLS", "OBJECT_PROTOCOLS", "is_object_store", "is_registered", "is_remote", "local_path",
           "local_save_path", "save_path", "storage_for", "storage_options_scope", "url_join"]
