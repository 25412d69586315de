"""Local read-once schedules: each rank computes only its part, the same part the global schedule has.

Input: the :class:`~.read_once_wants.Wants` of the chunks a set of ranks needs (one rank, or the
ranks of one host, who then agree on the host's shared-memory placement). Every step below uses
only what every member of a *group* (the ranks needing one unit) knows alike, so the members agree
without asking each other:

* **Units**: each stored chunk is cut into row-slabs as the global schedule does
  (:func:`~.read_once.build_schedule`): from the chunk's wants and a unit size that depends on the
  bytes of all needed chunks and the world size (both known to every rank).
* **Readers**: units one rank needs are its own. The units of one group (same set of needing ranks)
  go largest first to the member with the fewest bytes of that group so far, ties broken by a
  rotation derived from the group (so that groups do not all favour their lowest rank). Every member
  of a group needs, so knows, every unit of that group.
* **Batches**: within each group, rounds as in the global schedule: each reader takes its next units
  in file order up to the round's bytes, with receive buffers under the batch bound. Batch k of a rank
  is round k of every group it belongs to, ordered by the unit key (tensor, chunk, part), which all
  parties compute: messages, tags and broadcasts line up between senders and receivers.

A rank keeps the needs of the ranks of its set, and every need of the units it reads (it sends them).
"""

from __future__ import annotations

import heapq
import zlib

import numpy as np

from ..core import dtypes
from ..format.checksums import block_range
from ..format.metadata import Metadata
from .load_plan import byte_span
from .read_once import _MIN_ROUND, _MIN_UNIT, _ROUNDS, _UNITS_PER_ROUND, Need, Schedule, Unit, _contiguous, _split
from .read_once_wants import Wants


