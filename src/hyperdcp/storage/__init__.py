"""Where a checkpoint's files live: the :class:`Storage` interface (:mod:`.base`), :class:`LocalStorage`
(:mod:`.local`, commit protocol in :mod:`.local_commit`), ``ObjectStorage`` (:mod:`.object_store`: s3://,
commit without rename; clients in :mod:`.object_client`, retries in :mod:`.retry`, listing in
:mod:`.object_listing`), ``FsspecStorage`` (:mod:`.fsspec`, other URLs, read-only), ``MemoryStorage``
(:mod:`.memory`, tests), :func:`storage_for` (:mod:`.urls`) and :func:`register_storage` (:mod:`.schemes`: a
Storage of your own for a URL scheme)."""

from .base import FileWriter, SaveFiles, SaveStaging, Storage
from .local import LocalStorage
from .schemes import register_storage, unregister_storage
from .urls import storage_for

__all__ = ["FileWriter", "LocalStorage", "SaveFiles", "SaveStaging", "Storage", "register_storage", "storage_for",
           "unregister_storage"]
