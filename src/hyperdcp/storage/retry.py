"""Retrying object-store requests: exponential backoff with full jitter, within a bounded total time.

    policy = RetryPolicy(attempts=8, total_seconds=120)
    data = policy.call(lambda: client.get_range(key, 0, n), f"reading {url}")

A request is retried only when :func:`retryable` says so (throttling, 5xx, timeouts, connection resets
and other transport errors); a 4xx answer (missing object, failed precondition, bad credentials) is
raised at once. When the attempts or the time run out, :class:`~hyperdcp.errors.StorageError` names the
object, the number of attempts and the last error.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from ..errors import StorageError

T = TypeVar("T")

#: HTTP statuses worth another attempt: request timeout, throttling, server errors
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
#: S3 error codes that mean "slow down / try again", whatever the status
RETRY_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                         "ServiceUnavailable", "RequestTimeTooSkewed", "503", "500"})


def status_of(e: BaseException) -> int | None:
    """The HTTP status an exception carries (botocore ClientError, aiohttp), else None."""
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        st = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if st is not None:
            return int(st)
    st = getattr(e, "status", None)
    return int(st) if isinstance(st, int) else None


def code_of(e: BaseException) -> str:
    """The S3 error code of a botocore ClientError ("NoSuchKey", "PreconditionFailed", ...), else ""."""
    resp = getattr(e, "response", None)
    return str(resp.get("Error", {}).get("Code", "")) if isinstance(resp, dict) else ""


def retryable(e: BaseException) -> bool:
    """Whether another attempt may succeed: throttling, 5xx, or a transport failure (reset, timeout, refused)."""
    if isinstance(e, StorageError):
        return False
    st = status_of(e)
    if st is not None:
        return st in RETRY_STATUSES or code_of(e) in RETRY_CODES
    if code_of(e) in RETRY_CODES:
        return True
    if isinstance(e, (ConnectionError, TimeoutError)):  # resets, refused, broken pipes, timeouts
        return True
    names = {c.__name__ for c in type(e).__mro__}
    # botocore / aiohttp / obstore transport errors, by name (those packages are optional)
    transport = {"EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
                 "ResponseStreamingError", "IncompleteReadError", "ClientPayloadError", "ServerDisconnectedError",
                 "ClientConnectionError", "ClientOSError", "ProtocolError", "HTTPClientError", "IncompleteRead"}
    if names & transport:
        return True
    if "GenericError" in names:  # obstore: the message carries the cause
        msg = str(e).lower()
        return any(s in msg for s in ("connection", "timed out", "reset", "status code: 5",
                                      "503", "500", "broken pipe"))
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """At most ``attempts`` tries and ``total_seconds`` in all; sleeps ``base * 2**i`` (jittered, capped at ``cap``)."""

    attempts: int = 8
    total_seconds: float = 120.0
    base_seconds: float = 0.05
    cap_seconds: float = 5.0

    @classmethod
    def from_env(cls) -> "RetryPolicy":
        """The default policy, overridden by ``HYPERDCP_S3_RETRIES`` / ``HYPERDCP_S3_RETRY_SECONDS``."""
        return cls(attempts=max(1, int(os.environ.get("HYPERDCP_S3_RETRIES", cls.attempts))),
                   total_seconds=float(os.environ.get("HYPERDCP_S3_RETRY_SECONDS", cls.total_seconds)))

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap_seconds, self.base_seconds * (2 ** attempt)))

    def call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()``, retried on :func:`retryable` errors; StorageError naming ``what`` once the budget is spent."""
        deadline = time.monotonic() + self.total_seconds
        for attempt in range(self.attempts):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified below
                if not retryable(e):
                    raise
                last = e
                pause = self.delay(attempt)
                if attempt + 1 >= self.attempts or time.monotonic() + pause > deadline:
                    break
                time.sleep(pause)
        raise StorageError(
            f"{what} failed after {attempt + 1} attempt(s) within {self.total_seconds:g} s "
            f"({type(last).__name__}: {str(last)[:300]}); check the endpoint, the network and the store's health, then "
            "retry (HYPERDCP_S3_RETRIES / HYPERDCP_S3_RETRY_SECONDS raise the budget)"
        ) from last


__all__ = ["RETRY_STATUSES", "RetryPolicy", "code_of", "retryable", "status_of"]
