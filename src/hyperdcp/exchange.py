"""Read-once loads: every stored byte that some rank needs is read from storage by exactly one rank.

Flow (every rank runs the same steps; ranks that need nothing take part too):

1. **Plans.** Every rank needs every rank's pieces (tensor index, chunk index, box). When each of its
   destination tensors has a :class:`~hyperdcp.core.layout.GridLayout` (a DTensor's mesh and
   placements, or a tensor every rank holds whole) and the layout rule reproduces its own plan, a rank
   sends only a digest of its layouts; if all digests agree every rank derives all plans itself
   (:func:`derive_plans`), else the plans are packed as int arrays (:mod:`hyperdcp.coordination.wire`,
   no pickle) and exchanged. Either way one ``all_gather`` of small records also carries the host
   identity, the shared-memory segment name and any planning error (raised on every rank).
2. **Schedule.** From all plans every rank computes the same global schedule: per stored chunk the
   ranks needing parts of it, cut into *units* (contiguous row-slabs of the chunk, sized so that each
   reader has about ``_ROUNDS`` batches of ``_UNITS_PER_ROUND`` units, never above the batch bound),
   the byte span to read (widened to whole checksum blocks when verifying), and one *reader* among the
   ranks that need it. Units only one rank needs are read by that rank; the others go, largest first,
   to the needing rank with the fewest bytes read so far (ties rotate, so it is not always the lowest
   rank).
3. **Batches** are rounds: in each, every reader takes its next units in file order (sequential reads)
   up to its share; bytes packed to send and point-to-point receive buffers stay under
   ``read_once_batch_bytes`` per rank (pieces copied out of same-host shared memory need no receive
   buffer). A background thread reads and verifies batches ahead (their units in parallel threads)
   while the main thread moves the current one. After each batch one all-reduce of an error flag makes
   a read or checksum error on one rank fail the load on every rank instead of leaving the others
   waiting for its data (the error texts are gathered only then).
4. **Transfers.** Same host: shared memory (below). A unit whose needers all want the same contiguous
   bytes, form exactly one dim group of a DeviceMesh and sit on other hosts than the reader goes by one
   ``broadcast`` in that mesh's own process group (:func:`mark_broadcasts`; decided from what every
   rank knows, so all members issue the same broadcasts in the same order; no group is ever created).
   The rest is point-to-point (``isend``/``irecv`` on the coordinator's gloo group): a piece that is
   contiguous in the stored chunk is sent straight out of the read buffer to every rank that needs it
   and received straight into its destination memory when that is contiguous and of the stored dtype;
   other pieces (column slices of a reshard) are packed, one flat message per pair of ranks and batch.
5. **Same host: shared memory.** Each rank sends its host identity (hostname, boot id and the device of
   ``/dev/shm``; ``HYPERDCP_HOST`` overrides it) and the name of a ``/dev/shm`` segment it created with
   its plan. When a unit's reader and some of its consumers share a host, the reader reads the unit
   straight into its segment (three slots of about one batch, reused in turn) and every rank on that
   host, the reader included, copies its pieces from it into its destination on its main thread: one
   copy, no TCP. Batch k+1 goes into the slot of batch k-2, which every rank finished copying before it
   entered exchange k-1; so a rank past exchange k may read up to batch k+2. Segments are unlinked as
   soon as every consumer has mapped them (after the first exchange), else on error and at exit.
   ``HYPERDCP_READ_ONCE_SHM=0`` turns the path off.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import mmap
import os
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .coordination import wire
from .coordination.base import Coordinator, _status, check_all, raise_remote
from .core import dtypes
from .core.boxes import Box
from .core.layout import mesh_lines
from .core.shards import ShardedTensor
from .errors import CheckpointError, CoordinationError, MismatchError
from .format.metadata import Metadata
from .options import LoadOptions
from .planning.load_plan import ChunkRead, Piece, byte_shape, byte_span, dst_view, group_reads, src_view
from .storage.checksum import block_range
from .storage.reader import DataFiles

_PLAN_VERSION = 1


@dataclass
class Need:
    """Part ``box`` of a unit, needed by ``rank`` (its local piece number ``entry``)."""

    rank: int
    entry: int
    box: Box
    nbytes: int
    contiguous: bool  # the box is one contiguous byte range of the stored chunk


@dataclass
class Unit:
    """One read: bytes [lo, hi) of chunk ``chunk`` of tensor ``tidx``, serving ``needs``."""

    uid: int
    tidx: int
    chunk: int
    lo: int
    hi: int
    needs: list[Need]
    reader: int = -1
    bcast: bool = False  # identical bytes for every needer, who form one mesh-dim group: a broadcast

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo

    @property
    def ranks(self) -> set[int]:
        return {n.rank for n in self.needs}


@dataclass
class Schedule:
    """The global read-once schedule (identical on every rank)."""

    units: list[Unit]
    batches: list[list[Unit]]
    read_bytes: list[int]  # planned bytes read per rank
    sent_bytes: list[int] = field(default_factory=list)
    shm: Any = None  # the ShmLayout of the load, once hosts are known
    derived: bool = False  # plans derived from grid layouts (only digests exchanged)


# -- plans ------------------------------------------------------------------------------------


def encode_plan(meta: Metadata, pieces: Sequence[Piece], extra: dict[str, Any] | None = None) -> bytes:
    """This rank's pieces as (tensor index, chunk index, box) integer arrays (``extra``: header fields)."""
    index = {name: i for i, name in enumerate(meta.tensors)}
    t = np.fromiter((index[p.fqn] for p in pieces), dtype=np.int32, count=len(pieces))
    c = np.fromiter((p.chunk for p in pieces), dtype=np.int64, count=len(pieces))
    coords = [x for p in pieces for x in (*p.box.offsets, *p.box.lengths)]
    head = {"v": _PLAN_VERSION, "n": len(pieces), **(extra or {})}
    return wire.pack(head, {"t": t, "c": c, "b": np.asarray(coords, dtype=np.int64)})


