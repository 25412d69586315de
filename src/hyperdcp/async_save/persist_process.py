"""The long-lived persist process of one rank, and its command protocol.

The training process starts it once (a fresh interpreter, ``python -m hyperdcp.async_save._child``:
nothing is forked from a process holding CUDA/NCCL state, and the user's ``__main__`` is not re-run) and
talks to it over a socket pair with :class:`multiprocessing.connection.Connection`. Messages are plain
dicts of str/int/float/bytes/lists; tensor bytes never travel through the pipe: they are read from the
shared-memory staging area.

Commands (parent -> child): ``{"op": "save", ...}`` (fields documented in :func:`_save`) and
``{"op": "stop"}``. Replies (child -> parent): ``{"ok": True, "result": {...}, "cache": [...]}`` or
``{"ok": False, "type", "module", "message", "traceback", "rank_errors"}``.

The child exits when its parent disappears (a watchdog thread), so a killed training process never
leaves persist processes behind.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

import numpy as np

# --------------------------------------------------------------------------------------------
# child side
# --------------------------------------------------------------------------------------------
_STATE: dict[str, Any] = {"pg_prefix": None, "area": None, "cache": None, "known": set()}


def _gloo_coordinator(msg: dict):
    """The persist processes' gloo group, re-formed when any rank needs it (agreed through the TCPStore).

    Each save starts with a vote in the store served by the rank-0 training process (a handful of
    store operations per rank, in this process, never on the training path): a rank votes for a new group when
    its process is new (no group yet) or its last save failed (the group may be left unusable). If any
    rank voted so, every rank destroys its group and joins a new one under the prefix ``g<seq>``; save
    numbers are the same on every rank (every rank calls async_save in the same order), so all ranks
    agree on the prefix. Ranks therefore never disagree about restarting: the decision is the count of
    votes, read by every rank after all ranks voted.
    """
    from datetime import timedelta

    import torch.distributed as dist

    from ..coordination.torch_dist import TorchCoordinator

    timeout = timedelta(seconds=float(msg.get("timeout") or 600))
    store = _STATE.get("store")
    if store is None:
        store = _STATE["store"] = dist.TCPStore(msg["host"], int(msg["port"]), is_master=False, timeout=timeout)
    base, seq, W = msg["rdzv_prefix"], int(msg["seq"]), int(msg["world_size"])
    vote = f"{base}/vote/{seq}"
    want = 1 if (_STATE["pg_prefix"] is None or _STATE.get("group_suspect")) else 0
    rank = int(msg["rank"])
    store.set(f"{vote}/in/{rank}", b"1")  # who arrived: to name the missing ranks if the vote times out
    store.add(f"{vote}/new-group", want)
    if store.add(f"{vote}/arrived", 1) == W:
        store.set(f"{vote}/decided", b"1")
        # every rank has left the previous vote (it is in this one): its shared keys can go
        for k in ("new-group", "arrived", "decided"):
            try:
                store.delete_key(f"{base}/vote/{seq - 1}/{k}")
            except Exception:  # noqa: BLE001 - a leftover key is harmless
                pass
    try:
        store.delete_key(f"{base}/vote/{seq - 1}/in/{rank}")
    except Exception:  # noqa: BLE001
        pass
    try:
        store.wait([f"{vote}/decided"], timeout)
    except Exception as e:  # noqa: BLE001 - name who never arrived
        from ..errors import CoordinationError

        missing = []
        try:
            for r in range(W):
                if not store.check([f"{vote}/in/{r}"]):
                    missing.append(r)
                    if len(missing) >= 16:
                        break
        except Exception:  # noqa: BLE001
            pass
        raise CoordinationError(
            f"rank {rank}: saving {msg['path']!r}: rank(s) {missing or '?'} did not start this save within "
            f"{timeout.total_seconds():.0f}s (their training processes did not call async_save, or their persist "
            f"processes are stuck or dead); nothing was committed"
        ) from e
    if store.add(f"{vote}/new-group", 0) > 0:
        if _STATE["pg_prefix"] is not None:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group is replaced anyway
                pass
            _STATE["pg_prefix"] = None
        prefix = f"{base}/g{seq}"
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=msg["rank"], world_size=W,
                                timeout=timeout)
        _STATE["pg_prefix"] = prefix
    _STATE["group_suspect"] = True  # until this save succeeds
    return TorchCoordinator()


def _watch_abort(msg: dict, conn: Connection, send_lock: threading.Lock, stop: threading.Event) -> None:
    """Gloo mode: a dead peer persist process is announced in the TCPStore by its training process.

    A collective blocked on that peer may never return, so this thread reports the error to the
    training process and ends this (now unusable) persist process; the next save starts a new one.
    """
    from datetime import timedelta

    import torch.distributed as dist

    key = f"hyperdcp-abort/{msg['rdzv_prefix']}/{msg['seq']}"  # the same on every rank
    try:
        store = dist.TCPStore(msg["host"], int(msg["port"]), is_master=False, timeout=timedelta(seconds=30))
    except Exception:  # noqa: BLE001 - no watcher; the group's timeout still bounds the wait
        return
    while not stop.wait(0.2):
        try:
            if not store.check([key]):
                continue
            why = store.get(key).decode("utf-8", "replace")
        except Exception:  # noqa: BLE001
            return
        with send_lock:
            if stop.is_set():
                return
            try:
                conn.send({"ok": False, "type": "CoordinationError", "module": "hyperdcp.errors",
                           "message": f"rank {msg['rank']}: the save of {msg['path']!r} was abandoned: {why}",
                           "traceback": "", "rank_errors": {}})
            finally:
                os._exit(1)


def _explain_gloo_failure(msg: dict, e: BaseException, wait: float = 3.0) -> BaseException:
    """A collective that failed because a peer persist process died ("connection closed by peer") names no
    rank; the dead rank's training process announces it in the store within a second or so (its abort
    watcher races with gloo's own error): wait briefly for that announcement and report it instead."""
    from ..errors import CoordinationError, RemoteRankError

    store = _STATE.get("store")
    if store is None or isinstance(e, RemoteRankError) or getattr(e, "rank_errors", None):
        return e
    key = f"hyperdcp-abort/{msg['rdzv_prefix']}/{msg['seq']}"
    deadline = time.monotonic() + wait
    try:
        while time.monotonic() < deadline:
            if store.check([key]):
                why = store.get(key).decode("utf-8", "replace")
                err = CoordinationError(f"rank {msg['rank']}: the save of {msg['path']!r} was abandoned: {why}")
                err.__cause__ = e
                return err
            time.sleep(0.05)
    except Exception:  # noqa: BLE001
        pass
    return e


