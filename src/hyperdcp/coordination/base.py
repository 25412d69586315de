"""The coordination protocol every save and load runs on.

A :class:`Coordinator` moves opaque byte strings between the ranks of one job: ``all_gather``,
``gather``, ``scatter`` and ``broadcast``. Implementations: :class:`LocalCoordinator` (one process),
``TorchCoordinator`` (a torch.distributed process group, gloo for CPU traffic), ``FileCoordinator``
(a shared file system; used by the async persist processes).

Errors: every phase of a save or load runs through :func:`run_checked`, which exchanges an ok/error
status with every other rank, so an exception on one rank is raised on all of them (as
:class:`RemoteRankError` naming the failing rank) instead of leaving them waiting.
"""

from __future__ import annotations

import traceback
from abc import ABC, abstractmethod
from typing import Callable, Sequence, TypeVar

from ..errors import RemoteRankError

T = TypeVar("T")

_OK, _ERR = b"\x00", b"\x01"


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

    def arrive(self, what: str) -> None:
        """Wait for every rank to enter ``what`` (a save or load); raise CoordinationError naming the
        ranks that did not arrive within the timeout. No-op where ranks cannot go missing."""

    @property
    def global_ranks(self) -> list[int]:
        """Global (world) rank of each group rank; identity unless a subgroup is used."""
        return list(range(self.world_size))

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


class LocalCoordinator(Coordinator):
    """A single process: every collective is the identity."""

    rank = 0
    world_size = 1

    def all_gather(self, data: bytes) -> list[bytes]:
        return [bytes(data)]

    def gather(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        return [bytes(data)]

    def scatter(self, parts, src: int = 0) -> bytes:
        return bytes(parts[0])

    def broadcast(self, data, src: int = 0) -> bytes:
        return bytes(data)


def _status(exc: BaseException | None) -> bytes:
    if exc is None:
        return _OK
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return _ERR + f"{type(exc).__module__}.{type(exc).__qualname__}\n{text}".encode("utf-8", "replace")


def raise_remote(statuses: Sequence[bytes], coord: Coordinator, what: str, local: BaseException | None) -> None:
    """Raise on every rank if any status is an error; re-raise the local exception where it happened."""
    failed = {r: s[1:].decode("utf-8", "replace") for r, s in enumerate(statuses) if s[:1] == _ERR}
    if not failed:
        return
    if local is not None:
        raise _everywhere(local)
    first = min(failed)
    detail = failed[first].split("\n", 1)[-1]
    ranks = ", ".join(str(r) for r in sorted(failed)[:16]) + (" ..." if len(failed) > 16 else "")
    raise _everywhere(RemoteRankError(
        f"{what} failed on rank(s) {ranks} of {coord.world_size}; first error (rank {first}): {detail}",
        failed,
    ))


def _everywhere(exc: BaseException) -> BaseException:
    """Mark an error that every rank raises at the same step: enclosing checks need not exchange it
    again (a rank that already left could not answer, and the others would wait for it)."""
    try:
        exc._hyperdcp_everywhere = True  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return exc


def raised_everywhere(exc: BaseException | None) -> bool:
    return bool(getattr(exc, "_hyperdcp_everywhere", False))


def check_all(coord: Coordinator, what: str, exc: BaseException | None) -> None:
    """Every rank calls it with its own error (or None); if any rank had one, raise on every rank.

    The common case costs one one-flag collective; the error texts are exchanged only after a failure.
    """
    if raised_everywhere(exc):
        raise exc
    if coord.any_true(exc is not None):
        raise_remote(coord.all_gather(_status(exc)), coord, what, exc)


def run_checked(coord: Coordinator, what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it raised anywhere, raise everywhere (after all ranks finished it)."""
    result, exc = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - forwarded to every rank below
        exc = e
    check_all(coord, what, exc)
    return result  # type: ignore[return-value]


def pack_status(payload: bytes | None, exc: BaseException | None) -> bytes:
    """An ok/error envelope for one-to-many messages (scatter, broadcast)."""
    return _status(exc) if exc is not None else _OK + (payload or b"")


def unpack_status(msg: bytes, coord: Coordinator, what: str, src: int) -> bytes:
    if msg[:1] == _ERR:
        text = msg[1:].decode("utf-8", "replace")
        raise RemoteRankError(f"{what} failed on rank {src}: {text.split(chr(10), 1)[-1]}", {src: text})
    return msg[1:]


def all_gather_checked(coord: Coordinator, what: str, fn: Callable[[], bytes]) -> list[bytes]:
    """Every rank computes ``fn()`` and receives everyone's result; an error anywhere raises everywhere."""
    payload, exc = None, None
    try:
        payload = fn()
    except Exception as e:  # noqa: BLE001 - forwarded to every rank
        exc = e
    if raised_everywhere(exc):
        raise exc
    msgs = coord.all_gather(pack_status(payload, exc))
    raise_remote(msgs, coord, what, exc)
    return [m[1:] for m in msgs]


def broadcast_checked(coord: Coordinator, what: str, fn: Callable[[], bytes] | None, src: int = 0,
                      local: BaseException | None = None) -> bytes:
    """``src`` computes ``fn()`` and sends it to all; an error on ``src`` raises everywhere.

    ``local`` is an error this rank already had: it is raised here (after the broadcast) in preference
    to the remote one, so the failing rank reports its own exception.
    """
    msg, exc = None, None
    if coord.rank == src:
        try:
            payload = fn() if fn is not None else b""
            msg = pack_status(payload, None)
        except Exception as e:  # noqa: BLE001
            exc = e
            msg = pack_status(None, e)
    out = coord.broadcast(msg, src)
    if exc is not None:
        raise local if local is not None else exc
    if out[:1] == _ERR:
        if local is not None:
            raise local
        return unpack_status(out, coord, what, src)
    return out[1:]
