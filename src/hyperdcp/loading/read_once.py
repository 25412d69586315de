"""Read-once loads, the running half: every stored byte that some rank needs is read by exactly one rank.

:func:`read_once` exchanges the plans (one ``all_gather``, which also carries host identities,
shared-memory segment names and planning errors), computes this host's part of the schedule with
:mod:`hyperdcp.planning.read_once_local` (:mod:`hyperdcp.planning.read_once` describes the whole
algorithm; one more small checked ``all_gather`` agrees on the number of batches), then runs it
(:class:`_Exchange`): a background thread reads and verifies batch k+1 while the main thread moves
batch k, through same-host shared memory (:mod:`hyperdcp.coordination.shm`) or a
:class:`~hyperdcp.coordination.base.Transport` (point to point, and broadcasts in a mesh's groups).
Other ranks are reached only through the Coordinator and the Transport; no framework is imported.

Call order, every rank (ranks that need nothing too): ``read_once(files, meta, pieces, coord, opts,
tensors, plan_error)``. A coordinator that is not a Transport (one process, the file coordinator)
makes each rank read what it needs itself.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..coordination.base import Coordinator, Transport
from ..coordination.checked import all_gather_checked, check_all, encode_status, raise_remote
from ..coordination.shm import (
    SEGMENT_RE,
    SHM_DIR,
    Segment,
    free_bytes,
    host_key,
    shm_enabled,
    sigterm_cleanup,
    unlink_live,
)
from ..core import dtypes, wire
from ..core.shards import ShardedTensor
from ..errors import CheckpointError, CoordinationError, MismatchError
from ..format.metadata import Metadata
from ..options import LoadOptions
from ..planning.load_plan import ChunkRead, Piece, byte_shape, byte_span, dst_view, group_reads, src_view
from ..planning.read_once import (
    Need,
    Schedule,
    ShmLayout,
    Unit,
    _own_plan,
    broadcast_groups,
    encode_plan,
    layout_digest,
    mark_broadcasts,
    presize,
    shm_layout,
)
from ..planning.read_once_local import local_schedule as build_schedule  # (the name tests spy on)
from ..planning.read_once_local import pad_batches
from ..planning.read_once_plans import plans_to_wants
from ..planning.read_once_wants import grid_wants
from ..sources.base import ChunkReader as DataFiles
from .coalesced_reads import CoalescedReads
from .reads import copy_piece, execute_local_reads, read_chunk

# -- plan headers ---------------------------------------------------------------------------------


def _head(raw: bytes) -> dict[str, Any]:
    try:
        head, _ = wire.unpack(raw)
    except (ValueError, KeyError, TypeError):
        raise MismatchError(
            "read-once: a rank sent a malformed plan; do all ranks run the same hyperdcp version?"
        ) from None
    return head if isinstance(head, dict) else {}


def _layout_of(head: dict[str, Any]) -> str:
    d = head.get("layout", "")
    return d if isinstance(d, str) else ""


def _peer(head: dict[str, Any], rank: int) -> tuple[str, str, int]:
    """(host, segment name, free /dev/shm bytes) from a rank's plan header."""
    host, name, free = head.get("host"), head.get("shm", ""), head.get("shm_free", 0)
    if not isinstance(host, str) or not host:
        host = f"unknown-host-of-rank-{rank}"  # never shares memory
    if not isinstance(name, str) or (name and not SEGMENT_RE.match(name)):
        raise MismatchError(f"read-once: rank {rank} sent a malformed shared-memory segment name {name!r}")
    if not isinstance(free, int) or free < 0:
        free = 0
    return host, name, free


# -- execution ------------------------------------------------------------------------------------


@dataclass
class _Msg:
    """One point-to-point message of a batch, from this rank's side."""

    peer: int
    tag: int
    nbytes: int
    unit: Unit | None = None  # direct message: one contiguous need of this unit
    need: Need | None = None
    packed: list[tuple[Unit, Need, int]] | None = None  # packed message: (unit, need, offset)


