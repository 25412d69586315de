"""One request for adjacent reads of one file: a read-once batch's units, coalesced for object stores.

A reader's units in a batch are often back to back in one data file (consecutive chunks of a rank's
file). On an object store each read is a ranged GET with its own latency and cost (and a server such as
moto copies the whole object per GET), so :class:`CoalescedReads` wraps the batch's reader: units whose
byte ranges touch, in one file, up to ``limit`` bytes together, are fetched by the first of them to read
as one ``read_into`` into a run buffer, and each unit then copies its range out of it. Exactly the same
bytes are read (read amplification unchanged); the run buffer is dropped once every unit took its part,
so memory grows by at most one run (``limit``) per reading thread.

    files = CoalescedReads(files, [(file, offset, nbytes), ...], limit)   # this batch's reads
    read_chunk(files, ...)                                                # as with ``files`` itself

When the spans' own buffers lie in one ``target`` buffer in file order (``at``: each span's position in it,
as read-once's shared-memory slots do), a run is read straight into that part of ``target`` and its units
find their bytes in place: no run buffer, no copy.

A run's file is checked (``files.fd``) by the thread that fetches the run, under the run's lock, with the
run as the first read, so a remote reader can fold the check and the run into one request while the run's
other units wait for it; ``fd`` of a unit in a run returns at once. Sizes come from the metadata and are
bounded by ``limit``: no buffer larger than one run is allocated before its file was checked.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from ..core.buffers import copy_into, same_memory


def _never(fidx: int) -> bool:
    return False


class _Run:
    def __init__(self, fidx: int, start: int, end: int, count: int, into: np.ndarray | None = None):
        self.fidx, self.start, self.end, self.left = fidx, start, end, count
        self.data: np.ndarray | None = None
        self.into = into  # where the run's units' own buffers lie, back to back (None: a run buffer)
        self.lock = threading.Lock()


class CoalescedReads:
    """``files`` whose reads of the listed spans come from one request per run of adjacent spans."""

    def __init__(self, files: Any, spans: Sequence[tuple[int, int, int]], limit: int,
                 target: np.ndarray | None = None, at: Sequence[int] | None = None):
        self.files = files
        self._runs: dict[tuple[int, int, int], _Run] = {}
        cur: list[tuple[int, int, int]] = []
        where = {s: a for s, a in zip(spans, at)} if target is not None and at is not None else {}

        def flush() -> None:
            if len(cur) > 1:
                start, end = cur[0][1], cur[-1][1] + cur[-1][2]
                into = None
                p0 = where.get(cur[0], -1)
                if p0 >= 0 and p0 + end - start <= len(target) and all(  # type: ignore[arg-type]
                        where.get(s, -1) == p0 + s[1] - start for s in cur):
                    into = target[p0 : p0 + end - start]  # type: ignore[index]
                run = _Run(cur[0][0], start, end, len(cur), into)
                for s in cur:
                    self._runs[s] = run
            cur.clear()

        for s in sorted(set(spans)):
            f, off, n = s
            if cur and (f != cur[-1][0] or off != cur[-1][1] + cur[-1][2] or off + n - cur[0][1] > limit):
                flush()
            cur.append(s)
        flush()

    @property
    def runs(self) -> int:
        """Spans read together (for tests and profiles)."""
        return len({id(r) for r in self._runs.values()})

    def fd(self, fidx: int, first: tuple[int, int] | None = None, into=None) -> int:
        if first is not None and (fidx, first[0], first[1]) in self._runs:
            return fidx  # a run's file is checked by the run's reader, under the run's lock (read_into)
        return self.files.fd(fidx, first, into)

    def path(self, fidx: int) -> str:
        return self.files.path(fidx)

    def read_into(self, fidx: int, offset: int, out, what: str = "") -> None:
        mv = memoryview(out).cast("B")
        run = self._runs.get((fidx, offset, len(mv)))
        if run is None:
            return self.files.read_into(fidx, offset, out, what)
        if run.into is not None:
            return self._read_in_place(run, offset, mv, what)
        with run.lock:
            if run.data is None:
                # the check, and with it (when the file allows) this run's bytes in one request, under the run's
                # lock: the run's other units wait here instead of requesting it again. While another thread
                # checks the file, the run's request goes out at once (the reader hands the bytes over once the
                # check passed)
                if not getattr(self.files, "check_in_flight", _never)(fidx):
                    self.files.fd(fidx, (run.start, run.end - run.start))
                fetch = getattr(self.files, "read_bytes", None)  # the reader's own buffer: no copy into ours
                if fetch is not None:
                    data = np.frombuffer(fetch(fidx, run.start, run.end - run.start, what), dtype=np.uint8)
                else:
                    data = np.empty(run.end - run.start, dtype=np.uint8)
                    self.files.read_into(fidx, run.start, data, what)  # raises: the next unit tries again
                run.data = data
            data = run.data
            run.left -= 1
            if run.left == 0:
                run.data = None
        copy_into(mv, data[offset - run.start : offset - run.start + len(mv)])

    def _read_in_place(self, run: _Run, offset: int, mv: memoryview, what: str) -> None:
        with run.lock:
            if run.data is None:  # the run straight into its units' buffers; the file's check folded in when it can
                self.files.read_into(run.fidx, run.start, run.into, what)  # raises: the next unit tries again
                run.data = run.into
            run.left -= 1
            if run.left == 0:
                run.data = None
        part = run.into[offset - run.start : offset - run.start + len(mv)]  # type: ignore[index]
        if not same_memory(part, mv):  # a unit whose buffer is not where ``at`` said
            copy_into(mv, part)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.files, name)


__all__ = ["CoalescedReads"]
