"""Save planning: local plans and the deduplicating global plan
(per-rank classification: .per_rank; the plan cache: .plan_cache).

Lifecycle of one save (every rank):

1. :meth:`LocalPlan.build` lists the rank's tensors (name, dtype, global shape), the names of its
   plain values, and every non-empty box it holds.
2. Each rank sends ``digest()`` (16 bytes) to all, with a digest of its :func:`content_table`; where
   contents differ, :func:`classify_per_rank` names what is stored per rank. If every rank finds the
   combined key in its :class:`PlanCache`, planning is skipped (the warm path exchanges nothing else).
3. Otherwise rank 0 gathers the local plans and runs :func:`plan_global`: it joins the ranks' tables
   (ranks may hold different keys), validates that they agree on the shapes and dtypes of shared
   tensors and that each tensor's boxes tile it exactly, deduplicates boxes by
   (tensor, box), and picks one writer per unique box: the only holder if there is one, else the
   holder with the fewest bytes assigned so far, largest boxes first.
4. Each rank receives its assignment: the indices of the local chunks it writes.

Everything is vectorised over the (rank, chunk) entries so that 16,384 ranks x 100 tensors plans in
well under a second; see bench/planner_scale.py.
"""

from __future__ import annotations

import heapq
import json
import struct
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import xxhash

from ..core import dtypes
from ..core.boxes import Box, check_exact_cover, grid_tiles
from ..core.shards import LocalShard, ShardedTensor
from ..errors import MismatchError


@dataclass(frozen=True)
class TensorSpec:
    fqn: str
    dtype: str
    shape: tuple[int, ...]


_PLAN_MAGIC = b"HDLP"


