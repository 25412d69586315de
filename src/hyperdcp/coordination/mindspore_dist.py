"""A :class:`~hyperdcp.coordination.base.Coordinator` over MindSpore's collective communication.

For jobs launched with ``msrun`` after ``mindspore.communication.init()`` (``mccl`` on CPU, hccl/nccl on
devices): byte strings travel as int32 tensors (the dtypes MindSpore's CPU AllGather takes) through MindSpore's
``AllGather`` (lengths first, then
the payloads padded to the longest). Every collective is one or two all-gathers, so gather, scatter
and broadcast move ``world_size`` times the bytes a dedicated collective would: meant for the
metadata-sized messages of saves and loads (plans, status), not for tensor data, which hyperdcp
never moves through the coordinator. No point-to-point :class:`Transport`: read-once loads read locally.

MindSpore's collectives have no timeout of their own: a rank that never arrives blocks the others
(msrun's ``--join`` kills the job when a worker exits with an error). Exceptions raised inside a save
or load still reach every rank through the checked steps (:mod:`hyperdcp.coordination.checked`).
"""

from __future__ import annotations

from typing import Sequence

import mindspore as ms
import numpy as np
from mindspore import ops
from mindspore.communication import GlobalComm, get_group_size, get_rank

from .base import Coordinator


class MindSporeCoordinator(Coordinator):
    """The ranks of MindSpore's world group (or ``group``), collectives through ``AllGather``."""

    def __init__(self, group: str | None = None):
        self.group = group or GlobalComm.WORLD_COMM_GROUP
        self.rank = int(get_rank(self.group))
        self.world_size = int(get_group_size(self.group))
        self._gather = ops.AllGather(self.group)

    def all_gather(self, data: bytes) -> list[bytes]:
        n = self.world_size
        lens = self._gather(ms.Tensor(np.array([len(data)], np.int32))).asnumpy().reshape(n)
        words = max(-(-int(lens.max()) // 4), 1)  # CPU AllGather takes float16/float32/int32: bytes as int32 words
        buf = np.zeros(words * 4, np.uint8)
        buf[:len(data)] = np.frombuffer(bytes(data), np.uint8)
        rows = self._gather(ms.Tensor.from_numpy(buf.view(np.int32))).asnumpy().reshape(n, words)
        return [rows[i].tobytes()[:int(lens[i])] for i in range(n)]

    def gather(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        out = self.all_gather(data)
        return out if self.rank == dst else None

    def scatter(self, parts: Sequence[bytes] | None, src: int = 0) -> bytes:
        blob = b""
        if self.rank == src:
            parts = [bytes(p) for p in parts]  # type: ignore[union-attr]
            sizes = np.asarray([len(p) for p in parts], np.int64)
            blob = sizes.tobytes() + b"".join(parts)
        got = self.all_gather(blob)[src]
        sizes = np.frombuffer(got[:8 * self.world_size], np.int64)
        start = 8 * self.world_size + int(sizes[:self.rank].sum())
        return got[start:start + int(sizes[self.rank])]

    def broadcast(self, data: bytes | None, src: int = 0) -> bytes:
        return self.all_gather(bytes(data) if self.rank == src else b"")[src]

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} (MindSpore group {self.group})"


def mindspore_distributed_initialized() -> bool:
    """Whether ``mindspore.communication.init()`` ran in this process with more than one rank."""
    try:
        return bool(GlobalComm.INITED) and int(get_group_size()) > 1
    except Exception:  # noqa: BLE001 - not initialized, or a backend that cannot answer: not distributed
        return False
