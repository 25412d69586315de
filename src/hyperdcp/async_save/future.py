"""The handle :func:`hyperdcp.async_save` returns, and the errors of async saves."""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..errors import CheckpointError, CoordinationError
from ..saving import SaveResult


class AsyncSaveError(CheckpointError):
    """An async save failed in its persist process; ``remote_traceback`` holds that process's traceback."""

    remote_traceback: str = ""
    original_type: str = ""


class SaveInProgressError(AsyncSaveError):
    """An async save is already in flight on this rank and the caller asked not to wait for it."""


class PersistProcessDiedError(AsyncSaveError, CoordinationError):
    """The persist process of this rank died during a save."""


class PersistProcessStuckError(PersistProcessDiedError):
    """The persist process of this rank was stopped or blocked in the kernel without progress (see
    :meth:`~hyperdcp.async_save.persist_process.PersistWorker.stuck`); it was killed, the save not committed."""


class AsyncSaveTimeoutError(AsyncSaveError, TimeoutError):
    """``SaveFuture.result(timeout)`` expired; the save itself goes on."""


class RemoteTraceback(Exception):
    """Carries the persist process's formatted traceback as the ``__cause__`` of the raised error."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\"\"\"\n" + self.tb + "\"\"\""


class SaveFuture:
    """The result of one async save on this rank.

    ``result()`` returns the :class:`~hyperdcp.SaveResult` once the checkpoint is committed on every
    rank, or raises the save's error (the same error on every rank: the failing rank's own exception,
    the others a :class:`~hyperdcp.RemoteRankError` naming it).
    """

    def __init__(self, path: str, rank: int, seq: int, blocking_seconds: float, first_call: bool):
        self.path = path
        self.rank = rank
        self.seq = seq
        #: seconds async_save blocked the caller (staging), and whether it had to allocate the staging area
        self.blocking_seconds = blocking_seconds
        self.first_call = first_call
        #: pid of the persist process handling the save (for diagnostics)
        self.worker_pid: int | None = None
        self._event = threading.Event()
        self._result: SaveResult | None = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[["SaveFuture"], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._event.is_set()

    #: set by the session: called about twice a second while waiting; fails the save if its persist process is stuck
    _watch: Callable[[], None] | None = None

    def wait(self, timeout: float | None = None) -> bool:
        if self._watch is None:
            return self._event.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if self._event.wait(0.5 if left is None else max(0.0, min(0.5, left))):
                return True
            if left is not None and left <= 0.5:
                return self._event.is_set()
            self._watch()

    def result(self, timeout: float | None = None) -> SaveResult:
        if not self.wait(timeout):
            raise AsyncSaveTimeoutError(
                f"the async save to {self.path!r} (rank {self.rank}) is not finished after {timeout}s; it goes on in "
                "the background: call result() again, or raise the timeout"
            )
        if self._exc is not None:
            raise self._exc
        assert self._result is not None
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.wait(timeout):
            raise AsyncSaveTimeoutError(f"the async save to {self.path!r} is not finished after {timeout}s")
        return self._exc

    def add_done_callback(self, fn: Callable[["SaveFuture"], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, result: SaveResult | None, exc: BaseException | None) -> None:
        with self._lock:
            if self._event.is_set():
                return  # the first outcome stands (e.g. "stuck", then "died" once it is killed)
            self._result, self._exc = result, exc
            self._event.set()
            cbs, self._callbacks = self._callbacks, []
        for cb in cbs:
            try:
                cb(self)
            except Exception:  # noqa: BLE001 - a callback's error must not break the save machinery
                pass

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exc else "committed")
        return f"<SaveFuture {self.path!r} rank {self.rank} {state}>"
