"""Where a checkpoint's files live: the :class:`Storage` interface (:mod:`.base`), :class:`LocalStorage`
(:mod:`.local`, commit protocol in :mod:`.local_commit`), ``ObjectStorage`` (:mod:`.object_store`: s3://,
commit without rename; clients in :mod:`.object_client`, retries in :mod:`.retry`, listing in
:mod:`.object_listing`), ``FsspecStorage`` (:mod:`.fsspec`, other URLs, read-only), ``MemoryStorage``
(:mod:`.memory`, tests) and :func:`storage_for` (:mod:`.urls`)."""

from .base import FileWriter, SaveFiles, SaveStaging, Storage
from .local import LocalStorage
from .urls import storage_for

__all__ = ["FileWriter", "LocalStorage", "SaveFiles", "SaveStaging", "Storage", "storage_for"]
