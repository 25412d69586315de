"""One training process's async-save session: rendezvous, staging, submitting saves, plan-cache sync.

Call order (inside :func:`hyperdcp.async_save`, every rank, same order):
``open_session(coord, mode)`` (once per group and mode: agrees on a token, starts nothing yet) ->
``session.save(state_dict, path, opts, wait, exchange_dir)`` (stages, starts or reuses the persist process,
submits, returns a :class:`SaveFuture`) ... -> ``shutdown()`` (also at exit).

Coordination modes of the persist processes (``coordination=``):

* ``"gloo"`` (default): the persist processes form their own CPU gloo group (rendezvous through a
  TCPStore served by the rank-0 training process at ``MASTER_ADDR`` or 127.0.0.1). Fastest exchanges;
  needs TCP between the hosts, like the training job itself.
* ``"file"``: exchanges go through files in a shared directory (default: a hidden directory next to
  the checkpoint; ``exchange_dir=`` to choose). No network beyond the shared file system; each
  exchange costs file-system latency (milliseconds to seconds on network file systems).
* ``"none"``: no cross-rank step at all; each rank writes its data files and a rank metadata file;
  :func:`hyperdcp.load` merges them (or :func:`hyperdcp.finalize` does, once). Use when ranks cannot
  talk after staging (or to avoid any straggler coupling); the checkpoint is complete only once every
  rank's file exists, and there is no atomic overwrite.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any

from .. import _runtime
from ..async_save.file_coordination import write_abort
from ..coordination.base import Coordinator, broadcast_checked
from ..errors import (
    AsyncSaveError,
    CheckpointError,
    PersistProcessDiedError,
    PersistProcessStuckError,
    RemoteRankError,
    SaveInProgressError,
)
from ..options import SaveOptions
from ..saving import SaveResult
from ..storage.schemes import registered as registered_schemes
from .future import RemoteTraceback, SaveFuture
from .staging import Stager, writers_alone
from .worker import PersistWorker

DEFAULT_MODE = "gloo"

#: SaveOptions fields that do not travel to the persist process (a process group is not transferable)
_NOT_TRANSFERRED = frozenset({"process_group"})
_OPTION_FIELDS = tuple(f.name for f in fields(SaveOptions) if f.name not in _NOT_TRANSFERRED)


def _plan_cache():
    """The process-wide save plan cache (shared with :func:`hyperdcp.save`)."""
    from ..planning.save_plan import PlanCache

    return _runtime.slot("planning.plan_cache", PlanCache)


class _Session:
    """The async-save state of one training process for one group of ranks and one mode."""

    def __init__(self, coord: Coordinator, mode: str):
        self.coord, self.mode = coord, mode
        self.rank, self.world_size = coord.rank, coord.world_size
        self.stager = Stager()
        self.stager.before_new_area = self._drop_child_area
        self.seq = 0
        self.worker: PersistWorker | None = None
        self.restart = False
        self.inflight: SaveFuture | None = None
        self.sent_keys: set = set()
        self.xroots: set[str] = set()
        self.store = None
        self.token, self.host, self.port = self._rendezvous()
        from .. import shm
        from .staging import staging_dirs

        for d in staging_dirs():  # staging areas and read-once segments of killed processes on this host
            shm.reclaim(d)

    def _rendezvous(self) -> tuple[str, str, int]:
        """Once per session: agree on a session token (and the gloo store address) via the parent group."""
        def make() -> bytes:
            host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), 0
            if self.mode == "gloo" and self.world_size > 1:
                from ..coordination.torch_dist import open_store

                self.store = open_store(host, 0, master=True, timeout_s=600)
                port = int(self.store.port)
            return json.dumps({"token": secrets.token_hex(8), "host": host, "port": port}).encode()

        if self.world_size == 1:
            doc = json.loads(make())
        else:
            doc = json.loads(broadcast_checked(self.coord, "starting async-save persist processes",
                                              make if self.rank == 0 else None, 0))
        return doc["token"], doc["host"], int(doc["port"])

    # ----------------------------------------------------------------------------------------
    def _worker(self, seq: int) -> PersistWorker:
        w = self.worker
        if w is not None and (self.restart or not w.alive()):
            w.kill()
            w = None
            area = self.stager.area
            if area is not None and (area.unlinked or not os.path.exists(area.path)):
                self.stager.release()  # the new process cannot open an unlinked area: stage into a new one
        if w is None:
            w = self.worker = PersistWorker(self.rank, seq)
            self.restart = False
            self.sent_keys = set()  # a new process has an empty plan cache: send it the known plans
        return w

    def _cache_entries(self) -> list:
        from ..planning.save_plan import GlobalPlan

        out = []
        for key, val in _plan_cache().items():
            if key in self.sent_keys:
                continue
            self.sent_keys.add(key)
            if isinstance(val, GlobalPlan):
                out.append((key, "plan", val.to_bytes()))
            else:
                import numpy as np

                out.append((key, "assign", np.ascontiguousarray(val, np.int64).tobytes()))
        return out

    def save(self, state_dict: Any, path: str, opts: SaveOptions, wait: bool, exchange_dir: str | None) -> SaveFuture:
        t0 = time.perf_counter()
        prev = self.inflight
        if prev is not None and not prev.done():
            if not wait:
                raise SaveInProgressError(
                    f"rank {self.rank}: an async save to {prev.path!r} is still in flight; call its result() first, or "
                    "pass wait=True to wait for it"
                )
            prev.wait()  # bounded: a stuck persist process fails it (see _check_stuck)
        path = os.fspath(path) if "://" in os.fspath(path) else os.path.abspath(os.fspath(path))  # s3:// URLs as given
        seq = self.seq
        self.seq += 1
        worker = self._worker(seq)  # before staging: a replaced process needs a fresh staging area
        from ..shm import sigterm_cleanup

        with sigterm_cleanup(self._unlink_area):  # SIGTERM while staging: no named area is left in /dev/shm
            return self._stage_and_send(worker, seq, state_dict, path, opts, exchange_dir, t0)

    def _unlink_area(self) -> None:
        if self.stager.area is not None:
            self.stager.area.unlink()

    def _stage_and_send(self, worker: PersistWorker, seq: int, state_dict: Any, path: str, opts: SaveOptions,
                        exchange_dir: str | None, t0: float) -> SaveFuture:
        stage_error: BaseException | None = None
        try:
            copy = self.stager.stage(state_dict, self.coord)
        except Exception as e:  # noqa: BLE001 - the other ranks must learn of it too
            stage_error, copy = e, None
        mode = self.mode if (self.world_size > 1 or self.mode == "none") else "local"
        parent, name = os.path.split(path.rstrip(os.sep))
        xdir = None
        if mode == "file":
            root = exchange_dir or os.path.join(parent, f".hyperdcp-xchg-{self.token}")
            xdir = os.path.join(os.path.abspath(root), f"{seq:08d}")
            self.xroots.add(os.path.abspath(root))
        msg: dict[str, Any] = {
            "op": "save", "path": path, "rank": self.rank, "world_size": self.world_size, "mode": mode,
            "options": {f: getattr(opts, f) for f in _OPTION_FIELDS}, "cache": self._cache_entries(),
            "timeout": opts.timeout, "host": self.host, "port": self.port,
            "rdzv_prefix": f"hyperdcp-persist/{self.token}", "exchange_dir": xdir,
            "save_id": f"{self.token}-{seq}", "seq": seq, "storage_schemes": registered_schemes(),
        }
        if copy is not None:
            lay = copy.layout
            msg.update(plan=lay.plan_bytes or lay.plan.to_bytes(), shm_path=copy.area.path, shm_bytes=copy.area.nbytes,
                       offsets=lay.offsets.tobytes(), sizes=lay.sizes.tobytes(), values=copy.values)
            if mode == "none":
                msg["mine"] = writers_alone(lay, copy.replicas, self.rank, self.world_size).tobytes()
        else:
            msg["stage_error"] = f"{type(stage_error).__name__}: {stage_error}"
        fut = SaveFuture(path, self.rank, seq, 0.0, bool(copy and copy.first))
        fut.worker_pid = worker.pid
        fut._watch = lambda: self._check_stuck(fut, worker)
        self.inflight = fut
        if stage_error is not None and mode == "none":
            fut._finish(None, stage_error)
            raise stage_error
        worker.submit(msg, lambda reply, exc: self._complete(worker, msg, fut, xdir, reply, exc))
        fut.blocking_seconds = time.perf_counter() - t0
        if stage_error is not None:
            raise stage_error
        return fut

    def _check_stuck(self, fut: SaveFuture, worker: PersistWorker) -> None:
        """Called while someone waits for ``fut``: a stuck persist process (:meth:`PersistWorker.stuck`) is
        killed and ``fut`` fails naming this rank and that process, so no wait on it is unbounded."""
        why = worker.stuck() if not fut.done() else None
        if why is None:
            return
        fut._finish(None, PersistProcessStuckError(
            f"rank {self.rank}: {why} while saving {fut.path!r}; it was killed and that checkpoint is not committed "
            "(a previous checkpoint at that path is intact); check the storage of that path (a hung network file "
            "system?) -- the next async_save starts a new persist process"))
        print(f"hyperdcp: rank {self.rank}: {why}; killed it, the save to {fut.path!r} is not committed",
              file=sys.stderr)
        if self.worker is worker:
            self.restart = True
        threading.Thread(target=worker.kill, daemon=True).start()  # a 'D' process dies only once its I/O returns

    def _complete(self, worker: PersistWorker, msg: dict, fut: SaveFuture, xdir: str | None, reply: dict | None,
                  exc: BaseException | None) -> None:
        """Runs on the worker's reader thread once the persist process replied (or died)."""
        try:
            if exc is not None:
                raise exc
        except (EOFError, OSError):
            err = PersistProcessDiedError(
                f"the persist process of rank {self.rank} (pid {worker.pid}) {worker.exit_description()} while saving "
                f"{fut.path!r}; that checkpoint was not committed (a previous checkpoint at that path is intact); "
                "the next async_save starts a new persist process"
            )
            if xdir:
                write_abort(xdir, self.rank, str(err))
            if msg["mode"] == "gloo":
                self._announce_abort(f"hyperdcp-abort/{msg['rdzv_prefix']}/{msg['seq']}", str(err))
            self.restart = True
            fut._finish(None, err)
            return
        except BaseException as e:  # noqa: BLE001
            self.restart = True
            fut._finish(None, AsyncSaveError(f"rank {self.rank}: sending the save of {fut.path!r} failed: {e}"))
            return
        self._unlink_mapped(reply.get("mapped"))
        if reply.get("ok"):
            self._absorb_cache(reply.get("cache", []))
            fut._finish(SaveResult(**reply["result"]), None)
            return
        # gloo mode: the persist process keeps running; it votes for a new group at the next save (see
        # child._gloo_coordinator), so every rank re-forms the group together
        fut._finish(None, _rebuild(reply, self.rank, fut.path))

    def _drop_child_area(self) -> None:
        w = self.worker
        if w is not None and w.alive():
            try:
                w.request({"op": "drop"})
            except (EOFError, OSError):
                pass

    def _unlink_mapped(self, path: str | None) -> None:
        """Once the persist process has mapped the staging area, its name can go: nothing leaks in /dev/shm
        even if this process ends through os._exit or a signal."""
        area = self.stager.area
        if path and area is not None and area.path == path:
            area.unlink()

    def _announce_abort(self, key: str, why: str) -> None:
        """Gloo mode: tell the other persist processes (through the TCPStore) to give up this save."""
        try:
            from ..coordination.torch_dist import open_store

            store = self.store or open_store(self.host, self.port, timeout_s=30)
            store.set(key, why.encode())
        except Exception:  # noqa: BLE001 - the others still fail at their group's timeout
            pass

    def _absorb_cache(self, entries: list) -> None:
        import numpy as np

        from ..planning.save_plan import GlobalPlan

        cache = _plan_cache()
        for key, kind, raw in entries:
            cache.put(key, GlobalPlan.from_bytes(raw) if kind == "plan" else np.frombuffer(raw, np.int64).copy())
            self.sent_keys.add(key)

    def close(self, timeout: float | None = 600.0, report: bool = True) -> None:
        fut = self.inflight
        if fut is not None and not fut.done():
            if report:
                print(f"hyperdcp: rank {self.rank}: waiting for the async save to {fut.path!r} to finish before exit",
                      file=sys.stderr)
            if not fut.wait(timeout) and report:
                print(f"hyperdcp: rank {self.rank}: the async save to {fut.path!r} did not finish within {timeout}s; "
                      "it is not committed", file=sys.stderr)
        if fut is not None and fut.done() and fut._exc is not None and report and not getattr(fut, "_reported", True):
            print(f"hyperdcp: rank {self.rank}: the async save to {fut.path!r} failed: {fut._exc}", file=sys.stderr)
        if self.worker is not None:
            if self.restart or self.worker.stuck() is not None:
                self.worker.kill()
            else:
                self.worker.stop()
            self.worker = None
        if self.rank == 0:
            self._clean_exchange()
        self.stager.release()
        self.store = None


    def _clean_exchange(self, wait: float = 5.0) -> None:
        """Rank 0 removes the exchange directories once every rank has marked them done."""
        from .child import _cleanup_exchange

        deadline = time.monotonic() + wait
        for root in self.xroots:
            while os.path.isdir(root):
                _cleanup_exchange(root, self.world_size, None)
                if not os.path.isdir(root) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)


