"""The load flow behind :func:`hyperdcp.load`, as a package:

- :mod:`.reads`: read_chunk, copy_piece, local reads, read_box -- the bottom every reader shares;
- :mod:`.targets`: destination boxes -> pieces; missing and unused keys; per-rank entries;
- :mod:`.read_once`: running a read-once schedule (reading thread, shm slots, Transport);
- :mod:`.flow`: load(): the metadata, plan, read (local or read-once), finish.

The names ``hyperdcp.loading`` exported as one module stay importable from here.
"""

from ..sources.base import ChunkReader as DataFiles  # noqa: E402 - the name tests and tools used before the split
from .flow import LoadResult, fetch_metadata, fetch_metadata_checked, load
from .reads import (
    STAGING_BYTES,
    _buffer,
    _cut,
    _direct_target,
    bounded_reads,
    copy_piece,
    execute_local_reads,
    read_box,
    read_chunk,
)
from .targets import _ABSENT, _DROP, LoadTargets, _per_rank_view, plan_targets, saved_rank

__all__ = [
    "STAGING_BYTES",
    "DataFiles",
    "LoadResult",
    "LoadTargets",
    "bounded_reads",
    "copy_piece",
    "execute_local_reads",
    "fetch_metadata",
    "fetch_metadata_checked",
    "load",
    "plan_targets",
    "read_box",
    "read_chunk",
    "saved_rank",
]
