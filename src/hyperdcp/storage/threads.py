"""Running independent I/O jobs on a few threads (file reads, writes and checksums release the GIL)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

J = TypeVar("J")
R = TypeVar("R")


def run_all(fn: Callable[[J], R], jobs: Iterable[J], threads: int) -> list[R]:
    """``[fn(j) for j in jobs]`` on up to ``threads`` threads (inline for one thread or one job).

    The first exception raised by a job is re-raised once every started job has finished.
    """
    jobs = list(jobs)
    if threads <= 1 or len(jobs) <= 1:
        return [fn(j) for j in jobs]
    with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix="hyperdcp-io") as ex:
        return list(ex.map(fn, jobs))