class LocalPlan:
    """One rank's view: its tensor table, value keys and chunks ``(tidx, offsets, lengths)``.

    Boxes are stored in ``(n, D)`` arrays with ``D`` the largest rank among the tensors; unused
    trailing dimensions are padded with offset 0 and length 1.
    """

    def __init__(self, tensors: Sequence[TensorSpec], value_keys: Sequence[str], tidx, offsets, lengths):
        self.tensors = list(tensors)
        self.value_keys = list(value_keys)
        tidx = np.asarray(tidx, dtype=np.int64)
        n = len(tidx)
        offsets = (np.asarray(offsets, dtype=np.int64).reshape(n, -1) if n
                   else np.zeros((0, np.shape(offsets)[-1] if np.ndim(offsets) == 2 else 0), np.int64))
        lengths = np.asarray(lengths, dtype=np.int64).reshape(offsets.shape)
        #: one (n, 1 + 2D) block [tidx | offsets | lengths], so that rank 0 concatenates one array per rank
        rows = np.concatenate([tidx[:, None], offsets, lengths], axis=1)
        # int32 when every value and every box end fits: half the bytes to send and to concatenate
        small = not n or (rows.min() >= 0 and int((offsets + lengths).max(initial=0)) < 2**31 - 1
                          and int(rows.max()) < 2**31 - 1)
        self.rows = rows.astype(np.int32) if small else rows
        self._set_views()
        self._bytes: bytes | None = None
        self._table: bytes | None = None

    def _set_views(self) -> None:
        D = (self.rows.shape[1] - 1) // 2
        self.tidx = self.rows[:, 0]
        self.offsets = self.rows[:, 1 : 1 + D]
        self.lengths = self.rows[:, 1 + D :]

    @classmethod
    def build(
        cls, items: Sequence[ShardedTensor], value_keys: Sequence[str]
    ) -> tuple["LocalPlan", list[tuple[ShardedTensor, LocalShard]]]:
        """The plan for ``items`` (sorted by name) and the local chunks in plan order."""
        items = sorted(items, key=lambda it: it.fqn)
        D = max((len(it.shape) for it in items), default=0)
        specs, tidx, offs, lens, chunks = [], [], [], [], []
        for t, it in enumerate(items):
            specs.append(TensorSpec(it.fqn, it.dtype, tuple(int(s) for s in it.shape)))
            pad = D - len(it.shape)
            for sh in it.shards:
                if sh.box.numel == 0:
                    continue
                tidx.append(t)
                offs.append(tuple(sh.box.offsets) + (0,) * pad)
                lens.append(tuple(sh.box.lengths) + (1,) * pad)
                chunks.append((it, sh))
        n = len(tidx)
        plan = cls(
            specs,
            sorted(value_keys),
            np.array(tidx, dtype=np.int64),
            np.array(offs, dtype=np.int64).reshape(n, D),
            np.array(lens, dtype=np.int64).reshape(n, D),
        )
        return plan, chunks

    def table_json(self) -> bytes:
        if self._table is None:
            self._table = json.dumps(
                [[[t.fqn, t.dtype, list(t.shape)] for t in self.tensors], self.value_keys], separators=(",", ":")
            ).encode()
        return self._table

    def to_bytes(self) -> bytes:
        """Binary form: magic, (table length, n, D), the JSON table, then the three int64 arrays."""
        if self._bytes is None:
            table = self.table_json()
            n, D = len(self.rows), (self.rows.shape[1] - 1) // 2
            wide = self.rows.dtype.itemsize == 8
            self._bytes = b"".join([_PLAN_MAGIC, struct.pack("<QQQ", len(table), n, D | (wide << 32)), table,
                                    self.rows.astype("<i8" if wide else "<i4").tobytes()])
        return self._bytes

    @classmethod
    def from_bytes(cls, raw: bytes, tables: dict[bytes, tuple] | None = None) -> "LocalPlan":
        """Decode; ``tables`` memoises decoded tensor tables (identical on most ranks)."""
        if raw[:4] != _PLAN_MAGIC:
            raise ValueError("not a hyperdcp local plan")
        tl, n, D = struct.unpack_from("<QQQ", raw, 4)
        pos = 28
        table = raw[pos : pos + tl]
        pos += tl
        decoded = tables.get(table) if tables is not None else None
        if decoded is None:
            specs_doc, keys = json.loads(table)
            decoded = ([TensorSpec(f, d, tuple(s)) for f, d, s in specs_doc], keys)
            if tables is not None:
                tables[table] = decoded
        plan = cls.__new__(cls)
        plan.tensors, plan.value_keys = decoded
        wide, D = D >> 32, D & 0xFFFFFFFF
        plan.rows = np.frombuffer(raw, "<i8" if wide else "<i4", n * (1 + 2 * D), pos).reshape(n, 1 + 2 * D)
        plan._set_views()
        plan._bytes, plan._table = raw, table
        return plan

    def digest(self, world_size: int) -> bytes:
        h = xxhash.xxh3_128(self.to_bytes())
        h.update(world_size.to_bytes(8, "little"))
        return h.digest()


@dataclass
class GlobalPlan:
    """The result of global planning. Unique chunks are sorted by tensor, then by position."""

    world_size: int
    tensors: list[TensorSpec]
    value_keys: list[str]
    u_tidx: np.ndarray  # (U,)
    u_offsets: np.ndarray  # (U, D) padded
    u_lengths: np.ndarray  # (U, D) padded
    u_writer: np.ndarray  # (U,) rank writing the chunk
    u_slot: np.ndarray  # (U,) position of the chunk in its writer's assignment
    assignments: list[np.ndarray]  # per rank: local chunk indices to write, in order
    per_rank: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tensors stored per rank: holders

    @property
    def bytes_per_rank(self) -> np.ndarray:
        size = np.array([dtypes.itemsize(t.dtype) for t in self.tensors], dtype=np.int64)
        nb = self.u_lengths.prod(axis=1) * size[self.u_tidx] if len(self.u_tidx) else np.zeros(0, np.int64)
        return np.bincount(self.u_writer, weights=nb, minlength=self.world_size).astype(np.int64)

    def tensor_ranges(self) -> np.ndarray:
        """``r[t]:r[t+1]`` are the unique chunks of tensor ``t``."""
        return np.searchsorted(self.u_tidx, np.arange(len(self.tensors) + 1))

    def to_bytes(self) -> bytes:
        """A wire message (JSON + integer arrays, no pickle); see :meth:`from_bytes`."""
        from ..core import wire
        counts = np.array([len(a) for a in self.assignments], dtype=np.int64)
        flat = np.concatenate(self.assignments).astype(np.int64) if self.assignments else np.zeros(0, np.int64)
        return wire.pack(
            {"world_size": self.world_size, "tensors": [[t.fqn, t.dtype, list(t.shape)] for t in self.tensors],
             "value_keys": self.value_keys, "per_rank": {k: list(v) for k, v in self.per_rank.items()}},
            {"u_tidx": self.u_tidx, "u_offsets": self.u_offsets, "u_lengths": self.u_lengths, "u_writer": self.u_writer,
             "u_slot": self.u_slot, "a_counts": counts, "a_flat": flat},
        )

    @classmethod
    def from_bytes(cls, raw: bytes) -> "GlobalPlan":
        from ..core import wire

        head, arr = wire.unpack(raw)
        starts = np.concatenate([[0], np.cumsum(arr["a_counts"])])
        flat = arr["a_flat"]
        return cls(
            int(head["world_size"]),
            [TensorSpec(f, d, tuple(s)) for f, d, s in head["tensors"]],
            list(head["value_keys"]),
            arr["u_tidx"], arr["u_offsets"], arr["u_lengths"], arr["u_writer"], arr["u_slot"],
            [flat[starts[r]:starts[r + 1]] for r in range(len(arr["a_counts"]))],
            {k: tuple(v) for k, v in head.get("per_rank", {}).items()},
        )