def _rebuild(reply: dict, rank: int, path: str) -> BaseException:
    """The persist process's exception, rebuilt in the training process (no pickle)."""
    from .. import errors as E

    cls = None
    if reply["module"] == E.__name__:
        cls = getattr(E, reply["type"], None)
    exc: BaseException | None = None
    if cls is RemoteRankError:
        exc = RemoteRankError(reply["message"], {int(k): v for k, v in reply.get("rank_errors", {}).items()})
    elif isinstance(cls, type) and issubclass(cls, CheckpointError):
        try:
            exc = cls(reply["message"])
        except Exception:  # noqa: BLE001
            exc = None
    if exc is None:
        exc = AsyncSaveError(
            f"async save to {path!r} failed in the persist process of rank {rank}: {reply['type']}: {reply['message']}"
        )
    exc.remote_traceback = reply["traceback"]  # type: ignore[attr-defined]
    exc.original_type = f"{reply['module']}.{reply['type']}"  # type: ignore[attr-defined]
    exc.__cause__ = RemoteTraceback(reply["traceback"])
    return exc


@dataclass
class _Sessions:
    """This process's sessions (at most one at a time), in the ``async_saving.sessions`` slot."""

    by_key: dict = field(default_factory=dict)
    lock: Any = field(default_factory=threading.Lock)
    exit_hook: bool = False


