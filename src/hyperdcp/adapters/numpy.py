"""numpy arrays: one full box, replicated on every rank."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core import dtypes
from ..core.boxes import full_box
from ..core.layout import replicated_layout
from ..core.shards import LocalShard, ShardedTensor, flat_bytes
from ..errors import StateDictError


def is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray)


def to_sharded(fqn: str, arr: np.ndarray, ctx, for_load: bool) -> ShardedTensor:
    try:
        code = dtypes.from_numpy(arr.dtype)
    except Exception as e:  # noqa: BLE001
        raise StateDictError(f"cannot store {fqn!r}: {e}") from None
    box = full_box(arr.shape)
    replicas = tuple(range(ctx.world_size))
    if not for_load:
        data = flat_bytes(np.ascontiguousarray(arr))
        return ShardedTensor(fqn, code, box.lengths, [LocalShard(box, data, replicas)])
    if arr.flags.c_contiguous and arr.flags.writeable:
        return ShardedTensor(fqn, code, box.lengths, [LocalShard(box, flat_bytes(arr), replicas)],
                             layout=replicated_layout(ctx.world_size))
    if not arr.flags.writeable:
        raise StateDictError(f"cannot load into {fqn!r}: the numpy array is read-only; pass a writable array")
    if arr.size > 1 and any(s == 0 and n > 1 for s, n in zip(arr.strides, arr.shape)):
        raise StateDictError(f"cannot load into {fqn!r}: several of its elements share memory (a broadcast view, "
                             f"strides {arr.strides}); load into an array that owns its memory, e.g. its .copy()")
    # strided: a uint8 view of shape shape + (itemsize,); loading reads bounded pieces straight into it
    return ShardedTensor(fqn, code, box.lengths, [LocalShard(box, arr[..., None].view(np.uint8), replicas)],
                         layout=replicated_layout(ctx.world_size))
