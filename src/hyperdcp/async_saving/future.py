"""The handle :func:`hyperdcp.async_save` returns (the errors of async saves live in :mod:`hyperdcp.errors`)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable

from ..errors import (  # noqa: F401 - re-exported
    AsyncSaveError,
    AsyncSaveTimeoutError,
    PersistProcessDiedError,
    PersistProcessStuckError,
    SaveInProgressError,
)
from ..saving import SaveResult


class RemoteTraceback(Exception):
    """Carries the persist process's formatted traceback as the ``__cause__`` of the raised error."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\"\"\"\n" + self.tb + "\"\"\""


class SaveFuture(concurrent.futures.Future):
    """The result of one async save on this rank: a :class:`concurrent.futures.Future`.

    ``result()`` returns the :class:`~hyperdcp.SaveResult` once the checkpoint is committed on every
    rank, or raises the save's error (the same error on every rank: the failing rank's own exception,
    the others a :class:`~hyperdcp.RemoteRankError` naming it). ``result(timeout)`` and
    ``exception(timeout)`` raise :class:`AsyncSaveTimeoutError` (a ``TimeoutError``) when it is not done
    yet; the save goes on. A save cannot be cancelled (``cancel()`` returns False): it is running from
    the moment ``async_save`` returns.
    """

    def __init__(self, path: str, rank: int, seq: int, blocking_seconds: float, first_call: bool):
        super().__init__()
        self.set_running_or_notify_cancel()  # running from the start: cancel() returns False
        self.path = path
        self.rank = rank
        self.seq = seq
        #: seconds async_save blocked the caller (staging), and whether it had to allocate the staging area
        self.blocking_seconds = blocking_seconds
        self.first_call = first_call
        #: pid of the persist process handling the save (for diagnostics)
        self.worker_pid: int | None = None
        self._finish_lock = threading.Lock()

    @property
    def _exc(self) -> BaseException | None:
        """The save's error once done (None while pending or after success)."""
        return self._exception

    #: set by the session: called about twice a second while waiting; fails the save if its persist process is stuck
    _watch: Callable[[], None] | None = None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the save is done; True when it is.

        While waiting, the session's watch (``_watch``) runs about twice a second and fails the save
        when its persist process is stuck, so no wait is unbounded."""
        if self._watch is None:
            done, _ = concurrent.futures.wait([self], timeout)
            return bool(done)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            done, _ = concurrent.futures.wait([self], 0.5 if left is None else max(0.0, min(0.5, left)))
            if done:
                return True
            if left is not None and left <= 0.5:
                return self.done()
            self._watch()

    def result(self, timeout: float | None = None) -> SaveResult:
        if not self.wait(timeout):
            raise AsyncSaveTimeoutError(
                f"the async save to {self.path!r} (rank {self.rank}) is not finished after {timeout}s; it goes on in "
                "the background: call result() again, or raise the timeout"
            ) from None
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.wait(timeout):
            raise AsyncSaveTimeoutError(
                f"the async save to {self.path!r} (rank {self.rank}) is not finished after {timeout}s"
            ) from None
        return super().exception(0)

    def _finish(self, result: SaveResult | None, exc: BaseException | None) -> None:
        with self._finish_lock:
            if self.done():
                return  # the first outcome stands (e.g. "stuck", then "died" once it is killed)
            if exc is not None:
                self.set_exception(exc)
                return
            from ..logs import log_save

            log_save(result, asynchronous=True)
            self.set_result(result)

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exception else "committed")
        return f"<SaveFuture {self.path!r} rank {self.rank} {state}>"