def decode_plan(meta: Metadata, raw: bytes, rank: int) -> list[tuple[int, int, Box]]:
    """Decode and validate another rank's plan; a malformed plan raises naming the rank."""
    names = list(meta.tensors)
    try:
        head, arrs = wire.unpack(raw)
        if head.get("v") != _PLAN_VERSION:
            raise ValueError(f"plan version {head.get('v')!r}")
        n = int(head["n"])
        t, c, b = arrs["t"].tolist(), arrs["c"].tolist(), arrs["b"].tolist()
        if len(t) != n or len(c) != n:
            raise ValueError("array lengths differ")
        out, pos = [], 0
        for ti, ci in zip(t, c):
            tm = meta.tensors[names[ti]] if 0 <= ti < len(names) else None
            if tm is None or not 0 <= ci < len(tm.chunks):
                raise ValueError(f"piece refers to tensor {ti} chunk {ci}, not in the checkpoint")
            nd = len(tm.shape)
            box = Box(tuple(b[pos : pos + nd]), tuple(b[pos + nd : pos + 2 * nd]))
            pos += 2 * nd
            if box.numel <= 0 or box.intersect(tm.chunks.box(ci)) != box:
                raise ValueError(f"box {box} of {names[ti]!r} is not inside chunk {tm.chunks.box(ci)}")
            out.append((ti, ci, box))
        if pos != len(b):
            raise ValueError("trailing box coordinates")
        return out
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise MismatchError(f"read-once: the load plan of rank {rank} is malformed ({e}); do all ranks run the same hyperdcp version?") from None


def _own_plan(meta: Metadata, pieces: Sequence[Piece]) -> list[tuple[int, int, Box]]:
    index = {name: i for i, name in enumerate(meta.tensors)}
    return [(index[p.fqn], p.chunk, p.box) for p in pieces]


def layout_digest(meta: Metadata, tensors: Sequence[ShardedTensor] | None, pieces: Sequence[Piece], me: int,
                  world: int) -> str:
    """A digest of this rank's tensors and their grid layouts, or "" when other ranks cannot derive its plan.

    Derivable means: every tensor has a :class:`~hyperdcp.core.layout.GridLayout` and the plan derived
    from the layouts for this rank is exactly the plan it would send -- so a rule that differs from
    the framework's (another torch version, say) falls back to exchanging plans, never loads wrong bytes.
    """
    if tensors is None or any(t.layout is None or not t.layout.valid_for(len(t.shape), world) for t in tensors):
        return ""
    if derive_plans(meta, tensors, world, only=me)[me] != _own_plan(meta, pieces):
        return ""
    names = {name: i for i, name in enumerate(meta.tensors)}
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray([world, len(tensors)], dtype=np.int64).tobytes())
    for t in tensors:
        h.update(np.asarray([names[t.fqn]], dtype=np.int64).tobytes())
        h.update(t.layout.key(tuple(t.shape)))
    return h.hexdigest()


