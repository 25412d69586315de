"""The training process's handle on its persist process (the parent side; the child is :mod:`.child`).

    w = PersistWorker(rank, seq)        # starts ``python -m hyperdcp.async_saving._child <fd>``
    w.submit({"op": "save", ...}, on_reply)   # replies arrive on the worker's reader thread, in order
    w.stuck()                           # polled while someone waits: stopped or blocked without progress
    w.stop()  /  w.kill()

Commands and replies are plain dicts over a socket pair (:class:`multiprocessing.connection.Connection`);
tensor bytes never travel through it (they are in the shared-memory staging area).
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Callable


def _proc_progress(pid: int) -> tuple[str, tuple | None]:
    """(state, progress counters) of a process: 'T' if any thread is stopped, else 'D' if one is in
    uninterruptible sleep, else the main thread's state; counters: I/O characters and CPU ticks."""
    state = "?"
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = [str(pid)]
    states = []
    cpu = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
            states.append(rest[0].decode())
            cpu += int(rest[11]) + int(rest[12])
        except (OSError, IndexError, ValueError):
            continue
    if states:
        state = "T" if any(x in ("T", "t") for x in states) else "D" if "D" in states else states[0]
    io = ()
    try:
        with open(f"/proc/{pid}/io") as f:
            io = tuple(line.split()[1] for line in f if line.startswith(("rchar", "wchar")))
    except OSError:
        pass
    return state, (cpu, io)


class _Pending:
    """One command's reply, filled in by the reader thread."""

    def __init__(self, on_reply=None):
        self.on_reply = on_reply
        self.event = threading.Event()
        self.reply: dict | None = None
        self.exc: BaseException | None = None

    def deliver(self, reply: dict | None, exc: BaseException | None) -> None:
        self.reply, self.exc = reply, exc
        self.event.set()
        if self.on_reply is not None:
            self.on_reply(reply, exc)

    def get(self) -> dict:
        self.event.wait()
        if self.exc is not None:
            raise self.exc
        assert self.reply is not None
        return self.reply


class PersistWorker:
    """Handle on one persist process, owned by a training process."""

    def __init__(self, rank: int, started_at_seq: int):
        import socket

        self.rank = rank
        self.started_at_seq = started_at_seq
        a, b = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hyperdcp.async_saving._child", str(b.fileno())],
                pass_fds=[b.fileno()], env=env, close_fds=True,
            )
        finally:
            b.close()
        self.conn = Connection(a.detach())
        self.lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._reader: threading.Thread | None = None
        self._gone: BaseException | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    #: seconds a persist process may stay stopped, or blocked in the kernel without doing any I/O or
    #: computing, before it counts as stuck (``HYPERDCP_PERSIST_STALL_SECONDS``)
    STALL_SECONDS = 30.0
    _stall_since: float | None = None
    _stall_mark: tuple | None = None

    def stuck(self) -> str | None:
        """Why this persist process is stuck, or None while it is alive and not stuck.

        Stuck: stopped (SIGSTOP, a debugger) or with a thread in uninterruptible sleep ('D': e.g. a write to
        a hung network file system) while its I/O and CPU counters do not move, for ``STALL_SECONDS``. A
        process waiting for a peer sleeps interruptibly and is never stuck here (the save's timeout bounds it).
        """
        if not self.alive():
            return None
        limit = float(os.environ.get("HYPERDCP_PERSIST_STALL_SECONDS") or self.STALL_SECONDS)
        state, mark = _proc_progress(self.pid)
        blocked = state in ("T", "t") or (state == "D" and mark == self._stall_mark)
        now = time.monotonic()
        self._stall_mark = mark
        if not blocked:
            self._stall_since = None
            return None
        if self._stall_since is None:
            self._stall_since = now
        if now - self._stall_since < limit:
            return None
        what = ("is stopped (SIGSTOP or a debugger)" if state in ("T", "t") else
                "is blocked in the kernel without any I/O (a write stuck on a network file system?)")
        return f"the persist process of rank {self.rank} (pid {self.pid}) {what} for {now - self._stall_since:.0f}s"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_description(self) -> str:
        try:
            code = self.proc.wait(timeout=5)  # the socket can close a moment before the process is reaped
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return "is still running"
        if code < 0:
            import signal

            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            return f"was killed by signal {name}"
        return f"exited with code {code}"

    def submit(self, msg: dict,
               on_reply: Callable[[dict | None, BaseException | None], None] | None = None) -> _Pending:
        """Send one command; its reply is delivered by this worker's reader thread (``on_reply`` runs there).

        The calling thread only pickles and sends: no other thread is woken (waking one costs the caller
        a GIL hand-off, milliseconds on a loaded machine). The child answers commands in order, so the
        reader thread matches replies to commands by position.
        """
        pend = _Pending(on_reply)
        with self.lock:
            if self._reader is None:
                self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                                name=f"hyperdcp-persist-reader-rank{self.rank}")
                self._reader.start()
            if self._gone is not None:
                err: BaseException | None = self._gone
            else:
                self._pending.append(pend)
                try:
                    self.conn.send(msg)
                    err = None
                except (OSError, EOFError, ValueError) as e:
                    self._pending.remove(pend)
                    err = EOFError(str(e))
        if err is not None:
            pend.deliver(None, err)
        return pend

    def request(self, msg: dict) -> dict:
        """Send one command and wait for its reply; raise EOFError if the process dies first."""
        return self.submit(msg).get()

    def _read_loop(self, poll: float = 0.2) -> None:
        while True:
            try:
                ready = self.conn.poll(poll)
                reply = self.conn.recv() if ready else None
            except (EOFError, OSError, ValueError):
                break  # the child died (or this end was closed)
            if reply is not None:
                with self.lock:
                    pend = self._pending.popleft() if self._pending else None
                if pend is not None:
                    pend.deliver(reply, None)
                continue
            if not self.alive():
                try:
                    if self.conn.poll(0):
                        continue  # read what it sent before dying
                except (EOFError, OSError, ValueError):
                    pass
                break
        with self.lock:
            self._gone = EOFError("the persist process is gone")
            pending, self._pending = list(self._pending), collections.deque()
        for pend in pending:
            pend.deliver(None, EOFError(self.exit_description()))

    def stop(self, timeout: float = 10.0) -> None:
        try:
            if self.alive():
                self.conn.send({"op": "stop"})
                self.proc.wait(timeout=timeout)
        except Exception:  # noqa: BLE001
            pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001
                pass
        try:
            self.conn.close()
        except OSError:
            pass

