"""The plan cache: global plans by the digests of every rank's local plan (warm saves skip planning)."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

import numpy as np
import xxhash

if TYPE_CHECKING:
    from .save_plan import GlobalPlan


class PlanCache:
    """Global plans by the digests of every rank's local plan (bounded, least recently used out)."""

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self._entries: "OrderedDict[bytes, GlobalPlan | np.ndarray]" = OrderedDict()

    @staticmethod
    def key(digests: Sequence[bytes]) -> bytes:
        return xxhash.xxh3_128(b"".join(digests)).digest()

    def get(self, key: bytes):
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
        return hit

    def put(self, key: bytes, value) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list:
        """``(key, value)`` pairs, least recently used first."""
        return list(self._entries.items())

    def clear(self) -> None:
        self._entries.clear()