def _messages(batch: list[Unit], me: int, shm: ShmLayout | None = None) -> tuple[list[_Msg], list[_Msg]]:
    """This rank's sends and receives for one batch (the peer computes the mirror image)."""
    pairs_out: dict[int, list] = {}
    pairs_in: dict[int, list] = {}
    for u in batch:
        if u.bcast:
            continue
        for n in u.needs:
            if n.rank == u.reader or (shm is not None and shm.via(u, n.rank)):
                continue
            if u.reader == me:
                pairs_out.setdefault(n.rank, []).append((u, n))
            elif n.rank == me:
                pairs_in.setdefault(u.reader, []).append((u, n))

    def build(pairs: dict[int, list]) -> list[_Msg]:
        msgs = []
        for peer in sorted(pairs):
            packed, off, tag = [], 0, 1
            for u, n in pairs[peer]:
                if n.contiguous:
                    msgs.append(_Msg(peer, tag, n.nbytes, unit=u, need=n))
                    tag += 1
                else:
                    packed.append((u, n, off))
                    off += n.nbytes
            if packed:
                msgs.append(_Msg(peer, 0, off, packed=packed))
        return msgs

    return build(pairs_out), build(pairs_in)


class _Exchange:
    """Runs a schedule on one rank."""

    def __init__(self, files: DataFiles, meta: Metadata, pieces: Sequence[Piece], coord: Coordinator,
                 opts: LoadOptions, sched: Schedule, shm: ShmLayout | None = None, seg: Segment | None = None):
        self.files, self.meta, self.pieces, self.coord, self.opts, self.sched = files, meta, pieces, coord, opts, sched
        self.shm, self.seg = shm, seg
        self.bgroups: dict[int, Any] = {}  # uid -> process group, for the broadcast units this rank is in
        self.own_map: mmap.mmap | None = None  # this rank's segment, written by its reads
        self.maps: dict[int, mmap.mmap] = {}  # same-host readers' segments, read by this rank
        self.peer_fds: dict[int, int] = {}  # same-host segments held open by read_once (it closes them)
        self.me = coord.rank
        self.names = list(meta.tensors)
        self.transport: Transport = coord  # type: ignore[assignment] - read_once checked it
        self.request_bytes = 0  # the storage's request size (0: local files): adjacent units coalesce up to it

    # reading (background thread) ---------------------------------------------------------------
    def _piece(self, u: Unit, n: Need) -> Piece:
        p = self.pieces[n.entry]
        return Piece(p.fqn, p.chunk, n.box, p.dst, p.dst_dtype)

    def _chunk_read(self, u: Unit, pieces: list[Piece]) -> ChunkRead:
        t = self.meta.tensors[self.names[u.tidx]]
        return ChunkRead(self.names[u.tidx], u.chunk, int(t.chunks.file[u.chunk]), int(t.chunks.begin[u.chunk]),
                         u.lo, u.hi, pieces)

    def prepare(self, k: int) -> dict[str, Any]:
        """Read and verify this rank's units of batch k, fill its own pieces, pack its messages."""
        if k == 0 and self.shm is not None:
            self._map_segments()
        batch = self.sched.batches[k]
        sends, recvs = _messages(batch, self.me, self.shm)
        mine = [u for u in batch if u.reader == self.me]
        bufs: dict[int, tuple[np.ndarray, ChunkRead]] = {}
        files = self.files
        if self.request_bytes and len(mine) > 1:  # object stores: adjacent units of a file in one request
            slot, at = None, None
            if self.shm is not None and self.own_map is not None and self.shm.slot[self.me]:
                # units with a slot lie in it in file order: their runs are read straight into the slot
                size = self.shm.slot[self.me]
                slot = np.frombuffer(self.own_map, dtype=np.uint8, count=size, offset=(k % self.shm.nslots) * size)
                at = [self.shm.offset.get(u.uid, -1) for u in mine]
            files = CoalescedReads(files, [(r.file, r.begin + r.lo, r.nbytes) for r in
                                           (self._chunk_read(u, []) for u in mine)], self.request_bytes, slot, at)

        def one(u: Unit) -> None:
            own = [self._piece(u, n) for n in u.needs if n.rank == self.me]
            read = self._chunk_read(u, own)
            only_me = all(n.rank == self.me for n in u.needs)
            out = self._slot(self.me, k, u) if self.shm is not None and u.uid in self.shm.offset else None
            buf, direct = read_chunk(files, self.meta, read, self.opts.verify_checksums, direct_ok=only_me, out=out)
            if not direct and out is None:  # from a slot, the main thread copies (see _copy_from_shm)
                for p in own:
                    if p.dst is not None:
                        copy_piece(buf, read, self.meta, p)
            if not only_me:
                bufs[u.uid] = (buf, read)

        if self.opts.read_threads > 1 and len(mine) > 1:
            with ThreadPoolExecutor(min(self.opts.read_threads, len(mine))) as ex:
                list(ex.map(one, sorted(
                    mine, key=lambda u: (self.meta.tensors[self.names[u.tidx]].chunks.file[u.chunk], u.uid))))
        else:
            for u in mine:
                one(u)

        out = []
        for m in sends:
            if m.packed is None:
                out.append((m, self._src(bufs, m.unit, m.need, flat=True)))
            else:
                flat = np.empty(m.nbytes, dtype=np.uint8)
                for u, n, off in m.packed:
                    isz = dtypes.itemsize(self.meta.tensors[self.names[u.tidx]].dtype)
                    np.copyto(flat[off : off + n.nbytes].reshape(byte_shape(n.box.lengths, isz)),
                              self._src(bufs, u, n, flat=False))
                out.append((m, flat))
        bsend = {u.uid: self._src(bufs, u, u.needs[0], flat=True) for u in mine if u.bcast}
        return {"sends": out, "recvs": recvs, "bsend": bsend, "batch": batch}

    # shared memory ---------------------------------------------------------------------------------
    def _map_segments(self) -> None:
        """Map this rank's segment (to fill) and those of same-host readers it takes pieces from."""
        shm, me = self.shm, self.me
        size = shm.nslots * shm.slot[me]
        if size and self.seg is not None:
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(self.seg.fd, 0, size)  # /dev/shm full: an error here, not SIGBUS later
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    pass  # no reservation on this file system; the free-space check before the load still applies
                else:
                    raise CheckpointError(
                        f"read-once: rank {me} cannot reserve {size} bytes of shared memory in {self.seg.path} "
                        f"({e.strerror or e}); free /dev/shm, lower read_once_batch_bytes or set "
                        "HYPERDCP_READ_ONCE_SHM=0"
                    ) from None
            try:
                self.own_map = mmap.mmap(self.seg.fd, size)
            except (OSError, ValueError) as e:
                raise CheckpointError(
                    f"read-once: rank {me} cannot map its shared memory {self.seg.path} ({e})"
                ) from None
        peers = sorted({u.reader for b in self.sched.batches for u in b for n in u.needs
                        if n.rank == me and shm.via(u, me)})
        for r in peers:
            path = os.path.join(SHM_DIR, shm.names[r])
            try:
                held = self.peer_fds.get(r)  # opened before the last planning collective
                fd = held if held is not None else os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
                                                           | getattr(os, "O_NOFOLLOW", 0))
                try:
                    self.maps[r] = mmap.mmap(fd, shm.nslots * shm.slot[r], prot=mmap.PROT_READ)
                finally:
                    if held is None:
                        os.close(fd)
            except (OSError, ValueError) as e:
                raise CheckpointError(
                    f"read-once: rank {me} cannot map the shared memory of rank {r} ({path}: {e}); ranks with the "
                    "same host identity must share /dev/shm (set HYPERDCP_HOST to tell hosts apart, or "
                    "HYPERDCP_READ_ONCE_SHM=0)"
                ) from None

    def _slot(self, reader: int, k: int, u: Unit) -> np.ndarray:
        """Unit ``u``'s bytes in ``reader``'s segment, in the slot of batch ``k``."""
        shm = self.shm
        m = self.own_map if reader == self.me else self.maps[reader]
        start = (k % shm.nslots) * shm.slot[reader] + shm.offset[u.uid]
        return np.frombuffer(m, dtype=np.uint8, count=u.nbytes, offset=start)

    def _copy_from_shm(self, k: int) -> None:
        for u in self.sched.batches[k]:
            for n in u.needs:
                # this rank's own pieces of the units it read into its slot, too: the reading thread
                # goes on with the next batch meanwhile (batch k's slot is reused only after exchange k+1)
                if n.rank == self.me and (self.shm.via(u, self.me)
                                          or (u.reader == self.me and u.uid in self.shm.offset)):
                    p = self._piece(u, n)
                    if p.dst is not None:
                        copy_piece(self._slot(u.reader, k, u), self._chunk_read(u, []), self.meta, p)

    def close(self) -> None:
        maps, self.maps = list(self.maps.values()) + ([self.own_map] if self.own_map is not None else []), {}
        self.own_map = None
        for m in maps:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with it
                pass
        if self.seg is not None:
            self.seg.close()

    def _src(self, bufs, u: Unit, n: Need, flat: bool) -> np.ndarray:
        buf, read = bufs[u.uid]
        t = self.meta.tensors[self.names[u.tidx]]
        cb = t.chunks.box(u.chunk)
        if flat:  # contiguous: a slice of the read buffer, no copy
            s, _ = byte_span(cb, n.box, dtypes.itemsize(t.dtype))
            return buf[s - read.lo : s - read.lo + n.nbytes]
        return src_view(buf, read, cb, n.box, t.dtype, typed=False)

    # moving (main thread) -------------------------------------------------------------------------
    def _dst(self, u: Unit, n: Need) -> tuple[Piece, np.ndarray | None]:
        """The destination piece, and its memory as a flat byte array when bytes can land there directly."""
        p = self._piece(u, n)
        t = self.meta.tensors[p.fqn]
        if p.dst is None or p.dst_dtype != t.dtype:
            return p, None
        view = dst_view(p.dst, n.box, p.dst_dtype, typed=False)
        return p, (view.reshape(-1) if view.flags.c_contiguous else None)

    def _place(self, packed: np.ndarray, p: Piece) -> None:
        if p.dst is None:
            return
        t = self.meta.tensors[p.fqn]
        cast = p.dst_dtype != t.dtype
        if cast:
            src = packed.view(dtypes.to_numpy(t.dtype)).reshape(p.box.lengths)
        else:
            src = packed.reshape(p.box.lengths + (dtypes.itemsize(t.dtype),))
        np.copyto(dst_view(p.dst, p.box, p.dst_dtype, typed=cast), src, casting="unsafe")

    def transfer(self, state: dict[str, Any], k: int = -1) -> None:
        """Move batch ``k``: post receives, sends and broadcasts, copy shared-memory pieces meanwhile,
        then wait and place what was received into staging buffers."""
        tr, works, after = self.transport, [], []
        for m in state["recvs"]:
            if m.packed is None:
                p, direct = self._dst(m.unit, m.need)
                buf = direct if direct is not None else np.empty(m.nbytes, dtype=np.uint8)
                if direct is None:
                    after.append((buf, [(p, 0, m.nbytes)]))
            else:
                buf = np.empty(m.nbytes, dtype=np.uint8)
                after.append((buf, [(self._piece(u, n), off, n.nbytes) for u, n, off in m.packed]))
            works.append(tr.irecv(buf, m.peer, m.tag))
        for m, payload in state["sends"]:
            works.append(tr.isend(payload, m.peer, m.tag))
        for u in state["batch"]:  # every member issues its group's broadcasts in the same (uid) order
            if not u.bcast or u.uid not in self.bgroups:
                continue
            if u.reader == self.me:
                buf = state["bsend"][u.uid]
            else:
                n = next(n for n in u.needs if n.rank == self.me)
                p, direct = self._dst(u, n)
                buf = direct if direct is not None else np.empty(n.nbytes, dtype=np.uint8)
                if direct is None:
                    after.append((buf, [(p, 0, n.nbytes)]))
            works.append(tr.broadcast_in(buf, u.reader, self.bgroups[u.uid]))
        if self.shm is not None and k >= 0:
            self._copy_from_shm(k)  # while the point-to-point messages are in flight
        tr.wait(works)
        for buf, parts in after:
            for p, off, nb in parts:
                self._place(buf[off : off + nb], p)

    def run(self) -> None:
        nb = len(self.sched.batches)
        if nb == 0:
            return
        # Reading runs ahead of moving. Point to point: one batch ahead (bounded memory). Shared memory
        # with S slots: batch m reuses the slot of batch m-S, which every consumer copied out before it
        # entered exchange m-S+1; so once this rank is past exchange k it may read up to batch k+S-1.
        S = self.shm.nslots if self.shm is not None else 0
        before, after = (S - 2, S - 1) if S else (1, 1)  # batches ahead, before and after exchange k
        futs: dict[int, Any] = {}
        submitted = [0]  # batches handed to the reading thread so far

        def submit_upto(m: int) -> None:
            while submitted[0] <= min(m, nb - 1):
                futs[submitted[0]] = ex.submit(self.prepare, submitted[0])
                submitted[0] += 1

        with ThreadPoolExecutor(1, thread_name_prefix="hyperdcp-read-once") as ex:
            submit_upto(0)
            for k in range(nb):
                state, exc = None, None
                try:
                    state = futs.pop(k).result()
                except Exception as e:  # noqa: BLE001 - reported to every rank below
                    exc = e
                if exc is None:
                    submit_upto(k + before)  # past exchange k-1
                try:
                    check_all(self.coord, f"read-once load (batch {k + 1} of {nb})", exc)
                except BaseException:
                    for f in futs.values():
                        f.cancel()
                    raise
                if k == 0 and self.seg is not None:
                    self.seg.unlink()  # every consumer mapped it before exchange 0
                submit_upto(k + after)  # past exchange k
                self.transfer(state, k)
                state = None


