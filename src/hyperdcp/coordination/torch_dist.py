"""Coordinator over a torch.distributed process group; also a :class:`~hyperdcp.coordination.base.Transport`.

Byte strings travel as uint8 CPU tensors through a gloo group: the caller's group when it already is
gloo, otherwise a gloo twin of it created once (with ``use_local_synchronization`` so only its members
take part) and reused for every later save and load. Point-to-point buffers (read-once loads) travel
through the same gloo group; broadcasts in a DeviceMesh's own groups use the handle the layout carries.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .. import _runtime
from ..errors import CoordinationError
from .base import Coordinator


@dataclass
class GroupState:
    """What this process learnt about one process group (kept in :mod:`hyperdcp._runtime`)."""

    peers: list[tuple[str, int]] | None = None  # (hostname, pid) per member, learnt at its first save/load
    arrivals: int = 0  # arrivals so far (the ranks that arrive agree on it; keys the store entry naming the missing)


def _gloo_twins() -> dict[tuple[str, float | None], object]:
    """The gloo twin of each (non-gloo or timed) group, created once per process."""
    return _runtime.slot("coordination.torch_dist.gloo_twins", dict)


def group_state(pg) -> GroupState:
    """The :class:`GroupState` of process group ``pg``."""
    states: dict[int, GroupState] = _runtime.slot("coordination.torch_dist.groups", dict)
    st = states.get(id(pg))
    if st is None:
        st = states.setdefault(id(pg), GroupState())
    return st


def _backend(pg) -> str:
    try:
        return str(dist.get_backend(pg)).lower()
    except Exception:  # noqa: BLE001 - unknown backends are treated as not gloo
        return ""


def gloo_group(pg=None, timeout: float | None = None):
    """A gloo process group with the same members as ``pg`` (default: the world)."""
    pg = pg if pg is not None else dist.group.WORLD
    if timeout is None and _backend(pg) == "gloo":
        return pg
    key = (dist.get_process_group_ranks(pg).__repr__() + getattr(pg, "group_name", ""), timeout)
    twins = _gloo_twins()
    twin = twins.get(key)
    if twin is None:
        kwargs = {"backend": "gloo", "use_local_synchronization": True}
        if timeout is not None:
            kwargs["timeout"] = timedelta(seconds=timeout)
        twin = dist.new_group(ranks=dist.get_process_group_ranks(pg), **kwargs)
        twins[key] = twin
    return twin


_BCAST_INLINE = 64 << 10  # broadcasts up to this size take one collective


def _t(data: bytes, size: int | None = None) -> torch.Tensor:
    size = len(data) if size is None else size
    buf = np.zeros(max(size, 1), dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return torch.from_numpy(buf)


_RANKS_RE = re.compile(r"Ranks? ([0-9][0-9, ]*) failed to pass monitoredBarrier")



def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API; naming the missing ranks is best effort
        return None


def _store_set(key: str, value: str) -> None:
    st = _store()
    if st is not None:
        try:
            st.set(key, value)
        except Exception:  # noqa: BLE001
            pass


def _store_get(key: str, wait_s: float = 3.0) -> str | None:
    st = _store()
    if st is None:
        return None
    try:
        st.wait([key], timedelta(seconds=wait_s))
        return st.get(key).decode()
    except Exception:  # noqa: BLE001
        return None



def torch_distributed_initialized() -> bool:
    """Whether the program has initialized torch.distributed (the default process group exists)."""
    return dist.is_available() and dist.is_initialized()

class TorchCoordinator(Coordinator):
    """Collectives (and Transport) over ``pg`` (default: the world), through its gloo twin."""

    def __init__(self, pg=None, timeout: float | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        self._base = pg if pg is not None else dist.group.WORLD
        self._group = None  # the gloo group, created on first use (after arrive() when it is called)
        self.rank = dist.get_rank(self._base)
        self.world_size = dist.get_world_size(self._base)
        self._global = dist.get_process_group_ranks(self._base)
        self.timeout = timeout
        self._what = "a collective"

    @property
    def group(self):
        if self._group is None:
            try:
                self._group = gloo_group(self._base, self.timeout)
            except (RuntimeError, OSError) as e:  # creating a group waits for every member
                raise self._fail(e) from e
        return self._group

    # -- failures -------------------------------------------------------------------------------
    def _dead_ranks(self) -> list[int]:
        """Group ranks on this host whose process is gone (best effort; remote hosts are not probed)."""
        peers = group_state(self._base).peers or []
        me = socket.gethostname()
        dead = []
        for r, (host, pid) in enumerate(peers):
            if host == me and r != self.rank:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    dead.append(r)
                except OSError:
                    pass
        return dead

    def _fail(self, e: BaseException) -> CoordinationError:
        dead = self._dead_ranks()
        who = (f"rank(s) {', '.join(map(str, dead))} died" if dead else
               "a rank died, stopped calling save/load or is stuck (it could not be identified)")
        limit = f"{self.timeout:g} s" if self.timeout is not None else "the process group's timeout"
        return CoordinationError(
            f"{self._what} failed on rank {self.rank} of {self.world_size}: {who}; collective error: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}. Every rank must call "
            f"save/load with the same path; restart the job (timeout: {limit}, set with timeout=)"
        )

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, OSError) as e:  # gloo errors (DistBackendError, timeouts, closed peers)
            raise self._fail(e) from e

    def _barrier_with_deadline(self, group, kwargs) -> None:
        """monitored_barrier, bounded: a non-zero rank waiting on a rank 0 that never comes can block past
        gloo's timeout (until rank 0 exits), so the wait runs in a helper thread with its own deadline."""
        if self.timeout is None:
            dist.monitored_barrier(group=group, **kwargs)
            return
        done, err = threading.Event(), []

        def run():
            try:
                dist.monitored_barrier(group=group, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                err.append(e)
            finally:
                done.set()

        threading.Thread(target=run, name="hyperdcp-arrive", daemon=True).start()
        if not done.wait(self.timeout + max(1.0, 0.25 * self.timeout)):
            raise TimeoutError("monitored barrier did not complete")
        if err:
            raise err[0]

    def arrive(self, what: str) -> None:
        """Wait until every rank has entered ``what``; name the ranks that did not within the timeout."""
        self._what = what
        if self.world_size == 1:
            return
        kwargs = {"wait_all_ranks": True}
        if self.timeout is not None:
            kwargs["timeout"] = timedelta(seconds=self.timeout)
        # monitored_barrier needs gloo: the caller's group when it is gloo (so a missing rank is named
        # before any new group is created, which would itself wait for every member), else the twin
        barrier_group = self._base if _backend(self._base) == "gloo" else self.group
        try:
            self._barrier_with_deadline(barrier_group, kwargs)
        except (RuntimeError, OSError, TimeoutError) as e:
            m = _RANKS_RE.search(str(e))
            missing = sorted({int(x) for x in re.findall(r"[0-9]+", m.group(1))}) if m else []
            key = f"hyperdcp/arrive/{self._global[0]}/{group_state(self._base).arrivals}"
            if self.rank == 0 and missing:
                _store_set(key, ",".join(map(str, missing)))
            elif self.rank != 0 and "successfully reached monitoredBarrier" in str(e):
                # rank 0 is alive and found someone missing: it left the names in the store
                got = _store_get(key)
                missing = [int(x) for x in got.split(",") if x] if got else []
            elif not missing and self.rank != 0:
                missing = [0]
            dead = set(self._dead_ranks())
            limit = f"{self.timeout:g} s" if self.timeout is not None else "the process group's timeout"
            names = ", ".join(f"{r}{' (dead)' if r in dead else ''}" for r in missing) or "unknown"
            raise CoordinationError(
                f"{what}: rank(s) {names} of {self.world_size} did not arrive within {limit} (seen from rank "
                f"{self.rank}); every rank must call it. Check that those ranks are alive and reach this call, "
                "or raise timeout="
            ) from e
        state = group_state(self._base)
        state.arrivals += 1
        if state.peers is None:
            me = f"{socket.gethostname()}\n{os.getpid()}".encode()
            state.peers = [
                (h, int(p)) for h, p in (b.decode().split("\n") for b in self.all_gather(me))
            ]

    @property
    def global_ranks(self) -> list[int]:
        return list(self._global)

    def _inline(self) -> int:
        # bytes per rank carried in the first (often only) collective: small payloads (statuses,
        # plan headers) take one round trip instead of two; the frame shrinks as the world grows
        return max(64, min(4096, (1 << 20) // max(self.world_size, 1)))

    def _framed(self, collective, data: bytes, want_all: bool) -> tuple[list[int], list[torch.Tensor] | None]:
        """First round: every rank's (length, first bytes); returns the lengths and the frames."""
        cap = self._inline()
        frame = _t(len(data).to_bytes(8, "little") + data[: cap - 8], cap)
        out = [torch.empty(cap, dtype=torch.uint8) for _ in range(self.world_size)] if want_all else None
        collective(out, frame)
        if out is None:
            return [], None
        return [int.from_bytes(o.numpy()[:8].tobytes(), "little") for o in out], out

    def any_true(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        self._call(dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def all_gather(self, data: bytes) -> list[bytes]:
        cap = self._inline() - 8
        sizes, frames = self._framed(lambda out, t: self._call(dist.all_gather, out, t, group=self.group), data, True)
        if max(sizes) <= cap:
            return [frames[r].numpy()[8 : 8 + sizes[r]].tobytes() for r in range(self.world_size)]
        m = max(sizes)
        out = [torch.empty(m, dtype=torch.uint8) for _ in range(self.world_size)]
        self._call(dist.all_gather, out, _t(data, m), group=self.group)
        return [out[r].numpy()[: sizes[r]].tobytes() for r in range(self.world_size)]

    def gather(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        cap = self._inline() - 8
        me_dst = self.rank == dst
        sizes, frames = self._framed(
            lambda out, t: self._call(dist.gather, t, out, dst=self._global[dst], group=self.group), data, me_dst)
        # everyone must know whether a second round follows: the root tells them
        big = self.broadcast(b"1" if me_dst and max(sizes) > cap else b"0", dst) == b"1"
        if not big:
            if not me_dst:
                return None
            return [frames[r].numpy()[8 : 8 + sizes[r]].tobytes() for r in range(self.world_size)]
        m = int(self.broadcast(str(max(sizes)).encode() if me_dst else None, dst))
        out = [torch.empty(m, dtype=torch.uint8) for _ in range(self.world_size)] if me_dst else None
        self._call(dist.gather, _t(data, m), out, dst=self._global[dst], group=self.group)
        if not me_dst:
            return None
        return [out[r].numpy()[: sizes[r]].tobytes() for r in range(self.world_size)]

    def scatter(self, parts: Sequence[bytes] | None, src: int = 0) -> bytes:
        m = self.broadcast(str(max(len(p) for p in parts)).encode() if self.rank == src else None, src)
        m = int(m) + 8
        framed = None
        if self.rank == src:
            framed = [_t(len(p).to_bytes(8, "little") + p, m) for p in parts]
        out = torch.empty(max(m, 1), dtype=torch.uint8)
        self._call(dist.scatter, out, framed, src=self._global[src], group=self.group)
        raw = out.numpy()
        n = int.from_bytes(raw[:8].tobytes(), "little")
        return raw[8 : 8 + n].tobytes()

    def broadcast(self, data: bytes | None, src: int = 0) -> bytes:
        cap = _BCAST_INLINE
        me = self.rank == src
        frame = (_t(len(data).to_bytes(8, "little") + data[: cap - 8], cap) if me
                 else torch.empty(cap, dtype=torch.uint8))
        self._call(dist.broadcast, frame, src=self._global[src], group=self.group)
        raw = frame.numpy()
        n = int.from_bytes(raw[:8].tobytes(), "little")
        if n <= cap - 8:
            return raw[8 : 8 + n].tobytes()
        rest = _t(data[cap - 8 :]) if me else torch.empty(n - (cap - 8), dtype=torch.uint8)
        self._call(dist.broadcast, rest, src=self._global[src], group=self.group)
        return raw[8:].tobytes() + rest.numpy().tobytes()

    # -- Transport (read-once loads) --------------------------------------------------------------
    def isend(self, buf: np.ndarray, peer: int, tag: int) -> Any:
        """Send ``buf`` to group rank ``peer`` (non-blocking)."""
        return self._call(dist.isend, torch.from_numpy(buf), dst=self._global[peer], group=self.group, tag=tag)

    def irecv(self, buf: np.ndarray, peer: int, tag: int) -> Any:
        """Receive into ``buf`` from group rank ``peer`` (non-blocking)."""
        return self._call(dist.irecv, torch.from_numpy(buf), src=self._global[peer], group=self.group, tag=tag)

    def broadcast_in(self, buf: np.ndarray, src: int, group: Any) -> Any:
        """Broadcast ``buf`` from group rank ``src`` inside ``group`` (a DeviceMesh dim group; None: all ranks)."""
        group = self.group if group is None else group
        return self._call(dist.broadcast, torch.from_numpy(buf), src=self._global[src], group=group, async_op=True)

    def wait(self, handles: Sequence[Any]) -> None:
        """Wait for every handle of :meth:`isend`, :meth:`irecv` and :meth:`broadcast_in`."""
        for h in handles:
            self._call(h.wait)


# --------------------------------------------------------------------------------------------------
# The TCPStore and gloo group of async-save persist processes (used by hyperdcp.async_saving).


def open_store(host: str, port: int, *, master: bool = False, timeout_s: float = 600.0):
    """A TCPStore: the server (``master=True``, ``port`` 0 picks a free port) or a client of it."""
    if master:
        return dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def join_gloo_group(store, prefix: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Make this process's default group a gloo group formed through ``store`` under ``prefix``."""
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def leave_group() -> None:
    """Destroy this process's default group; a group that is already broken is dropped quietly."""
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group is replaced (or the process ends) anyway
        pass