def derive_plans(meta: Metadata, tensors: Sequence[ShardedTensor], world: int,
                 only: int | None = None) -> list[list[tuple[int, int, Box]]]:
    """Every rank's plan (or just rank ``only``'s), computed from the tensors' grid layouts.

    The same pieces, in the same order, as each rank's own :func:`~hyperdcp.planning.load_plan.pieces_for`
    over its tensors: boxes shared by replicas are intersected with the stored chunks once.
    """
    from .planning.load_plan import TensorIndex

    names = {name: i for i, name in enumerate(meta.tensors)}
    tindex = TensorIndex(meta)
    plans: list[list[tuple[int, int, Box]]] = [[] for _ in range(world)]
    grouped: dict[bytes, tuple[list[int], list[int], list[Box]]] = {}  # tensors of one shape and layout share it
    inter_cache: dict[bytes, list[list[tuple[int, Box]]]] = {}
    for st in tensors:
        ti = names[st.fqn]
        stored = meta.tensors[st.fqn]
        key = st.layout.key(tuple(stored.shape))
        hit = grouped.get(key)
        if hit is None:
            ranks, offs, lens = st.layout.boxes(tuple(stored.shape))
            if only is not None:
                keep = ranks == only
                ranks, offs, lens = ranks[keep], offs[keep], lens[keep]
            rows = np.ascontiguousarray(np.concatenate([offs, lens], axis=1))
            nd = offs.shape[1]
            if len(rows) and nd == 0:  # scalars: one empty-coordinate box
                inv, boxes = np.zeros(len(rows), np.int64), [Box((), ())]
            elif len(rows):  # distinct boxes (replicas share one) through a 1-D view of the rows
                _, first, inv = np.unique(rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).reshape(-1),
                                          return_index=True, return_inverse=True)
                boxes = [Box(tuple(r[:nd]), tuple(r[nd:])) for r in rows[first].tolist()]
            else:
                inv, boxes = np.zeros(0, np.int64), []
            hit = grouped[key] = (ranks.tolist(), inv.reshape(-1).tolist(), boxes)
        ranks_l, inv_l, boxes = hit
        # tensors stored on the same chunk grid (every layer of a model) intersect alike
        ch = stored.chunks
        gkey = key + hashlib.blake2b(np.ascontiguousarray(ch.offsets).tobytes() + b"|" +
                                     np.ascontiguousarray(ch.lengths).tobytes(), digest_size=16).digest()
        per_box_c = inter_cache.get(gkey)
        if per_box_c is None:
            per_box_c = []
            for box in boxes:
                out = []
                if box.numel > 0:
                    for c in tindex.get(st.fqn).query(box).tolist():
                        inter = box.intersect(ch.box(c))
                        if inter is not None:
                            out.append((c, inter))
                per_box_c.append(out)
            inter_cache[gkey] = per_box_c
        per_box = [[(ti, c, inter) for c, inter in out] for out in per_box_c]
        for r, b in zip(ranks_l, inv_l):
            plans[r].extend(per_box[b])
    return plans


# -- same-host shared memory ------------------------------------------------------------------

_SHM_DIR = "/dev/shm"
_SHM_RE = re.compile(r"hyperdcp-ro-[0-9a-f]+-\d+-\d+-[0-9a-f]{12}\Z")  # see hyperdcp.shm: owner pid and start time
_ALIGN = 64
_NSLOTS = 3  # batch k+1 is read into the slot of batch k-2, which every consumer has copied out before exchange k-1
_LIVE: set[str] = set()  # segments this process created and has not unlinked yet
_LIVE_LOCK = threading.Lock()
_ATEXIT = False


def _unlink_live() -> None:
    with _LIVE_LOCK:
        paths = list(_LIVE)
        _LIVE.clear()
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def host_key() -> str:
    """What ranks sharing a host (and its /dev/shm) have in common; ``HYPERDCP_HOST`` overrides it."""
    forced = os.environ.get("HYPERDCP_HOST")
    if forced:
        return "forced:" + forced
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        dev = os.stat(_SHM_DIR).st_dev
    except OSError:
        dev = -1
    return f"{socket.gethostname()}|{boot}|{dev}"


def shm_enabled() -> bool:
    if os.environ.get("HYPERDCP_READ_ONCE_SHM", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK)


