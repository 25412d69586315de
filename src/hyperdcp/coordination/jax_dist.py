"""A :class:`~hyperdcp.coordination.base.Coordinator` over the JAX distributed runtime (no torch).

After ``jax.distributed.initialize(...)`` every process holds a client of the runtime's coordination
service, a key-value store with blocking reads. The collectives run over it, rooted at one rank:

* ``gather``: each rank sets ``<op>/g/<rank>``; the root reads them in rank order (then deletes them);
* ``broadcast``: the root sets ``<op>/b``; the others block on it;
* ``all_gather``: a gather to rank 0, then a broadcast of the concatenation (O(world) work on rank 0,
  one read per other rank: no quadratic fan-in on the service);
* ``scatter``: the root sets ``<op>/s/<rank>`` for each rank.

Keys live under ``hyperdcp/<epoch>/``; the epoch advances at every :meth:`arrive` (one per save or
load, a full exchange); once every process has arrived in epoch ``e``, none reads a key of epoch
``e - 1`` any more and rank 0 deletes them, so the store holds at most two saves' or loads' worth.
Values over 1 MiB travel in parts. A rank that does not contribute within
``timeout`` makes the root fail naming it; the root publishes that failure in place of the result, so
every waiting rank raises the same :class:`CoordinationError` instead of waiting longer.

This coordinator is not a :class:`~hyperdcp.coordination.base.Transport`: bulk bytes over the
coordination service would all pass through one process, so read-once loads fall back to each process
reading what it needs (logged once at INFO on the ``hyperdcp`` logger).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

from .. import _runtime
from ..errors import CoordinationError
from .base import Coordinator

_PART = 1 << 20  # bytes per key-value entry
_OK, _PARTS, _FAIL = b"\x00", b"\x01", b"\x02"
DEFAULT_TIMEOUT = 600.0
log = logging.getLogger("hyperdcp")


def _global_state():
    from jax._src import distributed  # the runtime's client: private, but the only handle JAX gives

    return distributed.global_state


def jax_distributed_initialized() -> bool:
    """Whether ``jax.distributed.initialize()`` ran in this process with more than one process."""
    try:
        st = _global_state()
    except Exception:  # noqa: BLE001 - another JAX version without this module: not usable
        return False
    return getattr(st, "client", None) is not None and int(getattr(st, "num_processes", 1) or 1) > 1


@dataclass
class _Counters:
    epoch: int = 0
    op: int = 0
    logged_transport: bool = False


class JaxCoordinator(Coordinator):
    """Byte-string collectives among the processes of ``jax.distributed`` (rank = ``jax.process_index()``)."""

    def __init__(self, timeout: float | None = None):
        st = _global_state()
        if st.client is None:
            raise CoordinationError("jax.distributed is not initialized; call jax.distributed.initialize() first")
        self._client = st.client
        self.rank = int(st.process_id)
        self.world_size = int(st.num_processes)
        self.timeout = float(timeout) if timeout is not None else DEFAULT_TIMEOUT
        self._n = _runtime.slot("coordination.jax_dist.counters", _Counters)  # shared by every instance
        self._what = "a collective"
        if not self._n.logged_transport:
            self._n.logged_transport = True
            log.info("hyperdcp: the JAX coordinator moves no bulk bytes between processes; read-once loads "
                     "fall back to each process reading the bytes it needs")

    def describe(self) -> str:
        return f"JAX process {self.rank} of {self.world_size}"

    # -- the store ---------------------------------------------------------------------------
    def _key(self, *parts: object) -> str:
        return "/".join(("hyperdcp", str(self._n.epoch), str(self._n.op)) + tuple(str(p) for p in parts))

    def _next(self) -> None:
        self._n.op += 1

    def _put(self, key: str, data: bytes) -> None:
        c = self._client
        if len(data) < _PART:
            c.key_value_set_bytes(key, _OK + data)
            return
        n = -(-len(data) // _PART)
        for i in range(n):
            c.key_value_set_bytes(f"{key}/p{i}", data[i * _PART:(i + 1) * _PART])
        c.key_value_set_bytes(key, _PARTS + n.to_bytes(8, "little"))  # last: readers see a complete value

    def _get(self, key: str, seconds: float) -> bytes:
        """The value at ``key``, waiting up to ``seconds``; raises TimeoutError (a failure marker raises
        CoordinationError with the root's message)."""
        ms = max(1, int(seconds * 1000))
        try:
            head = self._client.blocking_key_value_get_bytes(key, ms)
        except Exception as e:  # noqa: BLE001 - the client raises its own error types on deadlines
            raise TimeoutError(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None
        if head[:1] == _OK:
            return head[1:]
        if head[:1] == _FAIL:
            raise CoordinationError(head[1:].decode("utf-8", "replace"))
        n = int.from_bytes(head[1:9], "little")
        return b"".join(self._client.blocking_key_value_get_bytes(f"{key}/p{i}", ms) for i in range(n))

    def _delete(self, key: str) -> None:
        try:
            self._client.key_value_delete(key)
        except Exception:  # noqa: BLE001 - cleanup is best effort
            pass

    def _missing(self, keys: dict[int, str]) -> list[int]:
        out = []
        for r, k in keys.items():
            try:
                self._client.key_value_try_get_bytes(k)
            except Exception:  # noqa: BLE001 - not found
                out.append(r)
        return out

    def _late(self, ranks: list[int]) -> CoordinationError:
        names = ", ".join(map(str, ranks[:16])) + (" ..." if len(ranks) > 16 else "")
        return CoordinationError(
            f"{self._what}: JAX process(es) {names} of {self.world_size} did not take part within {self.timeout:g} s "
            f"(seen from process {self.rank}); every process must call save/load with the same arguments. Check that "
            "they are alive and reach this call, or raise timeout="
        )

    # -- collectives -------------------------------------------------------------------------
    def gather(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        self._next()
        if self.world_size == 1:
            return [bytes(data)]
        if self.rank != dst:
            self._put(self._key("g", self.rank), bytes(data))
            return None
        keys = {r: self._key("g", r) for r in range(self.world_size) if r != dst}
        out: list[bytes] = []
        deadline = time.monotonic() + self.timeout
        for r in range(self.world_size):
            if r == dst:
                out.append(bytes(data))
                continue
            try:
                out.append(self._get(keys[r], max(0.001, deadline - time.monotonic())))
            except TimeoutError:
                raise self._late(self._missing({q: keys[q] for q in keys if q >= r})) from None
        for k in keys.values():
            self._delete(k)
        return out

    def broadcast(self, data: bytes | None, src: int = 0) -> bytes:
        self._next()
        if self.world_size == 1:
            return bytes(data)  # type: ignore[arg-type]
        key = self._key("b")
        if self.rank == src:
            self._put(key, bytes(data))  # type: ignore[arg-type]
            return bytes(data)  # type: ignore[arg-type]
        return self._wait_root(key, src)

    def _wait_root(self, key: str, src: int) -> bytes:
        # the root may itself wait up to `timeout` for a late rank before it publishes
        try:
            return self._get(key, 2 * self.timeout + 5)
        except TimeoutError:
            raise self._late([src]) from None

    def all_gather(self, data: bytes) -> list[bytes]:
        try:
            parts = self.gather(data, 0)
            failure = None
        except CoordinationError as e:  # rank 0 names the late ranks to everyone
            parts, failure = None, e
        self._next()
        if self.world_size == 1:
            return parts  # type: ignore[return-value]
        key = self._key("b")
        if self.rank != 0:
            raw = self._wait_root(key, 0)
            out, pos = [], 0
            for _ in range(self.world_size):
                n = int.from_bytes(raw[pos:pos + 8], "little")
                out.append(raw[pos + 8:pos + 8 + n])
                pos += 8 + n
            return out
        if failure is not None:
            self._client.key_value_set_bytes(key, _FAIL + str(failure).encode())
            raise failure
        self._put(key, b"".join(len(p).to_bytes(8, "little") + p for p in parts))  # type: ignore[union-attr]
        return parts  # type: ignore[return-value]

    def scatter(self, parts: Sequence[bytes] | None, src: int = 0) -> bytes:
        self._next()
        if self.world_size == 1:
            return bytes(parts[0])  # type: ignore[index]
        if self.rank == src:
            for r, p in enumerate(parts):  # type: ignore[arg-type]
                if r != src:
                    self._put(self._key("s", r), bytes(p))
            return bytes(parts[src])  # type: ignore[index]
        return self._wait_root(self._key("s", self.rank), src)

    def arrive(self, what: str) -> None:
        """Wait for every process to enter ``what``, naming those that do not within the timeout; then
        start a new epoch of keys and drop the previous one's."""
        self._what = what
        if self.world_size == 1:
            return
        self.all_gather(b"")
        old = self._n.epoch
        self._n.epoch, self._n.op = old + 1, 0
        if self.rank == 0 and old > 0:  # everyone arrived in `old`: nobody reads epoch old - 1 any more
            self._delete(f"hyperdcp/{old - 1}")
