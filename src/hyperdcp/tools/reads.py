"""Reading one region of one stored tensor, for tools that work tensor by tensor (diff, convert).

TODO(lead): belongs in ``loading/reads.py`` once P3's split lands (it sits on ``execute_local_reads``).
"""

from __future__ import annotations

import numpy as np

from ..core import dtypes
from ..core.boxes import Box
from ..core.shards import LocalShard, ShardedTensor
from ..format.metadata import Metadata


def read_box(files, meta: Metadata, fqn: str, box: Box, verify: bool = True, index=None) -> np.ndarray:
    """The C-ordered bytes (flat uint8) of region ``box`` of tensor ``fqn``, through the verified reader
    ``files`` (:meth:`Source.reader`); ``verify``: check block checksums (False for unverifiable sources)."""
    from ..loading import execute_local_reads
    from ..options import LoadOptions
    from ..planning.load_plan import TensorIndex, group_reads, pieces_for

    t = meta.tensors[fqn]
    buf = np.empty(box.numel * dtypes.itemsize(t.dtype), np.uint8)
    if box.numel == 0:
        return buf
    st = ShardedTensor(fqn, t.dtype, t.shape, [LocalShard(box, buf)])
    index = index or TensorIndex(meta)
    reads = group_reads(meta, pieces_for(st, index.get(fqn), t), verify)
    execute_local_reads(files, meta, reads, LoadOptions(verify_checksums=verify, read_threads=1))
    return buf