class _Segment:
    """This rank's /dev/shm file, created empty and sparse before the plan exchange."""

    def __init__(self, size: int):
        global _ATEXIT
        from . import shm

        shm.reclaim(_SHM_DIR)  # segments and staging areas of processes killed before they could unlink them
        self.name = shm.new_name("ro")
        self.path = os.path.join(_SHM_DIR, self.name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        self.fd = os.open(self.path, flags, 0o600)
        with _LIVE_LOCK:
            _LIVE.add(self.path)
            if not _ATEXIT:
                atexit.register(_unlink_live)
                _ATEXIT = True
        try:
            os.ftruncate(self.fd, size)  # sparse: no memory until written
        except BaseException:
            self.close()
            raise
        self.size = size

    def unlink(self) -> None:
        with _LIVE_LOCK:
            live = self.path in _LIVE
            _LIVE.discard(self.path)
        if live:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def close(self) -> None:
        self.unlink()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _shm_free() -> int:
    try:
        st = os.statvfs(_SHM_DIR)
        return int(st.f_bavail * st.f_frsize)
    except OSError:
        return 0


def _presize(meta: Metadata, batch_bytes: int) -> int:
    """The sparse size of every segment (two slots), known before the plans are exchanged."""
    big = 0
    for t in meta.tensors.values():
        if len(t.chunks):
            big = max(big, int((np.asarray(t.chunks.end) - np.asarray(t.chunks.begin)).max()))
    return _NSLOTS * (max(int(batch_bytes), big) + (16 << 20))


@dataclass
class ShmLayout:
    """Which units go through shared memory, and where (identical on every rank)."""

    hosts: list[str]
    names: list[str]  # segment name per rank ("" for none)
    slot: list[int]  # bytes per slot per reader (0: the reader uses no segment)
    nslots: int
    offset: dict[int, int]  # uid -> byte offset of the unit inside its reader's slot

    def via(self, u: Unit, rank: int) -> bool:
        """Whether ``rank`` takes its part of ``u`` from the reader's shared memory."""
        return rank != u.reader and u.uid in self.offset and self.hosts[rank] == self.hosts[u.reader]


def shm_layout(sched: Schedule, hosts: list[str], names: list[str], frees: list[int], presize: int) -> ShmLayout:
    """Place, per reader and batch, the units some same-host rank consumes; hosts without room fall back."""
    world = len(hosts)
    nslots = min(_NSLOTS, len(sched.batches)) or 1
    ok = [bool(names[r]) for r in range(world)]

    def place() -> tuple[list[int], dict[int, int]]:
        slot, offset = [0] * world, {}
        for batch in sched.batches:
            used = [0] * world
            for u in batch:
                r = u.reader
                if ok[r] and not u.bcast and any(n.rank != r and hosts[n.rank] == hosts[r] for n in u.needs):
                    offset[u.uid] = used[r]
                    used[r] += -(-u.nbytes // _ALIGN) * _ALIGN
            slot = [max(a, b) for a, b in zip(slot, used)]
        return slot, offset

    slot, offset = place()
    changed = False
    for r in range(world):
        if ok[r] and nslots * slot[r] > presize:
            ok[r], changed = False, True
    per_host: dict[str, list[int]] = {}
    for r in range(world):
        per_host.setdefault(hosts[r], []).append(r)
    for members in per_host.values():
        need = sum(nslots * slot[r] for r in members if ok[r])
        if need and need > min(frees[r] for r in members) // 2:  # leave /dev/shm at least half free
            for r in members:
                ok[r], changed = False, True
    if changed:
        slot, offset = place()
    return ShmLayout(list(hosts), [n if ok[r] else "" for r, n in enumerate(names)], slot, nslots, offset)


def _head(raw: bytes) -> dict[str, Any]:
    try:
        head, _ = wire.unpack(raw)
    except (ValueError, KeyError, TypeError):
        raise MismatchError("read-once: a rank sent a malformed plan; do all ranks run the same hyperdcp version?") from None
    return head if isinstance(head, dict) else {}


def _layout_of(head: dict[str, Any]) -> str:
    d = head.get("layout", "")
    return d if isinstance(d, str) else ""


def _peer(head: dict[str, Any], rank: int) -> tuple[str, str, int]:
    """(host, segment name, free /dev/shm bytes) from a rank's plan header."""
    host, name, free = head.get("host"), head.get("shm", ""), head.get("shm_free", 0)
    if not isinstance(host, str) or not host:
        host = f"unknown-host-of-rank-{rank}"  # never shares memory
    if not isinstance(name, str) or (name and not _SHM_RE.match(name)):
        raise MismatchError(f"read-once: rank {rank} sent a malformed shared-memory segment name {name!r}")
    if not isinstance(free, int) or free < 0:
        free = 0
    return host, name, free


# -- schedule ---------------------------------------------------------------------------------


def _split(off: tuple[int, ...], lens: tuple[int, ...], n: int) -> list[Box]:
    """Cut a box into about ``n`` sub-boxes, each one contiguous range of the box's C-order bytes."""
    if n <= 1 or not lens:
        return [Box(off, lens)]
    L = lens[0]
    if L >= n or len(lens) == 1:
        m = min(n, L)
        cuts = [L * i // m for i in range(m + 1)]
        return [Box((off[0] + a,) + off[1:], (b - a,) + lens[1:]) for a, b in zip(cuts, cuts[1:]) if b > a]
    per = -(-n // L)
    return [
        Box((off[0] + i,) + sub.offsets, (1,) + sub.lengths)
        for i in range(L)
        for sub in _split(off[1:], lens[1:], per)
    ]


def _contiguous(chunk: Box, box: Box) -> bool:
    """Whether ``box`` is one contiguous byte range of ``chunk`` (C order)."""
    for d in range(box.ndim):
        if box.lengths[d] != 1:
            return all(box.lengths[e] == chunk.lengths[e] for e in range(d + 1, box.ndim))
    return True


_ROUNDS = 32  # aim for about this many batches per reader, so that reading overlaps moving
_UNITS_PER_ROUND = 4
_MIN_ROUND = 4 << 20  # ...but no fewer bytes per reader and batch (each batch costs a collective)
_MIN_UNIT = 2 << 20  # no unit smaller than this (per-unit overheads), unless the batch bound is


def build_schedule(meta: Metadata, plans: list[list[tuple[int, int, Box]]], verify: bool, batch_bytes: int,
                   hosts: Sequence[str] | None = None, shm_ok: Sequence[bool] | None = None) -> Schedule:
    """The deterministic global schedule: units, readers (balanced by bytes read) and batches.

    ``hosts``/``shm_ok``: per rank, its host identity and whether it shares a segment; pieces a
    same-host consumer copies out of its reader's shared memory need no receive buffer, so they do
    not count against the batch bound. Without them every piece is costed as point to point.
    """
    world = len(plans)
    names = list(meta.tensors)
    B = max(1, int(batch_bytes))
    # per stored chunk, the distinct boxes wanted from it and who wants each (replicas share a box)
    by_chunk: dict[tuple[int, int], dict[Box, list[tuple[int, int]]]] = {}
    for r, plan in enumerate(plans):
        for e, (ti, ci, box) in enumerate(plan):
            by_chunk.setdefault((ti, ci), {}).setdefault(box, []).append((r, e))

    def chunk_size(ti: int, ci: int) -> int:
        t = meta.tensors[names[ti]]
        return int(t.chunks.end[ci] - t.chunks.begin[ci])

    # unit size: about _ROUNDS units per reader, so that batch k+1 is read while batch k moves
    total = sum(chunk_size(ti, ci) for ti, ci in by_chunk)
    T = min(B, max(_MIN_ROUND, -(-total // (world * _ROUNDS))))  # bytes per reader per batch
    U = min(B, max(_MIN_UNIT, T // _UNITS_PER_ROUND))  # bytes per unit: a batch's reads run in parallel threads
    units: list[Unit] = []
    for (ti, ci) in sorted(by_chunk):
        t = meta.tensors[names[ti]]
        isz = dtypes.itemsize(t.dtype)
        cb = t.chunks.box(ci)
        size = chunk_size(ti, ci)
        wants = by_chunk[(ti, ci)]
        # memory of the whole chunk in one batch: bytes read plus bytes packed for others (pieces that
        # are contiguous in the chunk go out of the read buffer itself)
        cost = size + sum(b.numel * isz * len(who) for b, who in wants.items() if not _contiguous(cb, b))
        n = -(-cost // U)
        if verify:  # a part smaller than a checksum block would re-read that block
            n = min(n, max(1, size // meta.checksum_block_bytes))
        parts = _split(cb.offsets, cb.lengths, n) if n > 1 else [cb]
        for part in parts:
            needs = []
            lo, hi = size, 0
            for box, who in wants.items():
                sub = box.intersect(part) if len(parts) > 1 else box
                if sub is None:
                    continue
                s, stop = byte_span(cb, sub, isz)
                nb = sub.numel * isz
                lo, hi = min(lo, s), max(hi, stop)
                contiguous = stop - s == nb
                needs.extend(Need(r, e, sub, nb, contiguous) for r, e in who)
            if not needs:
                continue
            needs.sort(key=lambda n: (n.rank, n.entry))
            if verify:
                lo, hi = block_range(lo, hi, meta.checksum_block_bytes, size)
            units.append(Unit(len(units), ti, ci, lo, hi, needs))

    # readers: units one rank needs are that rank's; then largest first to the least-loaded needer
    load = [0] * world
    shared = []
    for u in units:
        rs = u.ranks
        if len(rs) == 1:
            u.reader = next(iter(rs))
            load[u.reader] += u.nbytes
        else:
            shared.append(u)
    shared.sort(key=lambda u: (-u.nbytes, u.uid))
    for u in shared:
        u.reader = min(u.ranks, key=lambda r: (load[r], (r - u.uid) % world))
        load[u.reader] += u.nbytes

    def p2p(reader: int, rank: int) -> bool:
        return hosts is None or shm_ok is None or not shm_ok[reader] or hosts[reader] != hosts[rank]

    # batches in rounds: each reader takes its next units (in file order, so its reads are sequential)
    # up to about one unit size U; bytes packed to send and point-to-point receive buffers stay under
    # the batch bound B on every rank
    queues: dict[int, list[Unit]] = {}
    for u in sorted(units, key=lambda u: (int(meta.tensors[names[u.tidx]].chunks.file[u.chunk]),
                                          int(meta.tensors[names[u.tidx]].chunks.begin[u.chunk]) + u.lo, u.uid)):
        queues.setdefault(u.reader, []).append(u)
    heads = {r: 0 for r in queues}
    sent = [0] * world
    batches: list[list[Unit]] = []
    while heads:
        cur: list[Unit] = []
        out_b: dict[int, int] = {}
        in_b: dict[int, int] = {}
        active = sorted(heads)
        while active:
            still = []
            for r in active:
                u = queues[r][heads[r]]
                add_out = u.nbytes + sum(n.nbytes for n in u.needs
                                         if n.rank != r and not n.contiguous and p2p(r, n.rank))
                add_in: dict[int, int] = {}
                for n in u.needs:
                    if n.rank != r and p2p(r, n.rank):
                        add_in[n.rank] = add_in.get(n.rank, 0) + n.nbytes
                fits = (r not in out_b or out_b[r] + add_out <= T) and all(
                    in_b.get(x, 0) + v <= B for x, v in add_in.items())
                if not fits and cur:
                    continue  # this reader is done for this batch
                cur.append(u)
                out_b[r] = out_b.get(r, 0) + add_out
                for x, v in add_in.items():
                    in_b[x] = in_b.get(x, 0) + v
                for n in u.needs:
                    if n.rank != r:
                        sent[r] += n.nbytes
                heads[r] += 1
                if heads[r] == len(queues[r]):
                    del heads[r]
                else:
                    still.append(r)
            active = still
        batches.append(cur)
    return Schedule(units, batches, load, sent)


def broadcast_groups(tensors: Sequence[ShardedTensor], me: int, world: int, whole: Any) -> tuple[set[frozenset[int]], dict[frozenset[int], Any]]:
    """(every mesh-dim group's member set, known identically on every rank; this rank's handle for each
    set it belongs to). Groups come with the layouts (a DeviceMesh's own groups), plus ``whole`` for all
    ranks: none is created here. Tensors are walked in order, so members pick the same handle."""
    lines: set[frozenset[int]] = {frozenset(range(world))}
    mine: dict[frozenset[int], Any] = {frozenset(range(world)): whole}
    seen: set[bytes] = set()
    for st in tensors:
        lay = st.layout
        if lay is None or lay.mesh_key in seen:
            continue
        seen.add(lay.mesh_key)
        grid = np.asarray(lay.mesh)
        lines.update(mesh_lines(grid))
        where = np.argwhere(grid == me)
        if not len(where) or len(lay.groups) != grid.ndim:
            continue
        coord = tuple(int(c) for c in where[0])
        for d, handle in enumerate(lay.groups):
            line = frozenset(grid[coord[:d] + (slice(None),) + coord[d + 1:]].reshape(-1).tolist())
            mine.setdefault(line, handle)
    return lines, mine


def mark_broadcasts(sched: Schedule, lines: set[frozenset[int]], hosts: Sequence[str]) -> None:
    """Units whose needers all want the same contiguous bytes, form one group's member set and sit on
    other hosts than the reader (else shared memory serves them) go by one broadcast in that group."""
    for u in sched.units:
        u.bcast = False
        if len(u.needs) < 2:
            continue
        box = u.needs[0].box
        ranks = frozenset(n.rank for n in u.needs)
        if (len(ranks) == len(u.needs) and ranks in lines and all(n.contiguous and n.box == box for n in u.needs)
                and all(hosts[n.rank] != hosts[u.reader] for n in u.needs if n.rank != u.reader)):
            u.bcast = True


# -- execution --------------------------------------------------------------------------------


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
                 opts: LoadOptions, sched: Schedule, shm: ShmLayout | None = None, seg: _Segment | None = None):
        import torch.distributed as dist

        self.dist = dist
        self.files, self.meta, self.pieces, self.coord, self.opts, self.sched = files, meta, pieces, coord, opts, sched
        self.shm, self.seg = shm, seg
        self.bgroups: dict[int, Any] = {}  # uid -> process group, for the broadcast units this rank is in
        self.own_map: mmap.mmap | None = None  # this rank's segment, written by its reads
        self.maps: dict[int, mmap.mmap] = {}  # same-host readers' segments, read by this rank
        self.me = coord.rank
        self.names = list(meta.tensors)
        self.group = coord.group  # type: ignore[attr-defined]
        self.glob = coord.global_ranks
        self._call = getattr(coord, "_call", lambda fn, *a, **k: fn(*a, **k))

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
        from .loading import copy_piece, read_chunk

        if k == 0 and self.shm is not None:
            self._map_segments()
        batch = self.sched.batches[k]
        sends, recvs = _messages(batch, self.me, self.shm)
        mine = [u for u in batch if u.reader == self.me]
        bufs: dict[int, tuple[np.ndarray, ChunkRead]] = {}

        def one(u: Unit) -> None:
            own = [self._piece(u, n) for n in u.needs if n.rank == self.me]
            read = self._chunk_read(u, own)
            only_me = all(n.rank == self.me for n in u.needs)
            out = self._slot(self.me, k, u) if self.shm is not None and u.uid in self.shm.offset else None
            buf, direct = read_chunk(self.files, self.meta, read, self.opts.verify_checksums, direct_ok=only_me, out=out)
            if not direct and out is None:  # from a slot, the main thread copies (see _copy_from_shm)
                for p in own:
                    if p.dst is not None:
                        copy_piece(buf, read, self.meta, p)
            if not only_me:
                bufs[u.uid] = (buf, read)

        if self.opts.read_threads > 1 and len(mine) > 1:
            with ThreadPoolExecutor(min(self.opts.read_threads, len(mine))) as ex:
                list(ex.map(one, sorted(mine, key=lambda u: (self.meta.tensors[self.names[u.tidx]].chunks.file[u.chunk], u.uid))))
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
                    np.copyto(flat[off : off + n.nbytes].reshape(byte_shape(n.box.lengths, isz)), self._src(bufs, u, n, flat=False))
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
                        f"({e.strerror or e}); free /dev/shm, lower read_once_batch_bytes or set HYPERDCP_READ_ONCE_SHM=0"
                    ) from None
            try:
                self.own_map = mmap.mmap(self.seg.fd, size)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"read-once: rank {me} cannot map its shared memory {self.seg.path} ({e})") from None
        peers = sorted({u.reader for b in self.sched.batches for u in b for n in u.needs
                        if n.rank == me and shm.via(u, me)})
        for r in peers:
            path = os.path.join(_SHM_DIR, shm.names[r])
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
                try:
                    self.maps[r] = mmap.mmap(fd, shm.nslots * shm.slot[r], prot=mmap.PROT_READ)
                finally:
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
        from .loading import copy_piece

        for u in self.sched.batches[k]:
            for n in u.needs:
                # this rank's own pieces of the units it read into its slot, too: the reading thread
                # goes on with the next batch meanwhile (batch k's slot is reused only after exchange k+1)
                if n.rank == self.me and (self.shm.via(u, self.me) or (u.reader == self.me and u.uid in self.shm.offset)):
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
        import torch

        dist, works, after = self.dist, [], []
        for m in state["recvs"]:
            if m.packed is None:
                p, direct = self._dst(m.unit, m.need)
                buf = direct if direct is not None else np.empty(m.nbytes, dtype=np.uint8)
                if direct is None:
                    after.append((buf, [(p, 0, m.nbytes)]))
            else:
                buf = np.empty(m.nbytes, dtype=np.uint8)
                after.append((buf, [(self._piece(u, n), off, n.nbytes) for u, n, off in m.packed]))
            works.append(self._call(dist.irecv, torch.from_numpy(buf), src=self.glob[m.peer], group=self.group, tag=m.tag))
        for m, payload in state["sends"]:
            works.append(self._call(dist.isend, torch.from_numpy(payload), dst=self.glob[m.peer], group=self.group, tag=m.tag))
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
            works.append(self._call(dist.broadcast, torch.from_numpy(buf), src=self.glob[u.reader],
                                    group=self.bgroups[u.uid], async_op=True))
        if self.shm is not None and k >= 0:
            self._copy_from_shm(k)  # while the point-to-point messages are in flight
        for w in works:
            self._call(w.wait)
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
    torch.distributed process group fall back to each rank reading what it needs.
    """
    if coord.world_size <= 1 or getattr(coord, "group", None) is None:
        check_all(coord, plan_what, plan_error)
        from .loading import execute_local_reads

        execute_local_reads(files, meta, group_reads(meta, pieces, opts.verify_checksums), opts)
        return None
    seg, extra = None, {"host": host_key(), "shm": "", "shm_free": 0}
    presize = _presize(meta, opts.read_once_batch_bytes)
    if shm_enabled():
        try:
            seg = _Segment(presize)
            extra.update(shm=seg.name, shm_free=_shm_free())
        except OSError:  # no usable /dev/shm here: this rank's units go point to point
            seg = None
    ex = None
    from .shm import sigterm_cleanup

    guard = sigterm_cleanup(_unlink_live) if seg is not None else contextlib.nullcontext()
    try:
        guard.__enter__()  # SIGTERM while this rank's segment is named: unlink it, then terminate as before
        try:
            digest = layout_digest(meta, tensors, pieces, coord.rank, coord.world_size)
        except (KeyError, ValueError, IndexError):
            digest = ""
        # one exchange of fixed-size records when the layouts agree everywhere, else of the plans
        err = _status(plan_error).decode("utf-8", "replace") if plan_error is not None else ""
        raws = coord.all_gather(encode_plan(meta, [] if digest else pieces, {**extra, "layout": digest, "err": err}))
        heads = [_head(raw) for raw in raws]  # parsed once: host, segment, digest, error
        errs = [h.get("err") or "" for h in heads]
        if any(errs):
            raise_remote([e.encode("utf-8") if isinstance(e, str) and e else _status(None) for e in errs],
                         coord, plan_what, plan_error)
        digests = {_layout_of(h) for h in heads}
        derived = bool(digest) and digests == {digest}
        if derived:
            plans = derive_plans(meta, tensors, coord.world_size)
        else:
            if digests != {""}:  # some ranks sent only a digest, so the layouts differ: exchange the plans
                raws = coord.all_gather(encode_plan(meta, pieces, extra))
            plans = [decode_plan(meta, raw, r) for r, raw in enumerate(raws)]
        if len(plans[coord.rank]) != len(pieces):
            raise CoordinationError(f"read-once: rank {coord.rank} received a different plan than it sent")
        peers = [_peer(h, r) for r, h in enumerate(heads)]
        hosts, names, frees = [p[0] for p in peers], [p[1] for p in peers], [p[2] for p in peers]
        lines, handles = (broadcast_groups(tensors, coord.rank, coord.world_size, coord.group)
                          if derived and opts.read_once_broadcast else (set(), {}))
        for _ in range(3):  # a host without room for its readers' slots goes point to point; re-plan for that
            sched = build_schedule(meta, plans, opts.verify_checksums, opts.read_once_batch_bytes, hosts,
                                   [bool(n) for n in names])
            mark_broadcasts(sched, lines, hosts)
            shm = shm_layout(sched, hosts, names, frees, presize)
            if shm.names == names:
                break
            names = shm.names
        else:
            sched = build_schedule(meta, plans, opts.verify_checksums, opts.read_once_batch_bytes)
            mark_broadcasts(sched, lines, hosts)
            shm = shm_layout(sched, hosts, [""] * len(names), frees, presize)
        sched.shm = shm
        sched.derived = derived
        if not shm.offset:
            shm = None
        if seg is not None and (shm is None or not shm.slot[coord.rank]):
            seg.close()  # nobody maps it
            seg = None
        ex = _Exchange(files, meta, pieces, coord, opts, sched, shm, seg)
        for u in sched.units:
            if u.bcast and any(n.rank == coord.rank for n in u.needs):
                members = frozenset(n.rank for n in u.needs)
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
        guard.__exit__(None, None, None)
    return sched
