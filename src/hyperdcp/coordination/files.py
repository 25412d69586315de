"""A :class:`~hyperdcp.coordination.base.Coordinator` over a shared directory (no process group).

Every collective is numbered; each message is written to a temporary name, fsynced and renamed to
``<op>-<kind>-<rank>.msg``, so a reader never sees a partial file. Readers poll with exponential backoff
(1 ms up to 50 ms) and give up after ``timeout`` seconds with an error naming the ranks that never wrote.
A rank whose persist process died is announced by an ``abort-<rank>`` file (written by its training
process); readers that see one fail at once instead of waiting out the timeout.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

from ..errors import CoordinationError
from .base import Coordinator


class FileCoordinator(Coordinator):
    def __init__(self, directory: str, rank: int, world_size: int, timeout: float = 600.0):
        self.dir = directory
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._op = 0
        os.makedirs(directory, exist_ok=True)

    # -- files -----------------------------------------------------------------------------
    def _name(self, op: int, kind: str, rank: int) -> str:
        return os.path.join(self.dir, f"{op:06d}-{kind}-{rank}.msg")

    def _write(self, name: str, data: bytes) -> None:
        tmp = os.path.join(self.dir, f".tmp-{os.path.basename(name)}-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, name)

    def _check_abort(self) -> None:
        try:
            aborts = [e for e in os.listdir(self.dir) if e.startswith("abort-")]
        except FileNotFoundError:
            raise CoordinationError(
                f"the exchange directory {self.dir!r} disappeared; was it removed by hand?"
            ) from None
        if aborts:
            r = aborts[0].split("-", 1)[1]
            try:
                with open(os.path.join(self.dir, aborts[0]), "rb") as f:
                    why = f.read().decode("utf-8", "replace")
            except OSError:
                why = ""
            raise CoordinationError(f"rank {r} abandoned the save: {why or 'its persist process died'}")

    def _read(self, names: dict[int, str], what: str) -> dict[int, bytes]:
        out: dict[int, bytes] = {}
        deadline = time.monotonic() + self.timeout
        delay, polls = 0.001, 0
        while True:
            for r, n in list(names.items()):
                if r in out:
                    continue
                try:
                    with open(n, "rb") as f:
                        out[r] = f.read()
                except FileNotFoundError:
                    pass
            if len(out) == len(names):
                return out
            polls += 1
            if polls % 8 == 0 or delay >= 0.05:  # at the slowest poll rate, every poll (one listdir)
                self._check_abort()
            if time.monotonic() > deadline:
                self._check_abort()
                missing = sorted(set(names) - set(out))
                raise CoordinationError(
                    f"{what}: rank(s) {missing[:16]} wrote nothing to {self.dir!r} within {self.timeout:.0f}s; "
                    "their persist processes are slow, stuck or dead (check those ranks' logs), or the directory is "
                    "not shared between all ranks (pass an exchange_dir on a shared file system)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _next(self) -> int:
        self._op += 1
        return self._op

    # -- collectives ---------------------------------------------------------------------
    def all_gather(self, data: bytes) -> list[bytes]:
        op = self._next()
        self._write(self._name(op, "ag", self.rank), data)
        got = self._read({r: self._name(op, "ag", r) for r in range(self.world_size)}, f"exchange {op} (all_gather)")
        return [got[r] for r in range(self.world_size)]

    def gather(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        op = self._next()
        self._write(self._name(op, "ga", self.rank), data)
        if self.rank != dst:
            return None
        got = self._read({r: self._name(op, "ga", r) for r in range(self.world_size)}, f"exchange {op} (gather)")
        return [got[r] for r in range(self.world_size)]

    def scatter(self, parts: Sequence[bytes] | None, src: int = 0) -> bytes:
        op = self._next()
        if self.rank == src:
            for r, p in enumerate(parts):
                self._write(self._name(op, "sc", r), bytes(p))
        return self._read({self.rank: self._name(op, "sc", self.rank)},
                          f"exchange {op} (scatter from rank {src})")[self.rank]

    def broadcast(self, data: bytes | None, src: int = 0) -> bytes:
        op = self._next()
        name = self._name(op, "bc", src)
        if self.rank == src:
            self._write(name, bytes(data or b""))
            return bytes(data or b"")
        return self._read({src: name}, f"exchange {op} (broadcast from rank {src})")[src]

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} (files in {self.dir})"


def write_abort(directory: str, rank: int, why: str) -> None:
    """Tell the other ranks' persist processes that this rank will never write again in this save."""
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".tmp-abort-{rank}")
        with open(tmp, "w") as f:
            f.write(why)
        os.rename(tmp, os.path.join(directory, f"abort-{rank}"))
    except OSError:
        pass