def _mix(x: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 finaliser: a well-spread 64-bit hash of each integer."""
    z = x.astype(np.uint64) + np.uint64(seed)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _union(plans: Sequence[LocalPlan]) -> tuple[list[TensorSpec], list[str], list[np.ndarray] | None]:
    """Every rank's tensors and value keys together (sorted by name) and, per rank, the map from its
    local tensor indices to the global ones (None when every rank passed the same table).

    Ranks may hold different keys (pipeline stages, keys only some ranks have); they must agree on the
    global shape and dtype of every tensor they share, and a key must not be a tensor on one rank and a
    plain value on another. Tables are compared by their bytes, so the work grows with the number of
    distinct tables (about one per pipeline stage), not with the number of ranks.
    """
    table = plans[0].table_json()
    if all(p.table_json() == table for p in plans[1:]):
        return list(plans[0].tensors), list(plans[0].value_keys), None
    first: dict[bytes, int] = {}
    for r, p in enumerate(plans):
        first.setdefault(p.table_json(), r)
    specs: dict[str, tuple[TensorSpec, int]] = {}
    vkeys: dict[str, int] = {}
    for r in first.values():
        for t in plans[r].tensors:
            seen = specs.setdefault(t.fqn, (t, r))
            if (seen[0].shape, seen[0].dtype) != (t.shape, t.dtype):
                a, ra = seen
                raise MismatchError(
                    f"tensor {t.fqn!r}: rank {ra} says global shape {list(a.shape)} {a.dtype}, rank {r} says "
                    f"{list(t.shape)} {t.dtype}; every rank must agree on the global shape and dtype"
                )
        for k in plans[r].value_keys:
            vkeys.setdefault(k, r)
    clash = sorted(set(specs) & set(vkeys))
    if clash:
        k = clash[0]
        raise MismatchError(
            f"key {k!r} is a tensor on rank {specs[k][1]} and a plain value on rank {vkeys[k]}; every rank must "
            "save it as the same kind"
        )
    names = sorted(specs)
    index = {n: i for i, n in enumerate(names)}
    maps = {tb: np.array([index[t.fqn] for t in plans[r].tensors], dtype=np.int64) for tb, r in first.items()}
    return [specs[n][0] for n in names], sorted(vkeys), [maps[p.table_json()] for p in plans]


def _pad(rows: np.ndarray, D: int) -> np.ndarray:
    """``[tidx | offsets | lengths]`` rows widened to ``D`` dimensions (offset 0, length 1)."""
    d = (rows.shape[1] - 1) // 2
    if d == D:
        return rows
    n = len(rows)
    return np.concatenate([rows[:, : 1 + d], np.zeros((n, D - d), rows.dtype), rows[:, 1 + d :],
                           np.ones((n, D - d), rows.dtype)], axis=1)


def _stack_per_rank(specs: list[TensorSpec], per_rank: dict[str, np.ndarray], tidx, offs, lens, rank):
    """Give each tensor stored per rank one leading dimension more, its row i holding holder i's copy.

    Returns the new specs and boxes (widened by one dimension when needed).
    """
    index = {t.fqn: i for i, t in enumerate(specs)}
    D = offs.shape[1]
    D2 = max([D] + [len(specs[index[k]].shape) + 1 for k in per_rank if k in index])
    if D2 > D:
        n = len(tidx)
        offs = np.concatenate([offs, np.zeros((n, D2 - D), offs.dtype)], axis=1)
        lens = np.concatenate([lens, np.ones((n, D2 - D), lens.dtype)], axis=1)
    else:
        offs, lens = offs.copy(), lens.copy()
    offs, lens = offs.astype(np.int64), lens.astype(np.int64)
    specs = list(specs)
    for k, holders in sorted(per_rank.items()):
        t = index.get(k)
        if t is None:
            continue
        spec = specs[t]
        nd = len(spec.shape)
        sel = np.flatnonzero(tidx == t)
        whole = (offs[sel, :nd] == 0).all(axis=1) & (lens[sel, :nd] == np.array(spec.shape, np.int64)).all(axis=1)
        pos = np.searchsorted(holders, rank[sel])
        ok = whole & (pos < len(holders))
        ok[ok] &= holders[pos[ok]] == rank[sel][ok]
        if not ok.all() or len(sel) != len(holders):
            i = sel[int(np.argmin(ok))] if not ok.all() else sel[0]
            raise MismatchError(
                f"tensor {k!r} differs between the ranks holding it whole, but rank {int(rank[i])} holds only a part "
                "of it (or holds it twice); a tensor stored per rank must be held whole by each of its holders. "
                "Make it a DTensor, or save each rank's copy under its own key"
            )
        o = offs[sel, :nd].copy()
        ln = lens[sel, :nd].copy()
        offs[sel, 0], lens[sel, 0] = pos, 1
        offs[sel, 1 : 1 + nd], lens[sel, 1 : 1 + nd] = o, ln
        specs[t] = TensorSpec(spec.fqn, spec.dtype, (len(holders),) + tuple(spec.shape))
    return specs, offs, lens


def _greedy(sizes: np.ndarray, loads: Sequence[int]) -> np.ndarray:
    """Largest first, each to the least-loaded holder (ties to the lowest position)."""
    heap = [(int(load), i) for i, load in enumerate(loads)]
    heapq.heapify(heap)
    out = np.empty(len(sizes), dtype=np.int64)
    for j, s in enumerate(sizes.tolist()):
        load, i = heapq.heappop(heap)
        out[j] = i
        heapq.heappush(heap, (load + s, i))
    return out


def plan_global(plans: Sequence[LocalPlan], per_rank: dict[str, np.ndarray] | None = None) -> GlobalPlan:
    """Validate and deduplicate every rank's chunks, and choose one balanced writer per unique chunk.

    ``per_rank``: tensors to store per rank (fqn -> sorted holder ranks, see :func:`classify_per_rank`);
    each holder writes its own whole copy as one row of a tensor with one leading dimension more.
    """
    W = len(plans)
    specs, value_keys, maps = _union(plans)
    D = max((len(t.shape) for t in specs), default=0)
    counts = np.array([len(p.rows) for p in plans], dtype=np.int64)
    n = int(counts.sum())
    if any(p.rows.shape[1] > 1 + 2 * D for p in plans if len(p.rows)):
        raise MismatchError("ranks disagree on tensor ranks (box dimensions)")
    rows = (np.concatenate([_pad(p.rows, D) for p in plans if len(p.rows)]) if n
            else np.zeros((0, 1 + 2 * D), np.int64))
    tidx, offs, lens = rows[:, 0], rows[:, 1 : 1 + D], rows[:, 1 + D :]
    if maps is not None and n:
        tidx = np.concatenate([m[p.tidx] for m, p in zip(maps, plans) if len(p.rows)])
    rank = np.repeat(np.arange(W, dtype=np.int32), counts)
    rank_first = np.cumsum(counts) - counts
    stacked = {k: np.asarray(v, np.int64) for k, v in (per_rank or {}).items()}
    if stacked:
        specs, offs, lens = _stack_per_rank(specs, stacked, tidx, offs, lens, rank)
        D = offs.shape[1]
    T = len(specs)
    itemsize = np.array([dtypes.itemsize(t.dtype) for t in specs], dtype=np.int64)
    numel = np.array([int(np.prod(t.shape, dtype=np.int64)) if t.shape else 1 for t in specs], dtype=np.int64)
    strides = np.zeros((T, D), dtype=np.int64)
    for t, spec in enumerate(specs):
        acc = 1
        for d in range(len(spec.shape) - 1, -1, -1):
            strides[t, d] = acc
            acc *= spec.shape[d]
    base = np.concatenate([[0], np.cumsum(numel)[:-1]]) if T else np.zeros(0, np.int64)

    # bounds (per dimension), and two keys per box: its first and its last element in a global index
    # space where tensor t occupies [base[t], base[t] + numel[t]). In bounds, the pair identifies the box.
    key = base[tidx]
    last = key.copy()
    bad = False
    for d in range(D):
        dim = np.array([sp.shape[d] if d < len(sp.shape) else 1 for sp in specs], dtype=np.int64)
        o, hi = offs[:, d], offs[:, d] + lens[:, d]
        bad = bad or bool(n and (o.min() < 0 or (hi <= o).any() or (hi > dim[tidx]).any()))
        st = strides[:, d][tidx]
        key += o * st
        hi -= 1
        last += hi * st
    if bad:
        spec_shape = np.array([list(sp.shape) + [1] * (D - len(sp.shape)) for sp in specs],
                              dtype=np.int64).reshape(T, D)
        out = ((offs < 0) | (lens <= 0) | (offs + lens > spec_shape[tidx])).any(axis=1)
        i = int(np.argmax(out))
        sp = specs[tidx[i]]
        nd = len(sp.shape)
        raise MismatchError(
            f"tensor {sp.fqn!r}: rank {rank[i]} holds box {Box(tuple(offs[i][:nd]), tuple(lens[i][:nd]))} "
            f"outside the global shape {list(sp.shape)} (or empty)"
        )
    order = np.lexsort((rank, key))
    key_s = key[order]
    new = np.ones(n, dtype=bool)
    np.not_equal(key_s[1:], key_s[:-1], out=new[1:])
    first = np.flatnonzero(new)
    U = len(first)
    cnt = np.diff(np.append(first, n))
    # equal first elements must come with equal last elements, else the boxes partially overlap
    last_s = last[order]
    same = last_s == np.repeat(last_s[first], cnt)
    if not same.all():
        i = int(np.argmin(same))
        g = int(np.searchsorted(first, i, side="right")) - 1
        a, b = order[i], order[first[g]]
        sp = specs[tidx[a]]
        nd = len(sp.shape)
        raise MismatchError(
            f"tensor {sp.fqn!r}: rank {rank[a]} holds box {Box(tuple(offs[a][:nd]), tuple(lens[a][:nd]))} "
            f"and rank {rank[b]} holds {Box(tuple(offs[b][:nd]), tuple(lens[b][:nd]))}: they partially overlap; "
            "shards of one tensor must be identical (replicas) or disjoint"
        )
    u_rows = order[first]
    u_tidx = tidx[u_rows]
    u_off = offs[u_rows].astype(np.int64)
    u_len = lens[u_rows].astype(np.int64)
    vol = u_len.prod(axis=1) if D else np.ones(U, np.int64)

    # every tensor tiled exactly: a vectorised grid test for all tensors, the general check for the rest
    spec_shape = np.array([list(sp.shape) + [1] * (D - len(sp.shape)) for sp in specs], dtype=np.int64).reshape(T, D)
    tiled = grid_tiles(u_tidx, u_off, u_len, spec_shape)
    starts = np.searchsorted(u_tidx, np.arange(T + 1))
    for t in np.flatnonzero(~tiled & (numel > 0)):
        spec = specs[t]
        if starts[t] == starts[t + 1]:
            raise MismatchError(f"tensor {spec.fqn!r}: no rank holds any part of it; check its placements")
        nd = len(spec.shape)
        sl = slice(starts[t], starts[t + 1])
        check_exact_cover(spec.fqn, spec.shape, u_off[sl, :nd], u_len[sl, :nd])

    nbytes = vol * itemsize[u_tidx]
    ranks_sorted = rank[order]
    # the writer of unique box u is the holder at sorted position first[u] + pick[u]
    pick = np.zeros(U, dtype=np.int64)
    single = cnt == 1
    load = np.bincount(ranks_sorted[first[single]], weights=nbytes[single], minlength=W).astype(np.int64)
    rep = np.flatnonzero(~single)
    if rep.size:
        _assign_replicated(rep, first, cnt, ranks_sorted, nbytes, pick, load, W)
    wpos = first + pick
    writer = ranks_sorted[wpos].astype(np.int64)
    w_entry = order[wpos]
    w_local = w_entry - rank_first[writer]
    by_writer = np.argsort(writer, kind="stable")
    per_rank = np.bincount(writer, minlength=W)
    rank_start = np.concatenate([[0], np.cumsum(per_rank)[:-1]])
    slot = np.empty(U, dtype=np.int64)
    slot[by_writer] = np.arange(U) - rank_start[writer[by_writer]]
    sorted_local = w_local[by_writer]
    assignments = [sorted_local[rank_start[r] : rank_start[r] + per_rank[r]] for r in range(W)]
    return GlobalPlan(W, list(specs), value_keys, u_tidx, u_off, u_len, writer, slot, assignments,
                      {k: tuple(int(r) for r in v) for k, v in stacked.items() if k in {t.fqn for t in specs}})


def _assign_replicated(rep, first, cnt, ranks_sorted, nbytes, pick, load, world: int) -> None:
    """Choose a holder for each replicated unique chunk (``pick[u]``: position among its holders).

    Chunks are grouped by holder set (all chunks of one replica group share it); groups are processed
    largest first, and within a group chunks go largest first to the least-loaded holder. Groups with
    the same chunk sizes and starting loads get the same pattern, computed once. Holder sets are
    compared by two 64-bit hashes; the pick is always a position among the chunk's own holders, so
    even a hash collision could only cost balance, never correctness.
    """
    m1 = _mix(np.arange(world), 0x9E3779B97F4A7C15)
    m2 = _mix(np.arange(world), 0xD1B54A32D192ED03)
    starts = first[rep]
    h1 = np.add.reduceat(m1[ranks_sorted], first)[rep]
    h2 = np.add.reduceat(m2[ranks_sorted], first)[rep]
    c = cnt[rep]
    g_order = np.lexsort((h2, h1, c))
    r = rep[g_order]
    h1, h2, c = h1[g_order], h2[g_order], c[g_order]
    brk = np.ones(len(r), dtype=bool)
    brk[1:] = (h1[1:] != h1[:-1]) | (h2[1:] != h2[:-1]) | (c[1:] != c[:-1])
    gstart = np.flatnonzero(brk)
    gend = np.append(gstart[1:], len(r))
    totals = np.add.reduceat(nbytes[r], gstart)
    del starts
    memo: dict = {}
    for g in np.argsort(-totals, kind="stable"):
        boxes = r[gstart[g] : gend[g]]
        boxes = boxes[np.argsort(-nbytes[boxes], kind="stable")]
        u0 = boxes[0]
        members = ranks_sorted[first[u0] : first[u0] + cnt[u0]]
        sizes = nbytes[boxes]
        init = load[members]
        key = (sizes.tobytes(), init.tobytes())
        pattern = memo.get(key)
        if pattern is None:
            pattern = memo[key] = _greedy(sizes, init)
        pick[boxes] = pattern
        load[members] += np.bincount(pattern, weights=sizes, minlength=len(members)).astype(np.int64)


# split into their own modules (issue 12); re-exported under their former home
from .per_rank import PerRank, classify_per_rank, content_table  # noqa: E402,F401
from .plan_cache import PlanCache  # noqa: E402,F401