def _area(path: str, nbytes: int):
    from .staging import ShmArea

    cur = _STATE["area"]
    if cur is not None and (cur.path, cur.nbytes) == (path, max(nbytes, 1)):
        return cur
    if cur is not None:
        cur.close()
    _STATE["area"] = ShmArea(nbytes, path=path, readonly=True)
    try:  # mapped: the name can go, so nothing stays in /dev/shm whichever process dies first
        os.unlink(path)
    except OSError:
        pass
    return _STATE["area"]


def _staged(msg: dict):
    from ..core.boxes import Box
    from ..core.shards import LocalShard, ShardedTensor
    from ..format import values as values_codec
    from ..planning.save_plan import LocalPlan
    from ..saving import StagedState

    plan = LocalPlan.from_bytes(msg["plan"])
    area = _area(msg["shm_path"], msg["shm_bytes"])
    offs = np.frombuffer(msg["offsets"], np.int64)
    sizes = np.frombuffer(msg["sizes"], np.int64)
    sts = [ShardedTensor(t.fqn, t.dtype, t.shape) for t in plan.tensors]
    chunks = []
    arr = area.array
    for i in range(len(plan.tidx)):
        st = sts[int(plan.tidx[i])]
        nd = len(st.shape)
        box = Box(tuple(int(x) for x in plan.offsets[i, :nd]), tuple(int(x) for x in plan.lengths[i, :nd]))
        chunks.append((st, LocalShard(box, arr[int(offs[i]) : int(offs[i]) + int(sizes[i])])))
    values = {k: values_codec.decode(v, f"value {k!r}") for k, v in msg["values"].items()}
    return StagedState(plan, chunks, values)