def read_once(files: DataFiles, meta: Metadata, pieces: list[Piece], coord: Coordinator, opts: LoadOptions,
              tensors: Sequence[ShardedTensor] | None = None, plan_error: BaseException | None = None,
              plan_what: str = "planning the load") -> Schedule | None:
    """Fill ``pieces`` reading every needed stored byte once across the ranks of ``coord``.

    Every rank must call it (with an empty list when it needs nothing). ``tensors``: the destination
    tensors ``pieces`` were planned from, in that order; when every rank's have grid layouts that
    agree, plans are derived locally and only a digest is exchanged. ``plan_error``: this rank's
    planning failed; it travels with the plan exchange, so a failure anywhere raises on every rank
    (as ``plan_what``) before anything is read, at no extra collective. Coordinators without a
    Transport (one process, files) fall back to each rank reading what it needs.
    """
    if coord.world_size <= 1 or not isinstance(coord, Transport):
        check_all(coord, plan_what, plan_error)
        execute_local_reads(files, meta, group_reads(meta, pieces, opts.verify_checksums), opts)
        return None
    # the storage's preferred request size (object stores: one ranged GET); rank 0's is used everywhere
    req = getattr(getattr(files, "storage", None), "max_request_bytes", 0)
    seg, extra = None, {"host": host_key(opts.host_id or ""), "shm": "", "shm_free": 0,
                        "io": req if isinstance(req, int) and req > 0 else 0}
    size = presize(meta, opts.read_once_batch_bytes)
    if shm_enabled(opts.shared_memory):
        try:
            seg = Segment(size)
            extra.update(shm=seg.name, shm_free=free_bytes(SHM_DIR))
        except OSError:  # no usable /dev/shm here: this rank's units go point to point
            seg = None
    ex = None
    peer_fds: dict[int, int] = {}  # same-host segments held open (see plan_part)
    guard = sigterm_cleanup(unlink_live) if seg is not None else contextlib.nullcontext()
    try:
        guard.__enter__()  # SIGTERM while this rank's segment is named: unlink it, then terminate as before
        try:
            digest = layout_digest(meta, tensors, pieces, coord.rank, coord.world_size)
        except (KeyError, ValueError, IndexError):
            digest = ""
        # one exchange of fixed-size records when the layouts agree everywhere, else of the plans
        err = encode_status(plan_error).decode("utf-8", "replace") if plan_error is not None else ""
        raws = coord.all_gather(encode_plan(meta, [] if digest else pieces, {**extra, "layout": digest, "err": err}))
        heads = [_head(raw) for raw in raws]  # parsed once: host, segment, digest, error
        errs = [h.get("err") or "" for h in heads]
        if any(errs):
            raise_remote([e.encode("utf-8") if isinstance(e, str) and e else encode_status(None) for e in errs],
                         coord, plan_what, plan_error)
        io = heads[0].get("io", 0)  # every rank cuts the units alike: by rank 0's request size
        io = min(int(io), 1 << 30) if isinstance(io, int) and io > 0 else 0
        digests = {_layout_of(h) for h in heads}
        derived = bool(digest) and digests == {digest}
        me, world = coord.rank, coord.world_size
        peers = [_peer(h, r) for r, h in enumerate(heads)]
        hosts, names, frees = [p[0] for p in peers], [p[1] for p in peers], [p[2] for p in peers]
        local = [r for r, h in enumerate(hosts) if h == hosts[me]]  # this host's ranks share its placement

        def plan_part() -> bytes:
            nonlocal sched
            if derived:  # every rank's needs follow from the layouts: only this host's chunks are looked at
                own = {(ti, ci, box): e for e, (ti, ci, box) in enumerate(_own_plan(meta, pieces))}
                wants = grid_wants(meta, tensors, world, local, own, me)
            else:
                plans = raws
                if digests != {""}:  # some ranks sent only a digest, so the layouts differ: exchange the plans
                    plans = coord.all_gather(encode_plan(meta, pieces, extra))
                wants = plans_to_wants(meta, plans, local)  # checked as arrays; only this host's chunks kept
            sched = build_schedule(meta, wants, opts.verify_checksums, opts.read_once_batch_bytes, me, io)
            # hold this host's segments open before the next collective: a rank failing after it cannot
            # take its segment away from the ranks that copy out of it (the name goes, the memory stays)
            for r in local:
                if r != me and names[r]:
                    with contextlib.suppress(OSError):
                        peer_fds[r] = os.open(os.path.join(SHM_DIR, names[r]), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
                                              | getattr(os, "O_NOFOLLOW", 0))
            return str(len(sched.batches)).encode()

        sched: Schedule | None = None
        # every rank runs as many batches as the rank with the most (each batch ends in a collective)
        nbs = all_gather_checked(coord, "planning the read-once schedule", plan_part)
        raws = []  # nothing kept of the other ranks' plans
        pad_batches(sched, max(int(b) for b in nbs))
        lines, handles = (broadcast_groups(tensors, me, world, None)
                          if derived and opts.read_once_broadcast else (set(), {}))
        mark_broadcasts(sched, lines, hosts)
        shm = shm_layout(sched, hosts, names, frees, size, local)
        sched.shm = shm
        sched.derived = derived
        if not shm.offset:
            shm = None
        if seg is not None and (shm is None or not shm.slot[me]):
            seg.close()  # nobody maps it
            seg = None
        ex = _Exchange(files, meta, pieces, coord, opts, sched, shm, seg)
        ex.peer_fds = peer_fds
        ex.request_bytes = io
        for u in sched.units:
            if u.bcast and any(n.rank == coord.rank for n in u.needs):
                members = frozenset(u.group.tolist())
                if members not in handles:  # DeviceMesh groups exist for every member: not expected
                    raise CoordinationError(f"read-once: rank {coord.rank} has no process group for ranks "
                                            f"{sorted(members)}; pass read_once_broadcast=False")
                ex.bgroups[u.uid] = handles[members]
        ex.run()
    finally:
        if ex is not None:
            ex.close()
        elif seg is not None:
            seg.close()
        for fd in peer_fds.values():
            os.close(fd)
        guard.__exit__(None, None, None)
    return sched
