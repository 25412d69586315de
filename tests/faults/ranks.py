"""Spawn N local gloo ranks and collect what each returns, tolerating ranks that die or are killed.

Unlike tests/dist.run_ranks (which fails on any dead rank), :func:`start` returns the processes so a
campaign can kill them, and :func:`collect` returns per-rank outcomes: ("ok", value), ("error", text)
or ("dead", exitcode) / ("hung", None).
"""

from __future__ import annotations

import os
import queue as _queue
import tempfile
import time

from tests.dist import _context, _entry


class Ranks:
    def __init__(self, world: int, fn, *args, env: dict | None = None):
        ctx = _context()
        self.q = ctx.Queue()
        fd, self.store = tempfile.mkstemp(prefix="hyperdcp-store-")
        os.close(fd)
        os.unlink(self.store)
        self.procs = [ctx.Process(target=_entry,
                                  args=(fn, r, world, self.store, self.q, args, {**os.environ, **(env or {})}),
                                  daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.world = world
        self.out: dict[int, tuple[str, object]] = {}

    def collect(self, timeout: float) -> dict[int, tuple[str, object]]:
        deadline = time.monotonic() + timeout
        while len(self.out) < self.world and time.monotonic() < deadline:
            try:
                rank, ok, val = self.q.get(timeout=0.2)
                self.out[rank] = ("ok" if ok else "error", val)
            except _queue.Empty:
                pass
            live = [r for r in range(self.world) if r not in self.out and self.procs[r].exitcode is None]
            if not live and self.q.empty():
                time.sleep(0.2)
                if self.q.empty():
                    break
        for r, p in enumerate(self.procs):
            if r not in self.out:
                self.out[r] = ("dead", p.exitcode) if p.exitcode is not None else ("hung", None)
        return self.out

    def kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        if os.path.exists(self.store):
            os.unlink(self.store)