def _sessions() -> _Sessions:
    return _runtime.slot("async_saving.sessions", _Sessions)


def _at_exit() -> None:
    reg = _sessions()
    for key in list(reg.by_key):
        s = reg.by_key.pop(key)
        try:
            s.close()
        except Exception as e:  # noqa: BLE001
            print(f"hyperdcp: closing async save state failed: {e}", file=sys.stderr)


def shutdown(timeout: float | None = 600.0) -> None:
    """Finish any in-flight async save and stop this process's persist processes (also done at exit).

    Args:
        timeout: seconds to wait for an in-flight save before giving up on it (it is then not committed).
    """
    reg = _sessions()
    for key in list(reg.by_key):
        reg.by_key.pop(key).close(timeout)


def current_session() -> _Session | None:
    """The most recently used session of this process (diagnostics and tests)."""
    by_key = _sessions().by_key
    return next(reversed(by_key.values()), None) if by_key else None


def open_session(coord: Coordinator, mode: str) -> _Session:
    """The session of ``coord``'s group for ``mode``; a new one closes any other first (bounded staging
    memory, one persist process per rank). Every rank calls it in the same order (a new session agrees
    on a token through ``coord``)."""
    reg = _sessions()
    key = (mode, coord.world_size, coord.rank, tuple(coord.global_ranks))
    with reg.lock:
        sess = reg.by_key.get(key)
        if sess is None:
            for k in list(reg.by_key):
                reg.by_key.pop(k).close(report=False)
            sess = reg.by_key[key] = _Session(coord, mode)
            if not reg.exit_hook:
                atexit.register(_at_exit)
                # processes started by multiprocessing leave through os._exit (no atexit): its finalizers run
                import multiprocessing.util as mpu

                mpu.Finalize(None, _at_exit, exitpriority=100)
                reg.exit_hook = True
    sess.coord = coord
    return sess
