"""The long-lived persist process of one rank (the child side), and its command protocol.

The training process starts it once (:class:`~hyperdcp.async_saving.worker.PersistWorker`; a fresh
interpreter, ``python -m hyperdcp.async_saving._child``:
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

import os
import shutil
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .. import _runtime


@dataclass
class ChildState:
    """What one persist process keeps between saves (one per process, in the ``async_saving.child`` slot)."""

    pg_prefix: str | None = None  # store prefix of the current gloo group (None: no group)
    group_suspect: bool = False  # the last save failed: vote for a new group at the next one
    store: Any = None  # the TCPStore client (gloo mode)
    area: Any = None  # the mapped staging area (ShmArea, read-only)
    cache: Any = None  # this process's PlanCache
    known: set = field(default_factory=set)  # plan-cache keys the training process already has
    busy: bool = False  # a save is running
    terminating: bool = False  # SIGTERM arrived during a save
    orphan: bool = False  # the training process is gone


def _state() -> ChildState:
    return _runtime.slot("async_saving.child", ChildState)


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

    from ..coordination.torch_dist import TorchCoordinator, join_gloo_group, leave_group, open_store

    timeout = timedelta(seconds=float(msg.get("timeout") or 600))
    store = _state().store
    if store is None:
        store = _state().store = open_store(msg["host"], int(msg["port"]), timeout_s=timeout.total_seconds())
    base, seq, W = msg["rdzv_prefix"], int(msg["seq"]), int(msg["world_size"])
    vote = f"{base}/vote/{seq}"
    want = 1 if (_state().pg_prefix is None or _state().group_suspect) else 0
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
        if _state().pg_prefix is not None:
            leave_group()
            _state().pg_prefix = None
        prefix = f"{base}/g{seq}"
        join_gloo_group(store, prefix, int(msg["rank"]), W, timeout.total_seconds())
        _state().pg_prefix = prefix
    _state().group_suspect = True  # until this save succeeds
    return TorchCoordinator()


def _watch_abort(msg: dict, conn: Connection, send_lock: threading.Lock, stop: threading.Event) -> None:
    """Gloo mode: a dead peer persist process is announced in the TCPStore by its training process.

    A collective blocked on that peer may never return, so this thread reports the error to the
    training process and ends this (now unusable) persist process; the next save starts a new one.
    """
    from ..coordination.torch_dist import open_store

    key = f"hyperdcp-abort/{msg['rdzv_prefix']}/{msg['seq']}"  # the same on every rank
    try:
        store = open_store(msg["host"], int(msg["port"]), timeout_s=30)
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
    from ..errors import CheckpointError, CoordinationError, RemoteRankError

    store = _state().store
    if store is None or isinstance(e, RemoteRankError) or getattr(e, "rank_errors", None):
        return e
    if isinstance(e, CheckpointError) and not isinstance(e, CoordinationError):
        return e  # this rank's own error (a write that failed, ...): it says what happened, nothing to wait for
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

    cur = _state().area
    if cur is not None and (cur.path, cur.nbytes) == (path, max(nbytes, 1)):
        return cur
    if cur is not None:
        cur.close()
    _state().area = ShmArea(nbytes, path=path, readonly=True)
    try:  # mapped: the name can go, so nothing stays in /dev/shm whichever process dies first
        os.unlink(path)
    except OSError:
        pass
    return _state().area


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
    mine/save_id (none); storage_schemes (the training process's :func:`~hyperdcp.storage.register_storage`
    registrations: scheme -> factory path)."""
    from ..async_save.file_coordination import FileCoordinator
    from ..async_save.rank_files import persist_alone
    from ..coordination.base import LocalCoordinator
    from ..options import SaveOptions
    from ..planning.save_plan import GlobalPlan, PlanCache
    from ..saving import persist
    from ..storage.schemes import adopt

    adopt(msg.get("storage_schemes"))  # a storage of the user's own for the path's scheme: the same one here

    if _state().cache is None:
        _state().cache = PlanCache()
    cache: PlanCache = _state().cache
    known: set = _state().known
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
            _state().group_suspect = False
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
                   "files_written": list(res.files_written), "plan_cache_hit": res.plan_cache_hit,
                   "seconds": res.seconds},
        "cache": back,
    }


def _error_reply(e: BaseException) -> dict:
    if isinstance(e, _Terminated):
        return {"ok": False, "type": "PersistProcessDiedError", "module": "hyperdcp.errors",
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
    if _state().busy and not _state().terminating:
        _state().terminating = True
        raise _Terminated(f"the persist process (pid {os.getpid()}) received SIGTERM during the save")
    if not _state().terminating:
        _die_by_sigterm()


def _die_by_sigterm() -> None:
    import signal

    if _state().area is not None:
        _state().area.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(143)


def _watch_parent(ppid: int) -> None:
    """The training process is gone: exit when idle; a save in flight is finished first (committed, or
    failed and cleaned up: no temporary directory or lock is left), bounded by its own timeout."""
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            _state().orphan = True
            if not _state().busy:
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
            if _state().area is not None:
                _state().area.close()
                _state().area = None
            with send_lock:
                conn.send({"ok": True})
            continue
        if op == "save":
            stop = threading.Event()
            if msg.get("mode") == "gloo":
                threading.Thread(target=_watch_abort, args=(msg, conn, send_lock, stop), daemon=True).start()
            _state().busy = True
            try:
                try:
                    reply = {"ok": True, **_save(msg)}
                except BaseException as e:  # noqa: BLE001 - everything goes back to the training process
                    reply = _error_reply(_explain_gloo_failure(msg, e) if msg.get("mode") == "gloo" else e)
            except _Terminated:  # SIGTERM while building the reply: the save is over either way
                reply = {"ok": False, "type": "PersistProcessDiedError", "module": "hyperdcp.errors",
                         "message": "the persist process received SIGTERM", "traceback": "", "rank_errors": {}}
            _state().busy = False
            area = _state().area
            if area is not None:
                reply["mapped"] = area.path
            with send_lock:
                stop.set()
                try:
                    conn.send(reply)
                except (OSError, EOFError):
                    break
            if _state().terminating:
                _die_by_sigterm()
            if _state().orphan:
                break
    if _state().pg_prefix is not None:
        from ..coordination.torch_dist import leave_group

        leave_group()
    if _state().area is not None:
        _state().area.close()
    os._exit(0)


