"""Who needs each stored chunk: the input of a local read-once schedule (:mod:`.read_once_local`).

A :class:`Wants` lists, for every stored chunk that some rank of a set ``ranks`` needs (one rank, or
the ranks of one host), every rank needing part of it and which part: not only the ranks of the set,
since the reader of a chunk's units is chosen among all of them. Two sources:

* :func:`grid_wants`: from the destination tensors' :class:`~hyperdcp.core.layout.GridLayout`, without
  enumerating the ranks. Along each tensor dimension the ranks' index runs are disjoint, so sorted by
  start they are found for a chunk by two binary searches; the ranks holding a combination of runs
  are one slice of the mesh (the mesh dimensions that replicate it). Work per chunk depends on the
  number of ranks needing it, never on the world size; tensors of one layout and chunk grid share it.
* :func:`plan_wants`: from every rank's exchanged plan (layouts that are not grids), keeping only the
  chunks the set needs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from math import prod
from typing import Iterable, Sequence

import numpy as np

from ..core.boxes import Box
from ..core.layout import REPLICATE, GridLayout, dim_runs
from ..core.shards import ShardedTensor
from ..format.metadata import Metadata
from .load_plan import TensorIndex

#: per stored chunk (tensor index, chunk index): the distinct boxes wanted from it, each with the
#: sorted ranks wanting it and (an iterable of) their piece numbers (-1 where not known: another rank's)
ChunkWants = list[tuple[Box, np.ndarray, Iterable[int]]]


@dataclass
class Wants:
    world: int
    total: int  # bytes of every stored chunk some rank (of the whole world) needs: sets the unit size
    chunks: dict[tuple[int, int], ChunkWants] = field(default_factory=dict)
    ranks: frozenset[int] | None = None  # the set this part is for (None: every rank)


class _DimRuns:
    """One tensor dim of a layout: every rank's index runs, sorted by start (disjoint, non-empty)."""

    def __init__(self, size: int, steps: list[tuple[int, int]], grid_shape: tuple[int, ...]):
        # steps: (mesh dim, split factor) of the mesh dims sharding this tensor dim, in mesh order
        ns = [grid_shape[i] for i, _ in steps]
        P = prod(ns)
        if not steps:
            per_sub = [[(0, size)] if size else []]
        elif all(f == 1 for _, f in steps):  # nested plain shards, vectorised over the sub-meshes
            coords = np.unravel_index(np.arange(P), ns)
            start, cur = np.zeros(P, np.int64), np.full(P, size, np.int64)
            for c, n in zip(coords, ns):
                ch = -(-cur // n)
                s = np.minimum(ch * c, cur)
                cur = np.minimum(cur, s + ch) - s
                start += s
            runs_sub = np.nonzero(cur > 0)[0]
            self._set(start[runs_sub], cur[runs_sub], runs_sub, np.zeros(len(runs_sub), np.int64))
            return
        else:  # strided shards: each sub-mesh position's runs by the layout's own rule
            per_sub = [dim_runs(size, [(n, f, int(c)) for (_, f), n, c in zip(steps, ns, np.unravel_index(k, ns))])
                       for k in range(P)]
        starts, lens, subs, local = [], [], [], []
        for k, runs in enumerate(per_sub):
            acc = 0
            for g, ln in runs:
                starts.append(g)
                lens.append(ln)
                subs.append(k)
                local.append(acc)
                acc += ln
        self._set(np.asarray(starts, np.int64), np.asarray(lens, np.int64), np.asarray(subs, np.int64),
                  np.asarray(local, np.int64))

    def _set(self, start, length, sub, local) -> None:
        order = np.argsort(start, kind="stable")
        self.start, self.length, self.sub = start[order], length[order], sub[order]
        self.end = self.start + self.length
        # per sub-mesh position its runs in local order: positions into the sorted arrays, by sub
        pos = np.empty(len(order), np.int64)
        pos[order] = np.arange(len(order))
        o = np.lexsort((local, sub))
        self._sub_key, self._sub_pos = sub[o], pos[o]

    def runs_of(self, k: int) -> list[int]:
        """Positions (into the sorted arrays) of the runs of sub-mesh position ``k``, in local order."""
        a, b = np.searchsorted(self._sub_key, [k, k + 1])
        return self._sub_pos[int(a):int(b)].tolist()

    def hits(self, lo: int, hi: int) -> range:
        """Positions of the runs that overlap [lo, hi)."""
        return range(int(np.searchsorted(self.end, lo, side="right")),
                     int(np.searchsorted(self.start, hi, side="left")))


class GridIndex:
    """A grid layout of one global shape, indexed to answer "who needs this box" per chunk."""

    def __init__(self, layout: GridLayout, shape: tuple[int, ...]):
        grid = np.asarray(layout.mesh, dtype=np.int64)
        sf = layout.split_factors or (1,) * grid.ndim
        self.steps = [[i for i, p in enumerate(layout.placements) if p == d] for d in range(len(shape))]
        free = [i for i, p in enumerate(layout.placements) if p == REPLICATE]
        self.dims = [_DimRuns(shape[d], [(i, sf[i]) for i in st], grid.shape) for d, st in enumerate(self.steps)]
        order = [i for st in self.steps for i in st] + free
        sizes = [prod(grid.shape[i] for i in st) for st in self.steps]
        self.lines = grid.transpose(order).reshape(tuple(sizes) + (-1,))  # [sub_0, ..., sub_nd-1] -> ranks
        self.grid = grid
        flat = grid.reshape(-1)
        self.where = np.full(int(flat.max()) + 1 if flat.size else 0, -1, np.int64)
        self.where[flat] = np.arange(flat.size)

    def rank_boxes(self, rank: int) -> list[Box]:
        """The boxes ``rank`` holds (none when it is not in the mesh), in its local order."""
        if not 0 <= rank < len(self.where) or self.where[rank] < 0:
            return []
        coord = np.unravel_index(int(self.where[rank]), self.grid.shape)
        per_dim = []
        for st, dr in zip(self.steps, self.dims):
            k = int(np.ravel_multi_index([coord[i] for i in st], [self.grid.shape[i] for i in st])) if st else 0
            per_dim.append([(int(dr.start[p]), int(dr.length[p])) for p in dr.runs_of(k)])
        return [Box(tuple(o for o, _ in c), tuple(n for _, n in c)) for c in itertools.product(*per_dim)]

    def chunk_wants(self, chunk: Box) -> list[tuple[Box, np.ndarray]]:
        """Every distinct box wanted from ``chunk`` with the sorted ranks wanting it."""
        per_dim = []
        for d, dr in enumerate(self.dims):
            lo, hi = chunk.offsets[d], chunk.offsets[d] + chunk.lengths[d]
            per_dim.append([(int(dr.sub[p]), max(lo, int(dr.start[p])), min(hi, int(dr.end[p])))
                            for p in dr.hits(lo, hi)])
        out = []
        for combo in itertools.product(*per_dim):
            ranks = np.sort(self.lines[tuple(s for s, _, _ in combo)].reshape(-1))
            out.append((Box(tuple(a for _, a, _ in combo), tuple(b - a for _, a, b in combo)), ranks))
        return out


class _SameGrid:
    """Results shared by tensors whose chunks have equal boxes (every layer of a model): compared
    by content (a memcmp), not hashed."""

    def __init__(self) -> None:
        self._seen: dict[tuple, list[tuple[np.ndarray, np.ndarray, object]]] = {}

    def get(self, key: bytes, ch) -> tuple[tuple, object]:
        offs, lens = np.asarray(ch.offsets), np.asarray(ch.lengths)
        k = (key, offs.shape)
        for o, ln, val in self._seen.get(k, ()):
            if np.array_equal(o, offs) and np.array_equal(ln, lens):
                return k, val
        return k, None

    def put(self, k: tuple, ch, val: object) -> None:
        self._seen.setdefault(k, []).append((np.asarray(ch.offsets), np.asarray(ch.lengths), val))


def _needed_bytes(ch) -> int:
    """Bytes of a tensor's non-empty chunks (a grid layout covers the tensor: every one is needed)."""
    if not len(ch):
        return 0
    lens = np.asarray(ch.lengths)
    total = int(np.asarray(ch.end).sum() - np.asarray(ch.begin).sum())
    if lens.ndim == 2 and lens.shape[1] and lens.min() <= 0:  # rare: some chunks are empty
        total = int((np.asarray(ch.end) - np.asarray(ch.begin))[np.all(lens > 0, axis=1)].sum())
    return total


def grid_wants(meta: Metadata, tensors: Sequence[ShardedTensor], world: int, ranks: Sequence[int],
               entries: dict[tuple[int, int, Box], int] | None = None, me: int = -1) -> Wants:
    """The wants of the chunks ``ranks`` need, every tensor having a grid layout (every rank loading
    the same tensors in the same layouts, which the digest exchange checked). ``entries``: rank
    ``me``'s piece number per (tensor index, chunk index, box)."""
    names = {name: i for i, name in enumerate(meta.tensors)}
    tindex = TensorIndex(meta)
    grids: dict[bytes, GridIndex] = {}
    cache = _SameGrid()
    out = Wants(world, 0, {}, frozenset(ranks))
    for st in tensors:
        ti = names[st.fqn]
        stored = meta.tensors[st.fqn]
        out.total += _needed_bytes(stored.chunks)
        shape = tuple(int(s) for s in stored.shape)
        key = st.layout.key(shape)
        gkey, hit = cache.get(key, stored.chunks)
        if hit is None:
            gi = grids.get(key) or grids.setdefault(key, GridIndex(st.layout, shape))
            need: set[int] = set()
            for r in ranks:
                for box in gi.rank_boxes(r):
                    if box.numel > 0:
                        need.update(tindex.get(st.fqn).query(box).tolist())
            hit = []
            for ci in sorted(need):
                cb = stored.chunks.box(ci)
                if cb.numel > 0:
                    hit.append((ci, gi.chunk_wants(cb)))
            hit = [(ci, [(box, rs, rs.tolist(), me in rs.tolist()) for box, rs in w]) for ci, w in hit]
            cache.put(gkey, stored.chunks, hit)
        for ci, wants in hit:
            out.chunks[(ti, ci)] = [(box, rs, _entries(entries, me, ti, ci, box, rl) if has else _NONE)
                                    for box, rs, rl, has in wants]
    return out


class _NoEntries:
    """Piece numbers of ranks other than the one planning: unknown (-1)."""

    def __iter__(self):
        return itertools.repeat(-1)


_NONE = _NoEntries()


def _entries(entries, me: int, ti: int, ci: int, box: Box, rl: list[int]) -> list[int]:
    e = [-1] * len(rl)
    if entries is not None:
        e[rl.index(me)] = entries[(ti, ci, box)]
    return e


def plan_wants(meta: Metadata, plans: Sequence[Sequence[tuple[int, int, Box]]],
               ranks: Sequence[int] | None = None) -> Wants:
    """The wants of the chunks ``ranks`` (default: every rank) need, from every rank's plan."""
    names = list(meta.tensors)
    keep = None
    if ranks is not None:
        keep = {(ti, ci) for r in ranks for ti, ci, _ in plans[r]}
    by: dict[tuple[int, int], dict[Box, list[tuple[int, int]]]] = {}
    seen: set[tuple[int, int]] = set()
    for r, plan in enumerate(plans):
        for e, (ti, ci, box) in enumerate(plan):
            seen.add((ti, ci))
            if keep is None or (ti, ci) in keep:
                by.setdefault((ti, ci), {}).setdefault(box, []).append((r, e))
    total = 0
    for ti, ci in seen:
        ch = meta.tensors[names[ti]].chunks
        total += int(ch.end[ci] - ch.begin[ci])
    out = Wants(len(plans), total, {}, frozenset(ranks) if ranks is not None else None)
    for k, boxes in by.items():
        wl = []
        for box, who in boxes.items():
            a = np.asarray(sorted(who), np.int64).reshape(-1, 2)
            wl.append((box, a[:, 0].copy(), a[:, 1].tolist()))
        out.chunks[k] = wl
    return out


def own_plan(meta: Metadata, tensors: Sequence[ShardedTensor], rank: int) -> list[tuple[int, int, Box]]:
    """``rank``'s plan from the tensors' grid layouts: the pieces :func:`~.load_plan.pieces_for` gives
    over its shards, in the same order, when the layouts describe its shards (what the digest checks)."""
    names = {name: i for i, name in enumerate(meta.tensors)}
    tindex = TensorIndex(meta)
    grids: dict[bytes, GridIndex] = {}
    cache = _SameGrid()
    out: list[tuple[int, int, Box]] = []
    for st in tensors:
        stored = meta.tensors[st.fqn]
        shape = tuple(int(s) for s in stored.shape)
        key = st.layout.key(shape)
        gkey, hit = cache.get(key, stored.chunks)
        if hit is None:
            gi = grids.get(key) or grids.setdefault(key, GridIndex(st.layout, shape))
            hit = []
            for box in gi.rank_boxes(rank):
                if box.numel > 0:
                    for c in tindex.get(st.fqn).query(box).tolist():
                        inter = box.intersect(stored.chunks.box(c))
                        if inter is not None:
                            hit.append((c, inter))
            cache.put(gkey, stored.chunks, hit)
        ti = names[st.fqn]
        out.extend((ti, c, inter) for c, inter in hit)
    return out
