"""Coordinator over a torch.distributed process group.

Byte strings travel as uint8 CPU tensors through a gloo group: the caller's group when it already is
gloo, otherwise a gloo twin of it created once (with ``use_local_synchronization`` so only its members
take part) and reused for every later save and load.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from .base import Coordinator

_GLOO_TWINS: dict[tuple[str, float | None], object] = {}


def _backend(pg) -> str:
    try:
        return str(dist.get_backend(pg)).lower()
    except Exception:  # noqa: BLE001 - unknown backends are treated as not gloo
        return ""


def gloo_group(pg=None, timeout: float | None = None):
    """A gloo process group with the same members as ``pg`` (default: the world)."""
    pg = pg if pg is not None else dist.group.WORLD
    if timeout is None and _backend(pg) == "gloo":
        return pg
    key = (dist.get_process_group_ranks(pg).__repr__() + getattr(pg, "group_name", ""), timeout)
    twin = _GLOO_TWINS.get(key)
    if twin is None:
        kwargs = {"backend": "gloo", "use_local_synchronization": True}
        if timeout is not None:
            kwargs["timeout"] = timedelta(seconds=timeout)
        twin = dist.new_group(ranks=dist.get_process_group_ranks(pg), **kwargs)
        _GLOO_TWINS[key] = twin
    return twin


def _t(data: bytes, size: int | None = None) -> torch.Tensor:
    size = len(data) if size is None else size
    buf = np.zeros(max(size, 1), dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return torch.from_numpy(buf)


class TorchCoordinator(Coordinator):
    def __init__(self, pg=None, timeout: float | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        self.group = gloo_group(pg, timeout)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._global = dist.get_process_group_ranks(self.group)

    @property
    def global_ranks(self) -> list[int]:
        return list(self._global)

    def _sizes(self, n: int) -> list[int]:
        mine = torch.tensor([n], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return [int(t.item()) for t in out]

    def all_gather(self, data: bytes) -> list[bytes]:
        sizes = self._sizes(len(data))
        m = max(max(sizes), 1)
        out = [torch.empty(m, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, _t(data, m), group=self.group)
        return [out[r].numpy()[: sizes[r]].tobytes() for r in range(self.world_size)]

    def gather(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        sizes = self._sizes(len(data))
        m = max(max(sizes), 1)
        out = [torch.empty(m, dtype=torch.uint8) for _ in range(self.world_size)] if self.rank == dst else None
        dist.gather(_t(data, m), out, dst=self._global[dst], group=self.group)
        if self.rank != dst:
            return None
        return [out[r].numpy()[: sizes[r]].tobytes() for r in range(self.world_size)]

    def scatter(self, parts: Sequence[bytes] | None, src: int = 0) -> bytes:
        m = self.broadcast(str(max(len(p) for p in parts)).encode() if self.rank == src else None, src)
        m = int(m) + 8
        framed = None
        if self.rank == src:
            framed = [_t(len(p).to_bytes(8, "little") + p, m) for p in parts]
        out = torch.empty(max(m, 1), dtype=torch.uint8)
        dist.scatter(out, framed, src=self._global[src], group=self.group)
        raw = out.numpy()
        n = int.from_bytes(raw[:8].tobytes(), "little")
        return raw[8 : 8 + n].tobytes()

    def broadcast(self, data: bytes | None, src: int = 0) -> bytes:
        size = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.int64)
        dist.broadcast(size, src=self._global[src], group=self.group)
        n = int(size.item())
        buf = _t(data) if self.rank == src else torch.empty(max(n, 1), dtype=torch.uint8)
        dist.broadcast(buf, src=self._global[src], group=self.group)
        return buf.numpy()[:n].tobytes()


def default_coordinator(pg=None, timeout: float | None = None) -> Coordinator:
    """The coordinator for a call: torch.distributed when initialized, else a single process."""
    if dist.is_available() and dist.is_initialized():
        return TorchCoordinator(pg, timeout)
    from .base import LocalCoordinator

    return LocalCoordinator()
