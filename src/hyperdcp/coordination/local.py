"""The coordinator of a single process: every collective is the identity."""

from __future__ import annotations

from typing import Sequence

from .base import Coordinator


class LocalCoordinator(Coordinator):
    """A single process (``rank`` 0 of 1); no Transport, so read-once loads read locally."""

    rank = 0
    world_size = 1

    def all_gather(self, data: bytes) -> list[bytes]:
        return [bytes(data)]

    def gather(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        return [bytes(data)]

    def scatter(self, parts: Sequence[bytes] | None, src: int = 0) -> bytes:
        return bytes(parts[0])  # type: ignore[index]

    def broadcast(self, data: bytes | None, src: int = 0) -> bytes:
        return bytes(data)  # type: ignore[arg-type]