def _inject(fault: dict | None, rank: int) -> None:
    """Test hook: make this rank's persist step fail or stall (``fault`` comes from the test)."""
    if not fault or int(fault.get("rank", -1)) != rank:
        return
    from .. import saving

    orig = saving._write_assigned
    kind = fault.get("kind")

    def faulty(*a, **k):
        if kind == "raise":
            raise RuntimeError(fault.get("message", "injected persist fault"))
        if kind == "stall":
            time.sleep(float(fault.get("seconds", 60)))
        return orig(*a, **k)

    saving._write_assigned = faulty
    _STATE["restore"] = (saving, orig)


def _cleanup_exchange(root: str, world_size: int, keep: str | None) -> None:
    """Remove exchange directories of earlier saves that every rank has finished with."""
    try:
        entries = os.listdir(root)
    except OSError:
        return
    for e in entries:
        d = os.path.join(root, e)
        if d == keep:
            continue
        try:
            done = sum(1 for x in os.listdir(d) if x.startswith("done-"))
        except OSError:
            continue
        if done >= world_size or any(x.startswith("abort-") for x in os.listdir(d)):
            shutil.rmtree(d, ignore_errors=True)
    try:
        os.rmdir(root)
    except OSError:
        pass


def _save(msg: dict) -> dict:
    """Fields: path, rank, world_size, mode ("gloo"|"file"|"none"|"local"), options (SaveOptions fields),
    plan (LocalPlan bytes), shm_path, shm_bytes, offsets, sizes (int64 bytes), values (encoded), cache
    (entries to seed), plus per mode: host/port/rdzv_prefix/timeout (gloo), exchange_dir (file),
    mine/save_id (none); fault (tests only)."""
    from ..coordination.base import LocalCoordinator
    from ..options import SaveOptions
    from ..planning.save_plan import GlobalPlan, PlanCache
    from ..saving import persist
    from .file_coordination import FileCoordinator
    from .rank_files import persist_alone

    if _STATE["cache"] is None:
        _STATE["cache"] = PlanCache()
    cache: PlanCache = _STATE["cache"]
    known: set = _STATE["known"]
    for key, kind, raw in msg.get("cache", []):
        if key not in known:
            cache.put(key, GlobalPlan.from_bytes(raw) if kind == "plan" else np.frombuffer(raw, np.int64).copy())
            known.add(key)
    opts = SaveOptions(**msg["options"])
    if "stage_error" in msg:
        from ..errors import StateDictError

        staged = StateDictError(f"staging on rank {msg['rank']} failed: {msg['stage_error']}")
    else:
        try:
            staged = _staged(msg)
        except Exception as e:  # noqa: BLE001 - persist() reports it to every rank
            if msg["mode"] in ("none", "local"):
                raise
            staged = e
    rank, W, mode = msg["rank"], msg["world_size"], msg["mode"]
    _inject(msg.get("fault"), rank)
    try:
        if mode == "none":
            res = persist_alone(msg["path"], rank, W, staged, np.frombuffer(msg["mine"], np.int64), msg["values"],
                                opts, msg["save_id"])
        else:
            if mode == "gloo":
                coord = _gloo_coordinator(msg)
            elif mode == "file":
                coord = FileCoordinator(msg["exchange_dir"], rank, W, float(msg.get("timeout") or 600))
                if rank == 0:
                    _cleanup_exchange(os.path.dirname(msg["exchange_dir"]), W, msg["exchange_dir"])
            else:
                coord = LocalCoordinator()
            try:
                res = persist(coord, staged, msg["path"], opts, cache)
            finally:
                if mode == "file":  # success or not, this rank is finished with the exchange directory
                    try:
                        with open(os.path.join(msg["exchange_dir"], f"done-{rank}"), "wb"):
                            pass
                    except OSError:
                        pass
            if mode == "gloo":
                _STATE["group_suspect"] = False
    finally:
        restore = _STATE.pop("restore", None)
        if restore is not None:
            setattr(restore[0], "_write_assigned", restore[1])
    back = []
    for key, val in cache.items():
        if key not in known:
            known.add(key)
            if isinstance(val, GlobalPlan):
                back.append((key, "plan", val.to_bytes()))
            else:
                back.append((key, "assign", np.ascontiguousarray(val, np.int64).tobytes()))
    return {
        "result": {"path": res.path, "rank": res.rank, "world_size": res.world_size, "bytes_written": res.bytes_written,
                   "files_written": list(res.files_written), "plan_cache_hit": res.plan_cache_hit, "seconds": res.seconds},
        "cache": back,
    }