def unit_sizes(total: int, world: int, batch_bytes: int, request_bytes: int = 0) -> tuple[int, int, int]:
    """(batch bound, bytes per reader and round, bytes per unit), as the global schedule sets them.

    ``request_bytes``: the storage's preferred request (object stores: one ranged GET; 0 for local
    files): units are at least that big, and a round holds ``_UNITS_PER_ROUND`` of them, so a reader
    keeps that many requests in flight and pays one collective per round, not per small unit."""
    B = max(1, int(batch_bytes))
    R = max(0, int(request_bytes))
    T = min(B, max(_MIN_ROUND, R * _UNITS_PER_ROUND, -(-total // (max(1, world) * _ROUNDS))))
    U = min(B, max(_MIN_UNIT, R, T // _UNITS_PER_ROUND))
    return B, T, U


def _units(meta: Metadata, wants: Wants, verify: bool, U: int) -> list[tuple[Unit, list]]:
    """Every unit of the wanted chunks some rank of the set needs, with its parts per wanted box."""
    names = list(meta.tensors)
    inside = wants.ranks
    out = []
    for ti, ci in sorted(wants.chunks):
        t = meta.tensors[names[ti]]
        isz = dtypes.itemsize(t.dtype)
        cb = t.chunks.box(ci)
        size = int(t.chunks.end[ci] - t.chunks.begin[ci])
        want = wants.chunks[(ti, ci)]
        cost = size + sum(b.numel * isz * len(rs) for b, rs, _ in want if not _contiguous(cb, b))
        n = -(-cost // U)
        if verify:
            n = min(n, max(1, size // meta.checksum_block_bytes))
        parts = _split(cb.offsets, cb.lengths, n) if n > 1 else [cb]
        for k, part in enumerate(parts):
            subs, lo, hi = [], size, 0
            for box, rs, es in want:
                sub = box.intersect(part) if len(parts) > 1 else box
                if sub is None:
                    continue
                s, stop = byte_span(cb, sub, isz)
                nb = sub.numel * isz
                lo, hi = min(lo, s), max(hi, stop)
                subs.append((sub, rs, es, nb, stop - s == nb))
            if not subs:
                continue
            group = subs[0][1] if len(subs) == 1 else np.unique(np.concatenate([s[1] for s in subs]))
            if inside is not None and inside.isdisjoint(group.tolist()):
                continue  # a part of the chunk none of the set needs
            if verify:
                lo, hi = block_range(lo, hi, meta.checksum_block_bytes, size)
            same = len(subs) == 1 and subs[0][4]
            u = Unit(len(out), ti, ci, lo, hi, [], key=(ti, ci, k), group=group, same=same)
            out.append((u, subs))
    return out


def _assign_readers(units: list[tuple[Unit, list]]) -> dict[bytes, list[Unit]]:
    """Readers per group, largest first to the least-loaded member; returns the units per group."""
    groups: dict[bytes, list[Unit]] = {}
    for u, _ in units:
        groups.setdefault(u.group.tobytes(), []).append(u)
    for gkey, us in groups.items():
        g = us[0].group
        n = len(g)
        if n == 1:
            for u in us:
                u.reader = int(g[0])
            continue
        rot = zlib.crc32(gkey) % n
        heap: list[tuple[int, int]] = []  # (bytes so far, position in the rotation) of members with some
        fresh = 0  # members at positions >= fresh have read nothing yet (they come first, in order)
        for u in sorted(us, key=lambda u: (-u.nbytes, u.key)):
            if fresh < n:
                pos, load = fresh, 0
                fresh += 1
            else:
                load, pos = heapq.heappop(heap)
            u.reader = int(g[(pos + rot) % n])
            heapq.heappush(heap, (load + u.nbytes, pos))
    return groups


def _rounds(meta: Metadata, us: list[Unit], subs: dict[int, list], T: int, B: int) -> int:
    """Round of each unit of one group: readers take their next units in file order up to ``T`` bytes
    sent, no member receiving more than ``B``. Returns the number of rounds."""
    names = list(meta.tensors)

    def where(u: Unit) -> tuple:
        ch = meta.tensors[names[u.tidx]].chunks
        return int(ch.file[u.chunk]), int(ch.begin[u.chunk]) + u.lo, u.key

    queues: dict[int, list[Unit]] = {}
    for u in sorted(us, key=where):
        queues.setdefault(u.reader, []).append(u)
    heads = {r: 0 for r in queues}
    k = 0
    while heads:
        out_b: dict[int, int] = {}
        in_b: dict[int, int] = {}
        taken = False
        active = sorted(heads)
        while active:
            still = []
            for r in active:
                u = queues[r][heads[r]]
                add_out, add_in = u.nbytes, {}
                for _sub, rs, _, nb, contiguous in subs[id(u)]:
                    others = len(rs) - int(r in rs)
                    if not contiguous:
                        add_out += nb * others
                    for x in rs.tolist():
                        if x != r:
                            add_in[x] = add_in.get(x, 0) + nb
                fits = (r not in out_b or out_b[r] + add_out <= T) and all(
                    in_b.get(x, 0) + v <= B for x, v in add_in.items())
                if not fits and taken:
                    continue
                taken = True
                u.batch = k
                out_b[r] = out_b.get(r, 0) + add_out
                for x, v in add_in.items():
                    in_b[x] = in_b.get(x, 0) + v
                heads[r] += 1
                if heads[r] == len(queues[r]):
                    del heads[r]
                else:
                    still.append(r)
            active = still
        k += 1
    return k


def local_schedule(meta: Metadata, wants: Wants, verify: bool, batch_bytes: int, me: int | None = None,
                   request_bytes: int = 0) -> Schedule:
    """The part of the read-once schedule for the set ``wants.ranks`` (``me``: the rank building it,
    which keeps every need of the units it reads). With ``wants.ranks`` None: the global schedule by
    the same rules (the reference the local parts are checked against). ``request_bytes``: see
    :func:`unit_sizes` (every rank must pass the same)."""
    B, T, U = unit_sizes(wants.total, wants.world, batch_bytes, request_bytes)
    units = _units(meta, wants, verify, U)
    groups = _assign_readers(units)
    subs = {id(u): s for u, s in units}
    nb = 0
    for us in groups.values():
        nb = max(nb, _rounds(meta, us, subs, T, B))
    inside = wants.ranks
    read = [0] * wants.world
    sent = [0] * wants.world
    batches: list[list[Unit]] = [[] for _ in range(nb)]
    for u, sl in units:
        full = inside is None or u.reader == me
        needs = []
        for sub, rs, es, nbytes, contiguous in sl:
            for r, e in zip(rs.tolist(), es):
                if full or r in inside:
                    needs.append(Need(r, e, sub, nbytes, contiguous))
                if r != u.reader:
                    sent[u.reader] += nbytes
        needs.sort(key=lambda n: (n.rank, n.box.offsets))
        u.needs = needs
        read[u.reader] += u.nbytes
        batches[u.batch].append(u)
    for b in batches:
        b.sort(key=lambda u: u.key)
    return Schedule([u for u, _ in units], batches, read, sent)


def pad_batches(sched: Schedule, nb: int) -> None:
    """Every rank runs the same number of batches (the most any rank has); the rest are empty."""
    sched.batches.extend([] for _ in range(nb - len(sched.batches)))


def my_part(sched: Schedule, rank: int) -> list[tuple]:
    """What ``rank`` does in a schedule, comparable between a local and the global one: per unit it
    reads or needs, (key, bounds, reader, batch, its needs -- all of them where it reads)."""
    out = []
    index = {id(u): k for k, b in enumerate(sched.batches) for u in b}
    for u in sched.units:
        mine = [n for n in u.needs if n.rank == rank]
        if u.reader != rank and not mine:
            continue
        needs = u.needs if u.reader == rank else mine
        out.append((u.key, u.lo, u.hi, u.reader, index[id(u)], u.bcast,
                    tuple((n.rank, n.entry if n.rank == rank else -1, n.box, n.nbytes, n.contiguous) for n in needs)))
    return sorted(out)
