"""The coordination protocol every save and load runs on: :class:`Coordinator` and :class:`Transport`.

A :class:`Coordinator` moves opaque byte strings between the ranks of one job: ``all_gather``,
``gather``, ``scatter`` and ``broadcast``. Implementations: :class:`~hyperdcp.coordination.local.LocalCoordinator`
(one process), :class:`~hyperdcp.coordination.torch_dist.TorchCoordinator` (a torch.distributed process
group, gloo for CPU traffic), :class:`~hyperdcp.coordination.files.FileCoordinator` (a shared file
system; used by the async persist processes).

A coordinator that can also move byte buffers point to point implements :class:`Transport`; read-once
loads use it when it does (``isinstance(coord, Transport)``), and read locally when it does not.

Call order, every rank: ``arrive(what)`` once per save or load, then the same collectives in the same
order. Errors: every phase runs through the checked steps of :mod:`hyperdcp.coordination.checked`, so
an exception on one rank is raised on all of them instead of leaving them waiting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

# the checked steps lived here before coordination/checked.py: old import paths keep working
from .checked import (  # noqa: F401
    RaisedEverywhere,
    _everywhere,
    _status,
    all_gather_checked,
    broadcast_checked,
    check_all,
    encode_status,
    gather_checked,
    pack_status,
    plan_and_scatter,
    raise_remote,
    raised_everywhere,
    run_checked,
    unpack_status,
)


class Coordinator(ABC):
    """Byte-string collectives among ``world_size`` ranks. All ranks must call each method in order."""

    rank: int
    world_size: int

    @abstractmethod
    def all_gather(self, data: bytes) -> list[bytes]: ...

    @abstractmethod
    def gather(self, data: bytes, dst: int = 0) -> list[bytes] | None: ...

    @abstractmethod
    def scatter(self, parts: Sequence[bytes] | None, src: int = 0) -> bytes: ...

    @abstractmethod
    def broadcast(self, data: bytes | None, src: int = 0) -> bytes: ...

    def barrier(self) -> None:
        self.all_gather(b"")

    def any_true(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (one small collective)."""
        return any(b == b"1" for b in self.all_gather(b"1" if flag else b"0"))

    def arrive(self, what: str) -> None:  # noqa: B027 - an optional hook: the default does nothing
        """Wait for every rank to enter ``what`` (a save or load); raise CoordinationError naming the
        ranks that did not arrive within the timeout. No-op where ranks cannot go missing."""

    @property
    def global_ranks(self) -> list[int]:
        """Global (world) rank of each group rank; identity unless a subgroup is used."""
        return list(range(self.world_size))

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


@runtime_checkable
class Transport(Protocol):
    """What read-once needs beyond collectives: byte buffers point to point, and a broadcast inside a
    group handle that an adapter put in :attr:`GridLayout.groups <hyperdcp.core.layout.GridLayout>`.

    Ranks (``peer``, ``src``) are the coordinator's own ranks. Buffers are contiguous uint8 numpy
    arrays; a receive writes into its buffer in place. Call order per batch, on every rank: post every
    ``irecv``, then every ``isend``, then the ``broadcast_in`` of the batch's broadcast units in the same
    order on every member, then ``wait`` on all the handles. Failures raise CoordinationError.
    """

    def isend(self, buf: np.ndarray, peer: int, tag: int) -> Any: ...

    def irecv(self, buf: np.ndarray, peer: int, tag: int) -> Any: ...

    def broadcast_in(self, buf: np.ndarray, src: int, group: Any) -> Any:
        """``group``: a handle from a layout's ``groups``, or None for all ranks of the coordinator."""

    def wait(self, handles: Sequence[Any]) -> None: ...


def __getattr__(name: str) -> Any:
    if name == "LocalCoordinator":  # moved to coordination/local.py (which imports this module)
        from .local import LocalCoordinator

        return LocalCoordinator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