def _error_reply(e: BaseException) -> dict:
    if isinstance(e, _Terminated):
        return {"ok": False, "type": "PersistProcessDiedError", "module": "hyperdcp.async_save.future",
                "message": f"{e}; the checkpoint was not committed (its temporary directory and lock were removed; a "
                           "previous checkpoint at that path is intact)", "traceback": "", "rank_errors": {}}
    return {
        "ok": False, "type": type(e).__qualname__, "module": type(e).__module__, "message": str(e),
        "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
        "rank_errors": dict(getattr(e, "rank_errors", {}) or {}),
    }


class _Terminated(BaseException):
    """SIGTERM arrived during a save: unwind it (its temporary directory and lock are removed), then die."""


def _on_sigterm(signum, frame) -> None:
    if _STATE.get("busy") and not _STATE.get("terminating"):
        _STATE["terminating"] = True
        raise _Terminated(f"the persist process (pid {os.getpid()}) received SIGTERM during the save")
    if not _STATE.get("terminating"):
        _die_by_sigterm()


def _die_by_sigterm() -> None:
    import signal

    if _STATE["area"] is not None:
        _STATE["area"].close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(143)


def _watch_parent(ppid: int) -> None:
    """The training process is gone: exit when idle; a save in flight is finished first (committed, or
    failed and cleaned up: no temporary directory or lock is left), bounded by its own timeout."""
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            _STATE["orphan"] = True
            if not _STATE.get("busy"):
                os._exit(3)


def main(fd: int) -> None:
    import signal

    conn = Connection(fd)
    send_lock = threading.Lock()
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        pass
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        op = msg.get("op")
        if op == "stop":
            break
        if op == "drop":  # the training process is about to free the staging area
            if _STATE["area"] is not None:
                _STATE["area"].close()
                _STATE["area"] = None
            with send_lock:
                conn.send({"ok": True})
            continue
        if op == "save":
            stop = threading.Event()
            if msg.get("mode") == "gloo":
                threading.Thread(target=_watch_abort, args=(msg, conn, send_lock, stop), daemon=True).start()
            _STATE["busy"] = True
            try:
                try:
                    reply = {"ok": True, **_save(msg)}
                except BaseException as e:  # noqa: BLE001 - everything goes back to the training process
                    reply = _error_reply(_explain_gloo_failure(msg, e) if msg.get("mode") == "gloo" else e)
            except _Terminated:  # SIGTERM while building the reply: the save is over either way
                reply = {"ok": False, "type": "PersistProcessDiedError", "module": "hyperdcp.async_save.future",
                         "message": "the persist process received SIGTERM", "traceback": "", "rank_errors": {}}
            _STATE["busy"] = False
            area = _STATE["area"]
            if area is not None:
                reply["mapped"] = area.path
            with send_lock:
                stop.set()
                try:
                    conn.send(reply)
                except (OSError, EOFError):
                    break
            if _STATE.get("terminating"):
                _die_by_sigterm()
            if _STATE.get("orphan"):
                break
    if _STATE["pg_prefix"] is not None:
        try:
            import torch.distributed as dist

            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    if _STATE["area"] is not None:
        _STATE["area"].close()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------------------------
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
                [sys.executable, "-m", "hyperdcp.async_save._child", str(b.fileno())],
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

    def submit(self, msg: dict, on_reply: Callable[[dict | None, BaseException | None], None] | None = None) -> "_Pending":
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

