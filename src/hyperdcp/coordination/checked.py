"""The error-carrying steps every save and load is built from.

Each step is a collective in which an exception on one rank is raised on every rank (as
:class:`~hyperdcp.errors.RemoteRankError` naming the failing rank, or the original exception on the
rank where it happened) instead of leaving the others waiting for it:

- :func:`run_checked`: every rank runs a function, then one one-flag collective (texts only on failure);
- :func:`all_gather_checked`: every rank computes bytes and receives everyone's;
- :func:`broadcast_checked`: one rank computes bytes and sends them to all;
- :func:`gather_checked`: every rank computes bytes for one rank; errors surface at the next step;
- :func:`plan_and_scatter`: every rank sends bytes to one rank, which computes a part for each rank;
- :func:`check_all`: every rank reports its own error (or None).

Call order: every rank calls the same steps in the same order. An error that every rank already raised
at the same step is marked with :meth:`RaisedEverywhere.mark`, so enclosing steps do not exchange it
again (a rank that already left could not answer). Messages are an ok/error byte plus the payload or the
error text (:func:`encode_status`, :func:`pack_status`); nothing is unpickled.
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

from ..errors import RemoteRankError

if TYPE_CHECKING:  # base.py re-exports these names, so this module must not import it at run time
    from .base import Coordinator

T = TypeVar("T")

_OK, _ERR = b"\x00", b"\x01"


class RaisedEverywhere:
    """The marker of an error that every rank raises at the same step.

    It is an attribute on the exception itself (its type is unchanged, so callers catch what they
    always caught): :meth:`mark` sets it, :meth:`on` reads it.
    """

    ATTR = "_hyperdcp_everywhere"

    @staticmethod
    def mark(exc: BaseException) -> BaseException:
        """Mark ``exc`` as raised on every rank; returns it (``raise RaisedEverywhere.mark(e)``)."""
        try:
            setattr(exc, RaisedEverywhere.ATTR, True)
        except AttributeError:
            pass
        return exc

    @staticmethod
    def on(exc: BaseException | None) -> bool:
        """Whether ``exc`` was marked by :meth:`mark`."""
        return bool(getattr(exc, RaisedEverywhere.ATTR, False))


# the names the modules of the flows used before the marker had a class
_everywhere = RaisedEverywhere.mark
raised_everywhere = RaisedEverywhere.on


def encode_status(exc: BaseException | None) -> bytes:
    """The ok byte, or the error byte followed by ``module.Class`` and the one-line error text."""
    if exc is None:
        return _OK
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return _ERR + f"{type(exc).__module__}.{type(exc).__qualname__}\n{text}".encode("utf-8", "replace")


_status = encode_status  # old private name


def raise_remote(statuses: Sequence[bytes], coord: "Coordinator", what: str, local: BaseException | None) -> None:
    """Raise on every rank if any status is an error; re-raise the local exception where it happened."""
    failed = {r: s[1:].decode("utf-8", "replace") for r, s in enumerate(statuses) if s[:1] == _ERR}
    if not failed:
        return
    if local is not None:
        raise RaisedEverywhere.mark(local)
    first = min(failed)
    detail = failed[first].split("\n", 1)[-1]
    ranks = ", ".join(str(r) for r in sorted(failed)[:16]) + (" ..." if len(failed) > 16 else "")
    raise RaisedEverywhere.mark(RemoteRankError(
        f"{what} failed on rank(s) {ranks} of {coord.world_size}; first error (rank {first}): {detail}",
        failed,
    ))


def check_all(coord: "Coordinator", what: str, exc: BaseException | None) -> None:
    """Every rank calls it with its own error (or None); if any rank had one, raise on every rank.

    The common case costs one one-flag collective; the error texts are exchanged only after a failure.
    """
    if RaisedEverywhere.on(exc):
        raise exc  # type: ignore[misc]
    if coord.any_true(exc is not None):
        raise_remote(coord.all_gather(encode_status(exc)), coord, what, exc)


def run_checked(coord: "Coordinator", what: str, fn: Callable[[], T]) -> T:
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
    return encode_status(exc) if exc is not None else _OK + (payload or b"")


def unpack_status(msg: bytes, coord: "Coordinator", what: str, src: int) -> bytes:
    """The payload of a :func:`pack_status` message from rank ``src``; its error raised as RemoteRankError."""
    if msg[:1] == _ERR:
        text = msg[1:].decode("utf-8", "replace")
        raise RemoteRankError(f"{what} failed on rank {src}: {text.split(chr(10), 1)[-1]}", {src: text})
    return msg[1:]


def all_gather_checked(coord: "Coordinator", what: str, fn: Callable[[], bytes]) -> list[bytes]:
    """Every rank computes ``fn()`` and receives everyone's result; an error anywhere raises everywhere."""
    payload, exc = None, None
    try:
        payload = fn()
    except Exception as e:  # noqa: BLE001 - forwarded to every rank
        exc = e
    if RaisedEverywhere.on(exc):
        raise exc  # type: ignore[misc]
    msgs = coord.all_gather(pack_status(payload, exc))
    raise_remote(msgs, coord, what, exc)
    return [m[1:] for m in msgs]


def gather_checked(coord: "Coordinator", what: str, fn: Callable[[], bytes],
                   dst: int = 0) -> tuple[list[bytes] | None, BaseException | None]:
    """Every rank computes ``fn()``; ``dst`` receives every result. Costs one gather and nothing more, so
    errors are returned, not raised: ``(results, error)`` where ``results`` is the list on ``dst`` (None
    elsewhere) and ``error`` is this rank's own exception, or on ``dst`` the first failing rank's error (as
    RemoteRankError). The caller raises it in its next checked step (typically
    ``broadcast_checked(..., local=error)``), which makes it surface on every rank.
    """
    payload, exc = None, None
    try:
        payload = fn()
    except Exception as e:  # noqa: BLE001 - returned to the caller, raised at its next step
        exc = e
    msgs = coord.gather(pack_status(payload, exc), dst)
    if msgs is None or coord.rank != dst:
        return None, exc
    if exc is None:
        bad = [r for r, m in enumerate(msgs) if m[:1] == _ERR]
        if bad:
            try:
                unpack_status(msgs[bad[0]], coord, what, bad[0])
            except RemoteRankError as e:
                exc = e
    return [m[1:] for m in msgs], exc


def broadcast_checked(coord: "Coordinator", what: str, fn: Callable[[], bytes] | None, src: int = 0,
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


def plan_and_scatter(coord: "Coordinator", what: str, payload: bytes,
                     plan: Callable[[list[bytes]], Sequence[bytes]], src: int = 0) -> bytes:
    """Every rank sends ``payload`` to ``src``, which computes one part per rank with ``plan(payloads)``;
    every rank receives its part. An error in ``plan`` raises on ``src`` itself and, as RemoteRankError
    naming ``src``, on every other rank. Costs one gather and one scatter.
    """
    gathered = coord.gather(payload, src)
    parts, exc = None, None
    if coord.rank == src:
        try:
            parts = [pack_status(p, None) for p in plan(gathered or [])]
            if len(parts) != coord.world_size:
                raise ValueError(f"{what}: the plan made {len(parts)} parts for {coord.world_size} ranks")
        except Exception as e:  # noqa: BLE001 - sent to every rank in the scatter
            exc = e
            parts = [pack_status(None, e)] * coord.world_size
    msg = coord.scatter(parts, src)
    if exc is not None:
        raise exc
    return unpack_status(msg, coord, what, src)
