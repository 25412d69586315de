"""The one contract the planner, format and storage rely on.

An adapter (torch, numpy, ...) turns each value of a state dict into a :class:`ShardedTensor`: its
global shape and dtype, and the N-d boxes this rank holds, each with its host bytes. Everything below
the adapters sees only this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .boxes import Box, Shape
from .dtypes import itemsize
from .layout import GridLayout


@dataclass
class LocalShard:
    """One box of a tensor held by this rank.

    ``data`` is a flat, C-ordered uint8 host buffer of ``box.numel * itemsize`` bytes. When saving it
    is read; when loading it is written (for tensors not addressable from the host, the adapter hands
    a host buffer and a ``finish`` callback that copies it to the device). A strided host destination
    may instead be a uint8 view of shape ``box.lengths + (itemsize,)`` into its memory (loads only).
    """

    box: Box
    data: np.ndarray
    #: global ranks known to hold an identical copy of this box (self included), or None if unknown
    replica_ranks: tuple[int, ...] | None = None


@dataclass
class ShardedTensor:
    """A value as the core sees it: global shape, dtype code and the local shards."""

    fqn: str
    dtype: str
    shape: Shape
    shards: list[LocalShard] = field(default_factory=list)
    #: called after loading has filled every shard's buffer (e.g. host -> device copy)
    finish: Callable[[], None] | None = None
    #: set by adapters that know every rank's box (DTensor mesh + placements, replicated tensors)
    layout: "GridLayout | None" = None

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def flat_bytes(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (0-d included); never copies."""
    if not array.flags.c_contiguous:
        raise ValueError("flat_bytes needs a C-contiguous array")
    return array.reshape(-1).view(np.uint8) if array.ndim else array.reshape(1).view(np.uint8)


def shard_bytes(box: Box, dtype: str) -> int:
    return box.numel * itemsize(dtype)


def check_shard_buffer(fqn: str, shard: LocalShard, dtype: str) -> None:
    want = shard_bytes(shard.box, dtype)
    if shard.data.dtype != np.uint8 or shard.data.ndim != 1 or shard.data.size != want:
        raise ValueError(
            f"adapter bug for {fqn!r}: box {shard.box} needs a flat uint8 buffer of {want} bytes, "
            f"got {shard.data.dtype} {shard.data.shape}"
        )
