"""Committed checkpoints under an object-store prefix (what ``latest_checkpoint("s3://bucket/run")`` lists).

A child prefix counts only when its ``hyperdcp.json`` is present and valid: objects of a save that never
committed (killed, failed, in flight) are never listed. Order: the step number in the name (the last
integer, ``step-300``), then the commit time in the record, then the name -- the local rule.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from ..errors import CheckpointError, CheckpointNotFoundError
from ..format.metadata import METADATA_FILE, Metadata, max_metadata_bytes
from .base import Storage
from .object_store import ObjectStorage
from .urls import storage_for, url_join

_NUM = re.compile(r"(\d+)(?!.*\d)")


def read_committed(st: Storage, url: str) -> Metadata:
    """The validated commit record of the checkpoint in ``st`` (at ``url``), with its chunk index read from
    beside it when the record is format 2 (CheckpointError when there is no valid record)."""
    return Metadata.from_json(st.read_all(METADATA_FILE, max_metadata_bytes(), "metadata file"),
                              where=url_join(url, METADATA_FILE),
                              index=lambda name, n: st.read_all(name, n, "chunk index"))


def read_record(url: str) -> Metadata:
    """The validated commit record of the checkpoint at ``url`` (CheckpointError when there is none)."""
    st = storage_for(url)
    try:
        return read_committed(st, url)
    finally:
        st.close()


def committed_checkpoints(root: str, storage_options: dict | None = None) -> list[str]:
    """URLs of the committed checkpoints directly under ``root`` (``s3://bucket/run``), oldest first."""
    root = root.rstrip("/")
    st = storage_for(root, storage_options)
    if not isinstance(st, ObjectStorage):
        raise CheckpointNotFoundError(f"{root!r} is not an object-store URL (s3://bucket/prefix)")
    _, prefixes = st.call(lambda: st.client.list(st.key(""), "/"), f"listing {root}")
    base = len(st.key(""))
    names = sorted({p[base:].strip("/") for p in prefixes} - {""})

    def probe(name: str) -> tuple | None:
        url = url_join(root, name)
        child = ObjectStorage(url, st.storage_options, client=st.client)
        try:
            meta = read_committed(child, url)
        except CheckpointError:
            return None
        m = _NUM.search(name)
        return int(m.group(1)) if m else -1, meta.created_unix, name, url

    with ThreadPoolExecutor(8, thread_name_prefix="hyperdcp-list") as ex:
        found = [f for f in ex.map(probe, names) if f is not None]
    st.close()
    found.sort()
    return [url for *_, url in found]


__all__ = ["committed_checkpoints", "read_committed", "read_record"]
