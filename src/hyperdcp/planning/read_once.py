"""Read-once loads, the pure half: plans, schedule, batches, broadcasts and shared-memory placement.

Nothing here does I/O or talks to other ranks; :mod:`hyperdcp.loading.read_once` runs the schedule
(reading thread, shared-memory slots, point-to-point messages through a
:class:`~hyperdcp.coordination.base.Transport`). The whole algorithm:

Read-once loads: every stored byte that some rank needs is read from storage by exactly one rank.

Flow (every rank runs the same steps; ranks that need nothing take part too):

1. **Plans.** Every rank needs every rank's pieces (tensor index, chunk index, box). When each of its
   destination tensors has a :class:`~hyperdcp.core.layout.GridLayout` (a DTensor's mesh and
   placements, or a tensor every rank holds whole) and the layout rule reproduces its own plan, a rank
   sends only a digest of its layouts; if all digests agree every rank derives all plans itself
   (:func:`derive_plans`), else the plans are packed as int arrays (:mod:`hyperdcp.core.wire`,
   no pickle) and exchanged. Either way one ``all_gather`` of small records also carries the host
   identity, the shared-memory segment name and any planning error (raised on every rank).
2. **Schedule.** Each rank computes only its host's part of it (:mod:`.read_once_local`, from the
   layouts or the exchanged plans; :func:`build_schedule` below is the global form, the reference
   the parts are tested against, with the old reader and batch rules): per stored chunk the
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
   The rest is point-to-point (the coordinator's Transport: ``isend``/``irecv``): a piece that is
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

import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..core import dtypes, wire
from ..core.boxes import Box
from ..core.shards import ShardedTensor
from ..errors import MismatchError
from ..format.checksums import block_range
from ..format.metadata import Metadata
from .load_plan import Piece, TensorIndex, byte_span
from .read_once_bcast import MeshLines, broadcast_groups, mark_broadcasts  # noqa: F401 - part of this API
from .read_once_wants import own_plan

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
    #: local schedules (:mod:`.read_once_local`): the key every party orders units by, every needing
    #: rank (``needs`` may hold only some of them), whether they all want the same contiguous bytes
    key: tuple = ()
    group: Any = None
    same: bool = False
    batch: int = -1

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
        raise MismatchError(f"read-once: the load plan of rank {rank} is malformed ({e}); do all ranks run the same "
                            "hyperdcp version?") from None


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
    if own_plan(meta, tensors, me) != _own_plan(meta, pieces):
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
                _, first, inv = np.unique(
                    rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).reshape(-1),
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


# -- same-host shared memory: placement -------------------------------------------------------

ALIGN = 64
#: batch k+1 is read into the slot of batch k-2, which every consumer has copied out before exchange k-1
NSLOTS = 3
_ALIGN, _NSLOTS = ALIGN, NSLOTS  # old private names


def presize(meta: Metadata, batch_bytes: int) -> int:
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


def shm_layout(sched: Schedule, hosts: list[str], names: list[str], frees: list[int], presize: int,
               ranks: Sequence[int] | None = None) -> ShmLayout:
    """Place, per reader and batch, the units some same-host rank consumes; hosts without room fall back.

    ``ranks``: only these ranks' segments are placed (a local schedule: the ranks of this host, who all
    hold the same units with a same-host consumer); the others' stay unused here.
    """
    world = len(hosts)
    members = range(world) if ranks is None else sorted(ranks)
    nslots = min(_NSLOTS, len(sched.batches)) or 1
    ok = [False] * world
    for r in members:
        ok[r] = bool(names[r])

    def place() -> tuple[list[int], dict[int, int]]:
        slot, offset = [0] * world, {}
        for batch in sched.batches:
            used: dict[int, int] = {}
            for u in batch:
                r = u.reader
                if ok[r] and not u.bcast and any(n.rank != r and hosts[n.rank] == hosts[r] for n in u.needs):
                    offset[u.uid] = used.get(r, 0)
                    used[r] = offset[u.uid] + -(-u.nbytes // _ALIGN) * _ALIGN
            for r, b in used.items():
                slot[r] = max(slot[r], b)
        return slot, offset

    slot, offset = place()
    changed = False
    for r in members:
        if ok[r] and nslots * slot[r] > presize:
            ok[r], changed = False, True
    per_host: dict[str, list[int]] = {}
    for r in members:
        per_host.setdefault(hosts[r], []).append(r)
    for on_host in per_host.values():
        need = sum(nslots * slot[r] for r in on_host if ok[r])
        if need and need > min(frees[r] for r in on_host) // 2:  # leave /dev/shm at least half free
            for r in on_host:
                ok[r], changed = False, True
    if changed:
        slot, offset = place()
    out = list(names) if ranks is not None else [""] * world
    for r in members:
        out[r] = names[r] if ok[r] else ""
    return ShmLayout(list(hosts), out, slot, nslots, offset)


_presize = presize  # old private name


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
